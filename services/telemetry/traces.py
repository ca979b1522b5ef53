"""``RequestTraces``: the scheduler-side map rid -> ``RequestSpan`` that the gRPC executor feeds per stage op."""

from __future__ import annotations

from collections.abc import Iterable

from cdb_scheduler.plan import HeadOp, LoopOp, StageOp, StageResult
from services.telemetry.spans import RequestSpan


class RequestTraces:
    """Scheduler-side map request id → ``RequestSpan``: which traceparents each stage still needs, and stage
    hops. Hop spans are kept for the prefill and the first ``detail_tokens`` decode tokens of each traced
    request (the per-token hops of a long generation would cost more than the 3 % budget; the stage batch spans
    cover every op). Every method returns at once when no traced request is live. ``register``,
    ``contexts_for*`` and ``on_*`` belong to the thread that drives the executor; ``RequestSpan.finish`` (which
    unregisters) may run on another thread: the per-op paths tolerate a request ending under them."""

    def __init__(self, detail_tokens: int = 4) -> None:
        self.detail_tokens = detail_tokens
        self._spans: dict[int, RequestSpan] = {}
        self._watch: set[int] = set()  # requests whose hops are still recorded
        self._unsent: dict[str, set[int]] = {}  # per stage: registered requests whose context it has not got

    def register(self, rid: int, span: RequestSpan) -> None:
        """Track ``span`` under the scheduler's ``rid``; ``span.finish`` forgets it."""
        if not span.recording or span._ended:
            return
        span._owner, span._detail_left = (self, rid), self.detail_tokens
        self._spans[rid] = span
        self._watch.add(rid)
        for unsent in list(self._unsent.values()):
            unsent.add(rid)

    def get(self, rid: int) -> RequestSpan | None:
        """The live traced request span of ``rid``, if any."""
        return self._spans.get(rid)

    def __len__(self) -> int:
        return len(self._spans)

    def _forget(self, rid: int) -> None:
        self._spans.pop(rid, None)
        self._watch.discard(rid)
        for unsent in list(self._unsent.values()):
            unsent.discard(rid)

    def contexts_for(self, stage: str, rids: Iterable[int], released: Iterable[int] = ()) -> dict[int, str]:
        """Traceparents to put in the next message to ``stage`` (ops to one stage are sent in order): those of
        the op's requests that the stage does not hold, i.e. never sent or dropped with ``released``."""
        if not self._spans:
            return {}
        unsent = self._unsent.get(stage)
        if unsent is None:
            unsent = self._unsent[stage] = set(self._spans)
        for rid in released:
            if rid in self._spans:
                unsent.add(rid)
        hits = unsent.intersection(rids) if unsent else ()
        if not hits:
            return {}
        unsent.difference_update(hits)
        spans = self._spans
        return {rid: span.traceparent for rid in hits if (span := spans.get(rid)) is not None}

    def contexts_for_op(self, op: StageOp) -> dict[int, str]:
        """``contexts_for`` of a plan op (stage name, its requests, its ``released`` ids)."""
        return self.contexts_for(op.stage.role, op.rids, op.released)

    def on_hop(
        self,
        stage: str,
        seq: int,
        rids: Iterable[int],
        start_ns: int,
        end_ns: int,
        compute_s: float,
        steps: int = 1,
        error: str | None = None,
        sampled: Iterable[int] = (),
    ) -> None:
        """Stage op ``seq`` of ``stage`` (sent at ``start_ns``, result at ``end_ns``) served ``rids``;
        for a head op, ``sampled`` are the requests it sampled a token for."""
        if not self._watch:
            return
        spans, got = self._spans, set(sampled)
        for rid in self._watch.intersection(rids):
            if (span := spans.get(rid)) is not None:  # it may have finished on another thread meanwhile
                span.hop(stage, seq, start_ns, end_ns, compute_s, steps, error, rid in got)

    def on_op_done(self, op: StageOp, result: StageResult, sent_ns: int, done_ns: int) -> None:
        """``on_hop`` of a plan op and its result."""
        if self._watch:
            steps = op.num_steps if isinstance(op, LoopOp) and op.prefill else 1
            sampled = [r for r, s in zip(op.rids, op.sample) if s] if isinstance(op, HeadOp) else ()
            stage = op.stage.role
            self.on_hop(stage, op.seq, op.rids, sent_ns, done_ns, result.compute_s, steps, result.error, sampled)
