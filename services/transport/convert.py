"""Conversions between the stage-op contract (``cdb_scheduler.plan``) and the internal protobuf messages.

The only place where plan dataclasses meet ``stage_pb2``. Round trips are exact: ids and positions are integers,
sampling values and signals travel as doubles, and every field of every op survives (tested). Protobuf types
stop here: the executor and the stage server see plan objects only.

A loop op's per-token columns, and a head's with its sampling settings, travel packed (``LoopBatch.columns``,
``HeadBatch.columns``: little-endian fixed-width numbers, one ``struct`` call each way): for a width-64 loop op that
is a third of the conversion that four repeated fields per column cost. Messages with the repeated fields filled
instead are read as before.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

from cdb_api.v1 import stage_pb2 as pb
from cdb_scheduler.plan import (
    Fence,
    HeadOp,
    HistorySeed,
    KVCopy,
    KVUpdate,
    LogitsProcessing,
    LoopHead,
    LoopOp,
    PreludeOp,
    SamplingParams,
    Stage,
    StageOp,
    StageResult,
    TokenLogprobs,
)
from services.transport.bank import BankSpec, CudaIpcHandle

_MASK64 = (1 << 64) - 1
_TEMPERATURE, _TOP_K, _TOP_P, _SEED, _LOGPROBS, _RETURN_LOGPROB, _PROCESSING = (
    attrgetter(name) for name in ("temperature", "top_k", "top_p", "seed", "logprobs", "return_logprob", "processing")
)

_LOOP_COLUMNS = 4  # rids, positions, rows, steps: int64
_HEAD_COLUMNS = "qqqqdqdQq?"  # rids, positions, rows, token_index, temperature, top_k, top_p, seed, logprobs, ret.
_LAYOUT = {  # kind -> bytes per token, columns
    "loop": (8 * _LOOP_COLUMNS, _LOOP_COLUMNS),
    "head": (struct.calcsize("<" + _HEAD_COLUMNS), len(_HEAD_COLUMNS)),
}
_STRUCTS: dict[tuple[str, int], struct.Struct] = {}  # (kind, tokens) -> its packing


def _columns(kind: str, n: int) -> struct.Struct:
    packing = _STRUCTS.get((kind, n))
    if packing is None:
        if len(_STRUCTS) >= 4096:  # widths are bounded; a burst of odd ones does not grow this for ever
            _STRUCTS.clear()
        spec = f"{_LOOP_COLUMNS * n}q" if kind == "loop" else "".join(f"{n}{c}" for c in _HEAD_COLUMNS)
        packing = _STRUCTS[(kind, n)] = struct.Struct("<" + spec)
    return packing


def _unpacked(kind: str, data: bytes) -> tuple[tuple[int | float | bool, ...], ...]:
    """The columns of a packed ``kind`` block (``_LAYOUT``: its bytes per token, its columns); ValueError for a
    truncated block."""
    row_bytes, count = _LAYOUT[kind]
    n, extra = divmod(len(data), row_bytes)
    if extra:
        raise ValueError(f"{kind} columns: {len(data)} bytes is not a whole number of {row_bytes}-byte tokens")
    flat = _columns(kind, n).unpack(data)
    return tuple(flat[i * n : (i + 1) * n] for i in range(count))


_ROLE_TO_PB = {Stage.PRELUDE: pb.STAGE_ROLE_PRELUDE, Stage.LOOP: pb.STAGE_ROLE_LOOP, Stage.HEAD: pb.STAGE_ROLE_HEAD}
_PB_TO_ROLE = {v: k for k, v in _ROLE_TO_PB.items()}
_BANK_KIND = {"shm": pb.BANK_KIND_SHM, "cuda_ipc": pb.BANK_KIND_CUDA_IPC}
_BANK_KIND_NAME = {v: k for k, v in _BANK_KIND.items()}


def role_to_pb(stage: Stage) -> pb.StageRole:
    return _ROLE_TO_PB[stage]


def role_from_pb(role: pb.StageRole) -> Stage:
    try:
        return _PB_TO_ROLE[role]
    except KeyError:
        raise ValueError(f"invalid stage role {role}") from None


def op_to_pb(op: StageOp, traceparent: str = "", trace_contexts: Mapping[int, str] | None = None) -> pb.StageBatch:
    """One stage op as the batch message of its stage's Run stream (with optional W3C trace context). ValueError
    for a value its field cannot carry (its packed column's or its protobuf field's range)."""
    try:
        return _op_to_pb(op, traceparent, trace_contexts)
    except struct.error as exc:
        raise ValueError(f"{op.stage.role} op {op.seq}: a column value out of range ({exc})") from None


def _op_to_pb(op: StageOp, traceparent: str, trace_contexts: Mapping[int, str] | None) -> pb.StageBatch:
    msg = pb.StageBatch(seq=op.seq, released=op.released, traceparent=traceparent)
    if trace_contexts:
        msg.trace_contexts.update(trace_contexts)
    msg.fences.extend(pb.Fence(stage=_ROLE_TO_PB[f.stage], seq=f.seq) for f in op.fences)
    msg.kv_updates.extend(pb.KVUpdate(rid=u.rid, append=u.append, reset=u.reset) for u in op.kv_updates)
    if isinstance(op, PreludeOp):
        msg.prelude.rids.extend(op.rids)
        msg.prelude.token_ids.extend(op.token_ids)
        msg.prelude.positions.extend(op.positions)
        msg.prelude.rows.extend(op.rows)
        msg.prelude.init_seeds.extend(op.init_seeds)
    elif isinstance(op, LoopOp):
        loop = msg.loop
        loop.columns = _columns("loop", len(op.rids)).pack(*op.rids, *op.positions, *op.rows, *op.steps)
        loop.prefill = op.prefill
        loop.num_steps = op.num_steps
        if op.kv_copies:
            loop.copy_rids.extend([c.rid for c in op.kv_copies])
            loop.copy_positions.extend([c.position for c in op.kv_copies])
            loop.copy_from_slots.extend([c.from_slot for c in op.kv_copies])
        if op.head is not None:
            h = op.head
            _head_columns(loop.head, h.rids, h.positions, h.rows, h.token_index, h.sampling)
            loop.head.embed_ids.extend(h.embed_ids)
            loop.head.embed_rows.extend(h.embed_rows)
            _history_to_pb(loop.head, h.history)
    else:
        head = msg.head
        _head_columns(head, op.rids, op.positions, op.rows, op.token_index, op.sampling)
        head.sample.extend(op.sample)
        head.embed.extend(op.embed)
        head.score_ids.extend(op.score_ids)
        _history_to_pb(head, op.history)
    return msg


def _head_columns(
    head: pb.HeadBatch,
    rids: Sequence[int],
    positions: Sequence[int],
    rows: Sequence[int],
    token_index: Sequence[int],
    sampling: Sequence[SamplingParams],
) -> None:
    head.columns = _columns("head", len(rids)).pack(
        *rids,
        *positions,
        *rows,
        *token_index,
        *map(_TEMPERATURE, sampling),  # attrgetter maps: C loops, no generator frames
        *map(_TOP_K, sampling),
        *map(_TOP_P, sampling),
        *(_MASK64 & seed for seed in map(_SEED, sampling)),
        *map(_LOGPROBS, sampling),
        *map(_RETURN_LOGPROB, sampling),
    )
    if any(map(_PROCESSING, sampling)):
        for i, p in enumerate(sampling):
            if (proc := p.processing) is not None:
                head.processing.add(
                    index=i,
                    presence_penalty=proc.presence_penalty,
                    frequency_penalty=proc.frequency_penalty,
                    repetition_penalty=proc.repetition_penalty,
                    bias_ids=[t for t, _ in proc.logit_bias],
                    bias_values=[b for _, b in proc.logit_bias],
                    min_tokens=proc.min_tokens,
                    stop_ids=proc.stop_ids,
                )


def _history_to_pb(head: pb.HeadBatch, history: Sequence[HistorySeed]) -> None:
    for seed in history:
        head.history.add(index=seed.index, prompt_ids=seed.prompt_ids, output_ids=seed.output_ids)


def _history_of(h: pb.HeadBatch) -> tuple[HistorySeed, ...]:
    return tuple(HistorySeed(s.index, tuple(s.prompt_ids), tuple(s.output_ids)) for s in h.history)


_PARAMS: dict[tuple[float, int, float, int, int, bool], SamplingParams] = {}  # the same settings, one object
_PARAMS_KEPT = 8192  # distinct settings kept (each request has its own seed): emptied when full


def sampling_params(key: tuple[float, int, float, int, int, bool]) -> SamplingParams:
    """The settings ``(temperature, top_k, top_p, seed, logprobs, return_logprob)`` as one shared object."""
    params = _PARAMS.get(key)
    if params is None:
        if len(_PARAMS) >= _PARAMS_KEPT:
            _PARAMS.clear()
        t, k, p, s, n, r = key
        params = _PARAMS[key] = SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, logprobs=n, return_logprob=r)
    return params


def _head_of(
    h: pb.HeadBatch,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[SamplingParams, ...]]:
    """A head's rids, positions, rows, token indices and sampling settings (packed, or in repeated fields)."""
    if h.columns:
        rids, positions, rows, token_index, *settings = _unpacked("head", h.columns)
    else:
        rids, positions, rows, token_index = tuple(h.rids), tuple(h.positions), tuple(h.rows), tuple(h.token_index)
        settings = [h.temperature, h.top_k, h.top_p, h.seed, h.logprobs, h.return_logprob]
    return rids, positions, rows, token_index, _sampling_of(h, settings)  # type: ignore[return-value]


def _sampling_of(h: pb.HeadBatch, settings: Sequence[Sequence[Any]]) -> tuple[SamplingParams, ...]:
    # A request's settings arrive with every op that samples it: made into an object once (a frozen dataclass
    # costs more to build than to look up), not once per op.
    params = list(map(sampling_params, zip(*settings)))
    for proc in h.processing:
        params[proc.index] = dataclasses.replace(
            params[proc.index],
            processing=LogitsProcessing(
                presence_penalty=proc.presence_penalty,
                frequency_penalty=proc.frequency_penalty,
                repetition_penalty=proc.repetition_penalty,
                logit_bias=tuple(zip(proc.bias_ids, proc.bias_values, strict=True)),
                min_tokens=proc.min_tokens,
                stop_ids=tuple(proc.stop_ids),
            ),
        )
    return tuple(params)


def op_from_pb(msg: pb.StageBatch) -> StageOp:
    """The stage op of a batch message. Raises ValueError for a ping or an empty batch."""
    fences = tuple(Fence(_PB_TO_ROLE[f.stage], f.seq) for f in msg.fences)
    kv_updates = tuple(KVUpdate(u.rid, tuple(u.append), u.reset) for u in msg.kv_updates)
    released = tuple(msg.released)
    which = msg.WhichOneof("work")
    if which == "prelude":
        p = msg.prelude
        return PreludeOp(
            msg.seq,
            fences,
            kv_updates,
            released,
            rids=tuple(p.rids),
            token_ids=tuple(p.token_ids),
            positions=tuple(p.positions),
            rows=tuple(p.rows),
            init_seeds=tuple(p.init_seeds),
        )
    if which == "loop":
        lp = msg.loop
        if lp.columns:
            rids, positions, rows, steps = _unpacked("loop", lp.columns)
        else:
            rids, positions, rows, steps = tuple(lp.rids), tuple(lp.positions), tuple(lp.rows), tuple(lp.steps)
        return LoopOp(
            msg.seq,
            fences,
            kv_updates,
            released,
            rids=rids,  # type: ignore[arg-type]
            positions=positions,  # type: ignore[arg-type]
            rows=rows,  # type: ignore[arg-type]
            steps=steps,  # type: ignore[arg-type]
            prefill=lp.prefill,
            num_steps=lp.num_steps,
            kv_copies=tuple(map(KVCopy, lp.copy_rids, lp.copy_positions, lp.copy_from_slots)),
            head=_loop_head(lp.head) if lp.HasField("head") else None,
        )
    if which == "head":
        h = msg.head
        rids, positions, rows, token_index, sampling = _head_of(h)
        return HeadOp(
            msg.seq,
            fences,
            kv_updates,
            released,
            rids=rids,
            positions=positions,
            rows=rows,
            sample=tuple(h.sample),
            sampling=sampling,
            token_index=token_index,
            embed=tuple(h.embed),
            score_ids=tuple(h.score_ids),
            history=_history_of(h),
        )
    raise ValueError(f"batch {msg.seq} carries no stage work ({which})")


def _loop_head(h: pb.HeadBatch) -> LoopHead:
    rids, positions, rows, token_index, sampling = _head_of(h)
    return LoopHead(
        rids=rids,
        positions=positions,
        rows=rows,
        sampling=sampling,
        token_index=token_index,
        embed_ids=tuple(h.embed_ids),
        history=_history_of(h),
        embed_rows=tuple(h.embed_rows),
    )


def result_to_pb(res: StageResult) -> pb.StageReply:
    """A stage's completion as its reply message."""
    msg = pb.StageReply(
        seq=res.seq,
        stage=_ROLE_TO_PB[res.stage],
        compute_s=res.compute_s,
        signals=res.signals,
        lookahead=res.lookahead,
        token_ids=res.token_ids,
        error=res.error or "",
    )
    if res.logprobs and not any(res.logprobs):  # (TokenLogprobs objects are truthy)
        msg.no_logprobs = len(res.logprobs)
    else:
        for lp in res.logprobs:
            if lp is None:
                msg.logprobs.add()
            else:
                msg.logprobs.add(present=True, logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs)
    for lp in res.prompt_logprobs:
        msg.prompt_logprobs.add(present=True, logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs)
    return msg


def result_from_pb(msg: pb.StageReply) -> StageResult:
    """The StageResult of a reply message (``fence_wait_s`` and ``pong`` are the transport's business)."""
    logprobs: tuple[TokenLogprobs | None, ...] = (None,) * msg.no_logprobs or tuple(
        TokenLogprobs(lp.logprob, tuple(lp.top_ids), tuple(lp.top_logprobs)) if lp.present else None
        for lp in msg.logprobs
    )
    return StageResult(
        stage=_PB_TO_ROLE[msg.stage],
        seq=msg.seq,
        compute_s=msg.compute_s,
        signals=tuple(msg.signals),
        lookahead=tuple(msg.lookahead),
        token_ids=tuple(msg.token_ids),
        logprobs=logprobs,
        error=msg.error or None,
        prompt_logprobs=tuple(
            TokenLogprobs(lp.logprob, tuple(lp.top_ids), tuple(lp.top_logprobs)) for lp in msg.prompt_logprobs
        ),
    )


def bank_spec_to_pb(spec: BankSpec) -> pb.BankSpec:
    msg = pb.BankSpec(kind=_BANK_KIND[spec.kind], name=spec.name, rows=spec.rows, width=spec.width, dtype=spec.dtype)
    if spec.cuda is not None:
        c = spec.cuda
        msg.cuda.CopyFrom(
            pb.CudaIpcHandle(
                device=c.device,
                handle=c.handle,
                size_bytes=c.size_bytes,
                offset_bytes=c.offset_bytes,
                ref_counter_handle=c.ref_counter_handle,
                ref_counter_offset=c.ref_counter_offset,
                event_handle=c.event_handle,
                event_sync_required=c.event_sync_required,
            )
        )
    return msg


def bank_spec_from_pb(msg: pb.BankSpec) -> BankSpec:
    kind = _BANK_KIND_NAME.get(msg.kind)
    if kind is None:
        raise ValueError(f"invalid bank kind {msg.kind}")
    cuda = None
    if msg.HasField("cuda"):
        c = msg.cuda
        cuda = CudaIpcHandle(
            c.device,
            c.handle,
            c.size_bytes,
            c.offset_bytes,
            c.ref_counter_handle,
            c.ref_counter_offset,
            c.event_handle,
            c.event_sync_required,
        )
    return BankSpec(kind, msg.name, msg.rows, msg.width, msg.dtype, cuda)
