"""The public API of a serving process (``cdb.v1.Generation`` over gRPC; the HTTP API is ``services.http``).

| module | what |
|---|---|
| ``door`` | ``FrontDoor``: admission, the live registry, shares, finishing, draining, aborts, the health verdict |
| ``handlers`` | the gRPC handlers: protobuf -> door -> protobuf |
| ``messages`` | protobuf <-> engine types |
| ``info`` | the ``Info`` reply of a scheduler process |
| ``readiness`` | the periodic health check (``grpc.health.v1`` and the door's verdict) |
| ``shares`` | per-caller shares, the gRPC call caps, stalled streams |
| ``security`` | TLS, API keys, caller scopes |
| ``errors`` / ``decoding`` | the one exception -> status map; request deserializers that never raise |
| ``server`` | the public gRPC server, the drain, and the scheduler process (``run_scheduler``) |
| ``fatal`` | exit when the engine loop fails |
"""
