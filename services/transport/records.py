"""Binary op records: how a stage op travels on a shared-memory ops ring (``services.transport.ring``).

A stage op crosses the ring on every loop step, and both ends of it are on the critical path: the scheduler's engine
thread encodes op k+2 while op k+1 runs, and the stage decodes it before it can launch it. As a ``StageBatch``
message a width-64 loop op with a fused head costs ≈ 30 µs to build and serialize and ≈ 33 µs to parse and read back
(most of it per-field protobuf work around the packed columns); as a record it is three flat arrays, written and read
by one C call each.

Layout (little-endian)::

    header  u8 0 (a protobuf message never starts with a zero byte: field number 0 does not exist), u8 version,
            u8 kind (0 prelude, 1 loop, 2 head), u8 flags (1 prefill, 2 fused head, 4 head embeds, 8 masks),
            u32 ints, u32 settings rows, u32 a row's bytes, f64 fence_timeout_s
    int64[ints]     seq, num_steps, then the counts (fences, updates, their blocks, released, tokens, copies, head
                    tokens), then each section: fences (stage, seq), updates (rid, reset, blocks), every update's
                    blocks, released, the token columns, KV copies (rid, position, from slot), the head's integer
                    columns (its own rids, positions, rows, token indices and embedded ids for a fused head), then
                    (flag 8) each sampled token's mask length in bytes (0: none)
    rows            each sampled token's settings, one packed row each (``SAMPLING`` order and codes; the seed
                    modulo 2**64, as ``StageBatch`` carries it)
    u8[...]         (flag 8) the sampled tokens' masks (structured output), one after another

A request's settings are the same for every token it samples, and its ``SamplingParams`` object too: its row is
packed once and kept (``_ROWS``, by object), so a wide op's settings cost a lookup per token, not a field read per
setting and token.

The token columns and sampling settings, and their order, are the tables of ``services.transport.opfields`` (the
message path reads the same ones). What a record does not carry, an op with it travels as a ``StageBatch`` (the ring
takes both): logits processing, penalty history, prompt scoring, draft embeds and trace contexts. A stage says which
record version it reads in its Configure reply (``ConfigureResponse.op_records``); a scheduler sends records only to
a stage that reads them.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from itertools import chain
from typing import Any

from cdb_scheduler.plan import Fence, HeadOp, KVCopy, KVUpdate, LoopHead, LoopOp, PreludeOp, Stage, StageOp
from cdb_scheduler.sampling import SamplingParams
from services.transport.opfields import (
    BOOL_COLUMNS,
    HEAD_OP_COLUMNS,
    LOOP_COLUMNS,
    LOOP_HEAD_COLUMNS,
    MASK64,
    PRELUDE_COLUMNS,
    SAMPLING,
    SAMPLING_CODES,
    SAMPLING_NAMES,
    getter,
    sampling_params,
)

VERSION = 4
_HEADER = struct.Struct("<BBBBIIId")  # marker, version, kind, flags, ints, settings rows, row bytes, fence_timeout_s
_ROW = struct.Struct("<" + SAMPLING_CODES)  # one sampled token's settings
_SEED = next(i for i, (_, code) in enumerate(SAMPLING) if code == "Q")
_SETTINGS_OF = getter(SAMPLING_NAMES)  # a settings object's values, in the row's order
_PRELUDE, _LOOP, _HEAD = 0, 1, 2
_PREFILL, _FUSED, _EMBED, _MASKS = 1, 2, 4, 8
_COUNTS = 7  # fences, updates, blocks, released, tokens, copies, head tokens
_STAGES = (Stage.PRELUDE, Stage.LOOP, Stage.HEAD)
_COLUMNS = (PRELUDE_COLUMNS, LOOP_COLUMNS, HEAD_OP_COLUMNS)  # by kind (a head op's ``embed`` follows, if flagged)
_PRELUDE_OF, _LOOP_OF, _HEAD_OF = map(getter, _COLUMNS)
_LOOP_HEAD_OF = getter(LOOP_HEAD_COLUMNS)
_ROWS: dict[int, tuple[SamplingParams, bytes]] = {}  # id -> (the settings object, its row; b"": no record)
_ROWS_KEPT = 8192  # (the entry holds its object: an id is not reused while it is here)


def is_record(payload: bytes) -> bool:
    """Whether a ring payload is an op record (else a serialized ``StageBatch``, or empty: the end)."""
    return payload[:1] == b"\x00"


def encode(op: StageOp, fence_timeout_s: float = 0.0) -> bytearray | None:
    """The op as a record; None where the op needs what only a ``StageBatch`` carries (module docstring) or holds an
    integer beyond int64 (the message path then names it)."""
    copies: list[int] = []
    head_columns: tuple[Sequence[int], ...] = ()
    sampling: tuple[SamplingParams, ...] = ()
    masks: tuple[bytes, ...] = ()
    flags = nh = 0
    if isinstance(op, LoopOp):
        kind, flags, columns = _LOOP, _PREFILL if op.prefill else 0, _LOOP_OF(op)
        copies = [v for c in op.kv_copies for v in (c.rid, c.position, c.from_slot)]
        h = op.head
        if h is not None:
            if h.history or h.embed_rows:
                return None
            flags |= _FUSED
            sampling, head_columns, nh, masks = h.sampling, _LOOP_HEAD_OF(h), len(h.rows), h.masks
    elif isinstance(op, HeadOp):
        if op.history or op.score_ids:
            return None
        kind, flags, columns, sampling = _HEAD, _EMBED if op.embed else 0, (*_HEAD_OF(op), op.embed), op.sampling
        masks = op.masks
    else:
        assert isinstance(op, PreludeOp)
        kind, columns = _PRELUDE, _PRELUDE_OF(op)
    rows = _settings_rows(sampling)
    if rows is None:
        return None
    updates = op.kv_updates
    blocks = [b for u in updates for b in u.append]
    ints = [
        op.seq,
        op.num_steps if isinstance(op, LoopOp) else 1,
        len(op.fences),
        len(updates),
        len(blocks),
        len(op.released),
        len(op.rows),
        len(copies) // 3,
        nh,
        *[v for f in op.fences for v in (int(f.stage), f.seq)],
        *[v for u in updates for v in (u.rid, u.reset, len(u.append))],
        *blocks,
        *op.released,
        *chain.from_iterable(columns),
        *copies,
        *chain.from_iterable(head_columns),
        *map(len, masks),
    ]
    if masks:
        flags |= _MASKS
    try:
        body = _body(len(ints)).pack(*ints)
    except struct.error:  # an integer beyond int64
        return None
    header = _HEADER.pack(0, VERSION, kind, flags, len(ints), len(sampling), _ROW.size, fence_timeout_s)
    return bytearray(b"".join((header, body, rows, *masks)))


def _settings_rows(sampling: Sequence[SamplingParams]) -> bytes | None:
    """The sampled tokens' settings rows, one after another; None where one needs a message (logits processing,
    or an integer a row cannot hold)."""
    get = _ROWS.get
    rows = [e[1] if (e := get(id(p))) is not None and e[0] is p else _row(p) for p in sampling]
    blob = b"".join(rows)
    return blob if len(blob) == _ROW.size * len(rows) else None


def _row(p: SamplingParams) -> bytes:
    """``p``'s settings row, packed and kept (b"": it travels in a message)."""
    if len(_ROWS) >= _ROWS_KEPT:  # (each request has its own settings object: the kept ones are emptied when full)
        _ROWS.clear()
    values = list(_SETTINGS_OF(p))
    values[_SEED] &= MASK64
    try:
        row = b"" if p.processing is not None else _ROW.pack(*values)
    except struct.error:  # an integer beyond int64
        row = b""
    _ROWS[id(p)] = (p, row)
    return row


_BODIES: dict[int, struct.Struct] = {}  # ints -> the packing of a record's integers


def _body(ints: int) -> struct.Struct:
    packing = _BODIES.get(ints)
    if packing is None:
        if len(_BODIES) >= 4096:  # op shapes are bounded; a burst of odd ones does not grow this for ever
            _BODIES.clear()
        packing = _BODIES[ints] = struct.Struct(f"<{ints}q")
    return packing


def seq_of(payload: bytes) -> int:
    """The seq of a record whose header is whole (ValueError if it is not): an unreadable op still fails by seq."""
    if len(payload) < _HEADER.size + 8 or payload[:1] != b"\x00":
        raise ValueError(f"op record: {len(payload)} bytes hold no header")
    return int(struct.unpack_from("<q", payload, _HEADER.size)[0])


def decode(payload: bytes) -> tuple[StageOp, float]:
    """A record's op and fence timeout. ValueError (naming what is wrong) for a record that is not a whole,
    consistent op of this version."""
    view = memoryview(payload)
    if len(view) < _HEADER.size:
        raise ValueError(f"op record: {len(view)} bytes is shorter than its {_HEADER.size}-byte header")
    marker, version, kind, flags, n_ints, n_rows, row_bytes, timeout = _HEADER.unpack_from(view)
    if marker != 0 or version != VERSION:
        raise ValueError(f"op record: version {version}, this stage reads version {VERSION}")
    if kind not in (_PRELUDE, _LOOP, _HEAD):
        raise ValueError(f"op record: unknown kind {kind}")
    rows_at = _HEADER.size + 8 * n_ints
    end = rows_at + n_rows * row_bytes
    if row_bytes != _ROW.size:
        raise ValueError(f"op record: settings rows of {row_bytes} bytes, this stage reads {_ROW.size}")
    if len(view) < end or (len(view) != end and not flags & _MASKS) or n_ints < 2 + _COUNTS:
        raise ValueError(f"op record: {len(view)} bytes, its header says {end}")
    ints = _body(n_ints).unpack_from(view, _HEADER.size)
    seq, num_steps, nf, nu, nb, nr, n, nc, nh = ints[: 2 + _COUNTS]
    sampled = nh if kind == _LOOP else n if kind == _HEAD else 0
    names = _COLUMNS[kind] + (("embed",) if flags & _EMBED else ())
    width, head_width = len(names), len(LOOP_HEAD_COLUMNS)
    masked = sampled if flags & _MASKS else 0
    need = 2 + _COUNTS + 2 * nf + 3 * nu + nb + nr + width * n + 3 * nc + head_width * nh + masked
    if min(nf, nu, nb, nr, n, nc, nh) < 0 or n_ints != need or n_rows != sampled:
        raise ValueError(f"op record: its counts do not match its {n_ints} integers")
    if (kind != _LOOP and (nc or nh or flags & _FUSED)) or (nh and not flags & _FUSED):
        raise ValueError("op record: copies or a fused head in an op that has none")
    at = 2 + _COUNTS
    if any(not 0 <= ints[at + 2 * i] < len(_STAGES) for i in range(nf)):
        raise ValueError("op record: a fence names no stage")
    fences = tuple(Fence(_STAGES[ints[at + 2 * i]], ints[at + 2 * i + 1]) for i in range(nf))
    at += 2 * nf
    heads, at = ints[at : at + 3 * nu], at + 3 * nu
    updates = []
    for i in range(nu):
        rid, reset, length = heads[3 * i : 3 * i + 3]
        if length < 0 or at + length > need:
            raise ValueError("op record: an update's blocks run past the record")
        updates.append(KVUpdate(rid, ints[at : at + length], bool(reset)))
        at += length
    if sum(heads[2::3]) != nb:
        raise ValueError("op record: the updates' blocks do not add up")
    released = ints[at : at + nr]
    at += nr
    columns = _named(names, ints, at, n)
    at += width * n
    common = (seq, fences, tuple(updates), released)
    if kind == _PRELUDE:
        return PreludeOp(*common, **columns), timeout
    sampling = tuple(map(sampling_params, _ROW.iter_unpack(view[rows_at:end]))) if sampled else ()
    masks = _masks(view, end, ints[n_ints - masked :]) if masked else ()
    if len(view) != end and not masked:
        raise ValueError(f"op record: {len(view)} bytes, its header says {end}")
    if kind == _HEAD:
        return HeadOp(*common, sampling=sampling, masks=masks, **columns), timeout
    copies = tuple(KVCopy(*ints[at + 3 * i : at + 3 * i + 3]) for i in range(nc))
    at += 3 * nc
    head = None
    if flags & _FUSED:
        head = LoopHead(sampling=sampling, masks=masks, **_named(LOOP_HEAD_COLUMNS, ints, at, nh))
    loop = LoopOp(*common, **columns, prefill=bool(flags & _PREFILL), num_steps=num_steps, kv_copies=copies, head=head)
    return loop, timeout


def _masks(view: memoryview, at: int, lengths: Sequence[int]) -> tuple[bytes, ...]:
    """The masks after a record's body, ``lengths`` bytes each (they must end the record)."""
    if min(lengths) < 0 or at + sum(lengths) != len(view):
        raise ValueError("op record: its masks do not fill its tail")
    out = []
    for n in lengths:
        out.append(bytes(view[at : at + n]))
        at += n
    return tuple(out)


def _named(names: Sequence[str], ints: Sequence[int], at: int, n: int) -> dict[str, Any]:
    """The ``n``-token columns ``names`` that start at ``ints[at]``, by name (bools as bools)."""
    cols = {name: ints[at + i * n : at + (i + 1) * n] for i, name in enumerate(names)}
    for name in BOOL_COLUMNS.intersection(cols):
        cols[name] = tuple(map(bool, cols[name]))
    return cols
