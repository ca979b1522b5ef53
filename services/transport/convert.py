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
from itertools import chain
from typing import Any

from cdb_api.v1 import stage_pb2 as pb
from cdb_scheduler.plan import (
    Fence,
    HeadOp,
    HistorySeed,
    KVCopy,
    KVUpdate,
    LoopHead,
    LoopOp,
    PreludeOp,
    Stage,
    StageOp,
    StageResult,
)
from cdb_scheduler.sampling import LogitsProcessing, SamplingParams, TokenLogprobs
from services.transport.bank import BankSpec, CudaIpcHandle
from services.transport.opfields import (
    HEAD_COLUMNS,
    HEAD_OP_COLUMNS,
    LOOP_COLUMNS,
    LOOP_HEAD_COLUMNS,
    PRELUDE_COLUMNS,
    SAMPLING_CODES,
    SAMPLING_NAMES,
    SETTING,
    getter,
    sampling_params,
    setting_columns,
)

_PRELUDE_OF, _LOOP_OF, _HEAD_OF = map(getter, (PRELUDE_COLUMNS, LOOP_COLUMNS, HEAD_COLUMNS))
_PROCESSING = SETTING["processing"]
# A head's columns beyond the packed ones travel in its repeated fields of the same names.
_HEAD_OP_REPEATED = (*HEAD_OP_COLUMNS[len(HEAD_COLUMNS) :], "embed")
_LOOP_HEAD_REPEATED = LOOP_HEAD_COLUMNS[len(HEAD_COLUMNS) :]
_FORMAT = {  # kind -> the struct codes of one token's packed columns
    "loop": "q" * len(LOOP_COLUMNS),
    "head": "q" * len(HEAD_COLUMNS) + SAMPLING_CODES,
}
_HEAD_FIELDS = frozenset(pb.HeadBatch.DESCRIPTOR.fields_by_name)
_DEFAULT = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
_LAYOUT = {kind: (struct.calcsize("<" + codes), len(codes)) for kind, codes in _FORMAT.items()}  # bytes, columns
_STRUCTS: dict[tuple[str, int], struct.Struct] = {}  # (kind, tokens) -> its packing


def _columns(kind: str, n: int) -> struct.Struct:
    packing = _STRUCTS.get((kind, n))
    if packing is None:
        if len(_STRUCTS) >= 4096:  # widths are bounded; a burst of odd ones does not grow this for ever
            _STRUCTS.clear()
        spec = "".join(f"{n}{c}" for c in _FORMAT[kind])
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
        for name, column in zip(PRELUDE_COLUMNS, _PRELUDE_OF(op)):
            getattr(msg.prelude, name).extend(column)
    elif isinstance(op, LoopOp):
        loop = msg.loop
        loop.columns = _columns("loop", len(op.rids)).pack(*chain.from_iterable(_LOOP_OF(op)))
        loop.prefill = op.prefill
        loop.num_steps = op.num_steps
        if op.kv_copies:
            loop.copy_rids.extend([c.rid for c in op.kv_copies])
            loop.copy_positions.extend([c.position for c in op.kv_copies])
            loop.copy_from_slots.extend([c.from_slot for c in op.kv_copies])
        if op.head is not None:
            _head_to_pb(loop.head, op.head, _LOOP_HEAD_REPEATED)
            loop.head.embed_rows.extend(op.head.embed_rows)
    else:
        _head_to_pb(msg.head, op, _HEAD_OP_REPEATED)
        msg.head.score_ids.extend(op.score_ids)
    return msg


def _head_to_pb(head: pb.HeadBatch, op: HeadOp | LoopHead, repeated: Sequence[str]) -> None:
    """A head's packed columns and settings, its other columns (``repeated``), its processing and history."""
    sampling = op.sampling
    head.columns = _columns("head", len(op.rids)).pack(*chain.from_iterable(_HEAD_OF(op)), *setting_columns(sampling))
    for name in repeated:
        getattr(head, name).extend(getattr(op, name))
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
    for seed in op.history:
        head.history.add(index=seed.index, prompt_ids=seed.prompt_ids, output_ids=seed.output_ids)
    head.masks.extend(op.masks)


def _history_of(h: pb.HeadBatch) -> tuple[HistorySeed, ...]:
    return tuple(HistorySeed(s.index, tuple(s.prompt_ids), tuple(s.output_ids)) for s in h.history)


def _head_of(h: pb.HeadBatch) -> dict[str, Any]:
    """A head's columns and sampling settings by field name (packed, or in repeated fields)."""
    if h.columns:
        columns = _unpacked("head", h.columns)
        named: dict[str, Any] = dict(zip(HEAD_COLUMNS, columns))
        settings: Sequence[Sequence[Any]] = columns[len(HEAD_COLUMNS) :]
    else:
        named = {name: tuple(getattr(h, name)) for name in HEAD_COLUMNS}
        n = len(named["rids"])  # a setting without a repeated field of its own: its default
        settings = [getattr(h, name) if name in _HEAD_FIELDS else (_DEFAULT[name],) * n for name in SAMPLING_NAMES]
    named["sampling"] = _sampling_of(h, settings)
    named["history"] = _history_of(h)
    named["masks"] = tuple(h.masks)
    return named


def _sampling_of(h: pb.HeadBatch, settings: Sequence[Sequence[Any]]) -> tuple[SamplingParams, ...]:
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
    common = (msg.seq, fences, kv_updates, released)
    if which == "prelude":
        prelude: dict[str, Any] = {name: tuple(getattr(msg.prelude, name)) for name in PRELUDE_COLUMNS}
        return PreludeOp(*common, **prelude)
    if which == "loop":
        lp = msg.loop
        columns: dict[str, Any]
        if lp.columns:
            columns = dict(zip(LOOP_COLUMNS, _unpacked("loop", lp.columns)))
        else:
            columns = {name: tuple(getattr(lp, name)) for name in LOOP_COLUMNS}
        return LoopOp(
            *common,
            **columns,
            prefill=lp.prefill,
            num_steps=lp.num_steps,
            kv_copies=tuple(map(KVCopy, lp.copy_rids, lp.copy_positions, lp.copy_from_slots)),
            head=_loop_head(lp.head) if lp.HasField("head") else None,
        )
    if which == "head":
        h = msg.head
        repeated: dict[str, Any] = {name: tuple(getattr(h, name)) for name in (*_HEAD_OP_REPEATED, "score_ids")}
        return HeadOp(*common, **_head_of(h) | repeated)
    raise ValueError(f"batch {msg.seq} carries no stage work ({which})")


def _loop_head(h: pb.HeadBatch) -> LoopHead:
    repeated: dict[str, Any] = {name: tuple(getattr(h, name)) for name in (*_LOOP_HEAD_REPEATED, "embed_rows")}
    return LoopHead(**_head_of(h), **repeated)


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
