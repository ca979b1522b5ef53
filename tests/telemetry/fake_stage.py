"""A stand-in stage process for the multi-process tracing test: ``python fake_stage.py STAGE``.

Reads one JSON message per line on stdin, shaped like a stage batch message: ``contexts`` (request id →
traceparent, for requests new to this stage), ``released``, ``seq``, ``rids`` and the op's timing; records
the op's batch span exactly as a stage server does (``StageTracer.update`` then ``record``), answers ``ok`` on
stdout, and flushes its spans at EOF. Tracing is configured by the ``OTEL_*`` environment only.
"""

from __future__ import annotations

import json
import sys

from services import telemetry


def main(stage: str) -> None:
    telemetry.init_tracing(f"cdb-{stage}")
    tracer = telemetry.StageTracer(stage)
    for line in sys.stdin:
        msg = json.loads(line)
        tracer.update({int(k): v for k, v in msg["contexts"].items()}, msg["released"])
        tracer.record(msg["seq"], msg["rids"], msg["start_ns"], msg["end_ns"], msg["compute_s"])
        print("ok", flush=True)
    telemetry.shutdown_tracing()


if __name__ == "__main__":
    main(sys.argv[1])
