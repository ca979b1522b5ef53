"""The fields of a stage op as its two codecs carry them, declared once: ``records`` (the binary op record on the ops
ring) and ``convert`` (the ``StageBatch`` message) both take an op's per-token columns and its sampling settings
from the tables here, in their order.

A new per-token column or sampling setting is a field of its ``cdb_scheduler.plan`` dataclass and a name in one
table below (and ``records.VERSION`` one up: a record of the old layout reads as no op). Both codecs then carry it;
a prelude column also needs its repeated field in ``PreludeBatch`` (the only op whose message has no packed
columns). The op-level fields (seq, fences, table deltas, released ids, KV copies, flags) and what only a message
carries (logits processing, penalty history, prompt scoring, draft embeds) and masks are each codec's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

from cdb_scheduler.sampling import SamplingParams

# Per-token integer columns (int64 on a record; the message's own types), in the order both codecs write them.
PRELUDE_COLUMNS = ("rids", "token_ids", "positions", "rows", "init_seeds")  # PreludeOp (PreludeBatch's fields)
LOOP_COLUMNS = ("rids", "positions", "rows", "steps")  # LoopOp (LoopBatch.columns)
HEAD_COLUMNS = ("rids", "positions", "rows", "token_index")  # HeadOp and LoopHead (HeadBatch.columns, first)
HEAD_OP_COLUMNS = (*HEAD_COLUMNS, "sample")  # a head op's on a record (``sample``, bool, in HeadBatch.sample)
LOOP_HEAD_COLUMNS = (*HEAD_COLUMNS, "embed_ids")  # a fused head's on a record (embed_ids in HeadBatch.embed_ids)
BOOL_COLUMNS = frozenset({"sample", "embed"})  # read back as bools (a head op's ``embed``: its flagged column)

# The sampling settings of each sampled token (``SamplingParams``) with their ``struct`` codes: ``d`` a double,
# ``q`` an integer, ``?`` a flag, ``Q`` a 64-bit seed (carried modulo 2**64). A record holds the integers and
# flags in its int64 section, the doubles in its float64 one, the seeds in its uint64 one, each in table order;
# a message packs all of them, in table order, after the head's columns.
SAMPLING = (
    ("temperature", "d"),
    ("top_k", "q"),
    ("top_p", "d"),
    ("min_p", "d"),
    ("seed", "Q"),
    ("logprobs", "q"),
    ("return_logprob", "?"),
)
SAMPLING_NAMES = tuple(name for name, _ in SAMPLING)
SAMPLING_CODES = "".join(code for _, code in SAMPLING)
MASK64 = (1 << 64) - 1


def getter(names: Sequence[str]) -> Callable[[Any], tuple[Any, ...]]:
    """``obj -> (obj.<name> for each name)`` in one C call (``attrgetter``, a tuple even for one name)."""
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda obj: (one(obj),)
    return attrgetter(*names)


SETTING = {name: attrgetter(name) for name in (*SAMPLING_NAMES, "processing")}  # one settings attribute each


def setting_columns(sampling: Sequence[SamplingParams], codes: str = SAMPLING_CODES) -> list[Any]:
    """The sampling settings with a code in ``codes``, flat, column after column in table order (``map`` over
    ``attrgetter``: C loops, no generator frames); seeds modulo 2**64."""
    flat: list[Any] = []
    for name, code in SAMPLING:
        if code in codes:
            values = map(SETTING[name], sampling)
            flat += [MASK64 & v for v in values] if code == "Q" else values
    return flat


_PARAMS: dict[tuple[Any, ...], SamplingParams] = {}  # the same settings, one object
_PARAMS_KEPT = 8192  # distinct settings kept (each request has its own seed): emptied when full


def sampling_params(key: tuple[Any, ...]) -> SamplingParams:
    """The settings ``key`` (one value per ``SAMPLING`` name, in table order) as one shared object: a request's
    settings arrive with every op that samples it, made into an object once (a frozen dataclass costs more to
    build than to look up), not once per op."""
    params = _PARAMS.get(key)
    if params is None:
        if len(_PARAMS) >= _PARAMS_KEPT:
            _PARAMS.clear()
        params = _PARAMS[key] = SamplingParams(**dict(zip(SAMPLING_NAMES, key, strict=True)))
    return params
