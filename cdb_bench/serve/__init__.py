"""``cdb bench serve``: the open-loop serving benchmark for looped models (see ``cdb_bench.serve.cli``).

Modules: ``arrivals`` (Poisson and gamma arrival processes), ``lengths`` (ShareGPT- and Alpaca-like length fits),
``requests`` (the seeded request list, the same for every mode), ``driver`` (the asyncio open-loop client),
``targets`` (in-process engine or a deployment through the public gRPC API), ``metrics`` (per-request latencies
and per-run summaries), ``knee`` (capacity knee by bisection), ``sweep`` (modes x rates), ``report`` (table, JSON,
plots), ``cli`` (the command).
"""
