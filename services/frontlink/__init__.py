"""The front-end link: the scheduler process's engine served to front-end processes (``CDB_FRONTENDS``).

| module | what |
|---|---|
| ``wire`` | frames on a Unix socket, the authenticated handshake, the typed messages |
| ``server`` | ``LinkServer``: the scheduler's end |
| ``client`` | ``LinkClient`` (the connection), ``RemoteClient`` (the ``EngineClient`` over it), ``MetricsRelay`` |
"""
