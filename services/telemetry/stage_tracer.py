"""``StageTracer``: a ROOT span per executed batch in a stage process, linked to the requests it served."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.trace import SpanContext

from cdb_scheduler.plan import LoopOp, StageOp
from services.telemetry.lean import link_field
from services.telemetry.setup import STATE, parse_traceparent


class StageTracer:
    """Stage-side batch spans: one root span ``batch <stage>`` per op, linked to the request span of every
    sampled request it served. Keeps request id → link, fed by the traceparents in stage messages."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self._name = f"batch {stage}"
        self._links: dict[int, tuple[SpanContext, bytes]] = {}

    def __len__(self) -> int:
        return len(self._links)

    def update(self, contexts: Mapping[int, str], released: Iterable[int] = ()) -> None:
        """Apply one message: forget ``released`` requests first, then learn ``contexts`` (id → traceparent)."""
        links = self._links
        for rid in released:
            links.pop(rid, None)
        if contexts and STATE.enabled:
            for rid, value in contexts.items():
                ctx = parse_traceparent(value)
                if ctx is not None and ctx.trace_flags.sampled:
                    links[rid] = (ctx, link_field(ctx))

    def record(
        self,
        seq: int,
        rids: Sequence[int],
        start_ns: int,
        end_ns: int,
        compute_s: float,
        attributes: Mapping[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        """Record op ``seq`` (computed from ``start_ns`` to ``end_ns``; one entry of ``rids`` per token)."""
        lean = STATE.lean
        if lean is None:
            return
        links = list(map(self._links.get, rids)) if self._links else None
        lean.add(("b", self._name, seq, links, len(rids), start_ns, end_ns, compute_s, attributes, error))

    def record_op(self, op: StageOp, start_ns: int, end_ns: int, compute_s: float, error: str | None = None) -> None:
        """``record`` of a plan op; loop ops add ``cdb.loop.prefill`` and ``cdb.loop.num_steps``."""
        if STATE.lean is None:
            return
        extra = {"cdb.loop.prefill": op.prefill, "cdb.loop.num_steps": op.num_steps} if isinstance(op, LoopOp) else None
        self.record(op.seq, op.rids, start_ns, end_ns, compute_s, extra, error)
