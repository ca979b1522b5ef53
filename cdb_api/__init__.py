"""Generated gRPC/protobuf stubs of the cdb API (from ``protos/``). Regenerate with ``make protos``."""
