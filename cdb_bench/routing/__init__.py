"""``cdb bench routing``: routing policies over replicas, simulated and measured (see ``cdb_bench.routing.cli``).

Modules: ``costs`` (per-op costs measured on this machine, fitted to lines), ``workload`` (the serving
benchmark's request set with a deep fraction; what a router sees of a request), ``policies`` (round-robin,
least-outstanding, segregation), ``sim`` (the discrete-event simulation of K replicas of continuous depth
batching), ``live`` (the same policies through the real clients over local replicas), ``report`` (tables, JSON,
plot, the client-default decision), ``cli`` (the command).
"""
