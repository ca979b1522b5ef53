"""``cdb bench apicost``: the CPU each output token costs the serving processes through the public API, by process
and by activity (``cli`` for the command, ``measure`` for one point, ``activities`` for the sampled split,
``load`` for the client process)."""
