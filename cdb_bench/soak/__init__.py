"""``cdb bench soak``: the benchmark and what it reports are described in ``cdb_bench.soak.cli``.

Modules: ``requests`` (the drawn requests, their outcomes, the fault-free reference), ``replicas`` (the process
trees, their probes, what each holds once idle), ``faults`` (the injectors and the recovery watchers), ``traffic``
(the streaming clients), ``summary`` (figures, verdict, report), ``cli`` (the command).
"""

from cdb_bench.soak.cli import build_parser, main
from cdb_bench.soak.faults import KINDS

__all__ = ["KINDS", "build_parser", "main"]
