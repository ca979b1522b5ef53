"""The continuous-depth-batching scheduler (plain Python: no torch, no grpc).

Where ``cdb native build`` has compiled it (mypyc) and the build matches these sources, the
compiled modules are imported instead; ``NATIVE`` says whether they are (``CDB_NATIVE=off``: never).
"""

from cdb_scheduler._native import attach as _attach

NATIVE = _attach(__path__)
