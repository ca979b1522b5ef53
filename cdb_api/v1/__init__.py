"""Generated stubs of package ``cdb.v1``: ``generation_pb2`` (public API) and ``stage_pb2`` (internal)."""
