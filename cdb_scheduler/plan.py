"""The only contract between the scheduler and the stage executors: data-only stage ops and their results.

The scheduler decides; executors execute. An op names bank rows (slots of the shared hidden-state bank), token
positions, loop steps and KV block-table deltas; it never carries hidden states. Every stage executes its ops in
submission order (``seq`` increases by one per op and stage). An op may carry fences: "do not start before op
``seq`` of stage X has completed". Fences only ever point at ops submitted earlier, so execution cannot deadlock.

Plain Python: no torch, no grpc.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from cdb_scheduler.sampling import SamplingParams, TokenLogprobs


class Stage(enum.IntEnum):
    """The three stage kinds. Values index per-stage arrays (fence counters)."""

    PRELUDE = 0  # embedding (+ Huginn prelude blocks and their KV); writes bank rows
    LOOP = 1  # one application of the shared block per step; loop KV pool; exit signals
    HEAD = 2  # Huginn coda blocks (+ their KV), final norm, LM head, sampling

    @property
    def role(self) -> str:
        """The stage's role name everywhere outside this enum: ``prelude`` | ``loop`` | ``head``."""
        return self.name.lower()

    @classmethod
    def from_role(cls, role: str) -> Stage:
        """The stage of a role name; ValueError naming the choices otherwise."""
        try:
            return cls[role.upper()]
        except KeyError:
            raise ValueError(f"unknown stage role {role!r} (one of {', '.join(cls.roles())})") from None

    @classmethod
    def roles(cls) -> tuple[str, ...]:
        return tuple(s.role for s in cls)


@dataclass(slots=True)
class Fence:
    """Start only after op ``seq`` of ``stage`` has completed (ops of one stage complete in order)."""

    stage: Stage
    seq: int


@dataclass(slots=True)
class KVUpdate:
    """Block-table delta of one request for the receiving stage.

    The stage keeps a mirror of each request's block table (same block ids for every stage: each stage owns the
    pool of its own layers). ``reset`` drops the known table first (after preemption); ``append`` extends it.
    """

    rid: int
    append: tuple[int, ...]
    reset: bool = False


@dataclass(frozen=True, slots=True)
class HistorySeed:
    """The history a stage needs the first time it samples a penalized request (and again after a preemption):
    the prompt (for the repetition penalty; empty without one) and the tokens generated before this sample. The
    stage counts every later token it samples for that row itself. ``index``: the sampled row it belongs to."""

    index: int
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]


@dataclass(slots=True)
class KVCopy:
    """Copy-on-exit (KV policy ``last_exited``): copy the loop KV of ``position`` from depth slot ``from_slot``
    into every deeper slot. Executed by the loop stage before the op's compute."""

    rid: int
    position: int
    from_slot: int

    def __init__(self, rid: int, position: int, from_slot: int) -> None:  # (native: one per exited token)
        self.rid, self.position, self.from_slot = rid, position, from_slot


@dataclass(frozen=True, slots=True)
class OpBase:
    seq: int
    fences: tuple[Fence, ...]
    kv_updates: tuple[KVUpdate, ...]
    released: tuple[int, ...]  # request ids whose block tables the stage may forget (before this op's work)


@dataclass(frozen=True, slots=True)
class PreludeOp(OpBase):
    """Embed tokens (Huginn: scale, prelude blocks writing prelude KV, initial state) into bank rows.

    Per token: request id, token id, position, bank row. ``token_ids[i] == -1`` means "the token the head
    sampled last for this row" (read from the token bank, written by a HeadOp this op is fenced on): a refill
    needs no round trip through the scheduler. ``init_seeds[i] < 0`` means zero initial state (Huginn);
    otherwise the seeded truncated-normal initial state drawn from that seed. Ouro ignores ``init_seeds``.
    """

    rids: tuple[int, ...]
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    rows: tuple[int, ...]
    init_seeds: tuple[int, ...]
    stage: Stage = field(default=Stage.PRELUDE, init=False)


@dataclass(frozen=True, slots=True)
class LoopHead:
    """The head of tokens that left the loop after an earlier loop op, run by the loop stage at the START of a
    loop op (Ouro, whose head is a final norm and the LM head, and whose prelude is an embedding lookup): sample
    each row (``sampling[i]``, stream index ``token_index[i]``), write the id to the token bank, and write the
    successor's input embedding into the row: ``embed_ids[i]`` -1 the sampled id, >= 0 that id (a recomputed
    token's recorded input), -2 none (the request ends). The successors run their step 0 in the same op, so a
    decode step needs no head op and no hop between stages.

    ``embed_rows[i]`` (when given) is the row that receives row i's successor input (and the sampled id in the token
    bank) instead of row i itself: a draft (self-speculative decoding) reads a token's row at a shallow depth while
    the token goes on looping there, and its successor starts in a row of its own."""

    rids: tuple[int, ...]
    positions: tuple[int, ...]
    rows: tuple[int, ...]
    sampling: tuple[SamplingParams, ...]
    token_index: tuple[int, ...]
    embed_ids: tuple[int, ...]
    history: tuple[HistorySeed, ...] = ()  # of penalized rows sampled here for the first time
    embed_rows: tuple[int, ...] = ()  # () : each row's successor input goes into that row
    masks: tuple[bytes, ...] = ()  # () : none; else per row its structured output's mask (``MASKS``), b"" none

    @property
    def targets(self) -> tuple[int, ...]:
        """The row each sampled row's successor input is written to."""
        return self.embed_rows or self.rows


@dataclass(frozen=True, slots=True)
class LoopOp(OpBase):
    """Loop steps over bank rows, in place.

    Decode (``prefill=False``): every token runs exactly ONE step, its own ``steps[i]`` (0-based); tokens belong
    to distinct requests, or to one request's consecutive tokens running speculatively ahead (each at a step its
    predecessor has already run, so that it reads only KV written by earlier ops). Prefill (``prefill=True``): the
    tokens are prompt chunks (several tokens per request, consecutive positions), and all of them run steps
    ``0 .. num_steps-1`` in lockstep, writing the KV of every
    step. ``kv_copies`` are executed first. The result carries one exit signal per token for decode ops.
    """

    rids: tuple[int, ...]
    positions: tuple[int, ...]
    rows: tuple[int, ...]
    steps: tuple[int, ...]
    prefill: bool = False
    num_steps: int = 1
    kv_copies: tuple[KVCopy, ...] = ()
    head: LoopHead | None = None  # fused head (see LoopHead); its results are the op's token_ids / logprobs
    stage: Stage = field(default=Stage.LOOP, init=False)


@dataclass(frozen=True, slots=True)
class HeadOp(OpBase):
    """Coda (Huginn: ln_f, coda blocks writing coda KV, ln_f), LM head and sampling of bank rows.

    Every token runs the coda (its KV is needed by later tokens); only tokens with ``sample[i]`` are projected
    to logits and sampled, with ``sampling[i]`` and the stream index ``token_index[i]``. Each sampled id is
    also written to the token bank at its row, where a following PreludeOp picks it up. With ``embed[i]`` (models
    whose prelude is a pure embedding lookup: Ouro), the head also writes the embedding of the sampled id into
    the row: the successor's prelude, fused, so a refill costs no prelude op and no extra hop.

    Prompt scoring (prefill only): a token with ``score_ids[i] >= 0`` is also projected to logits, and the
    result carries the logprob of id ``score_ids[i]`` (the next prompt token) there, with
    ``sampling[i].logprobs`` alternatives (``StageResult.prompt_logprobs``). Empty: nothing is scored.
    """

    rids: tuple[int, ...]
    positions: tuple[int, ...]
    rows: tuple[int, ...]
    sample: tuple[bool, ...]
    sampling: tuple[SamplingParams, ...]
    token_index: tuple[int, ...]
    embed: tuple[bool, ...] = ()  # () : no token embeds its successor
    score_ids: tuple[int, ...] = ()  # () : nothing scored; else per token -1 or the id whose logprob to return
    history: tuple[HistorySeed, ...] = ()  # of penalized rows sampled here first (index: among the sampled rows)
    masks: tuple[bytes, ...] = ()  # () : none; else per token its structured output's mask (``MASKS``), b"" none
    stage: Stage = field(default=Stage.HEAD, init=False)


StageOp = PreludeOp | LoopOp | HeadOp

MASKS = """A sampled token's mask (structured output): the ids its grammar allows, one bit per id (bit ``i % 8`` of
byte ``i // 8``); the sampler bans every other id after logit bias and penalties, and its logprobs are computed with
them banned (a token the grammar forces has logprob 0)."""


@dataclass(slots=True)
class StageResult:
    """Completion of one op. ``compute_s`` is the stage's own compute time for it (wall seconds).

    LOOP decode: ``signals[i]`` is the exit signal of token i after its step (Ouro: gate hazard; Huginn: relative
    latent difference), ``lookahead[i]`` the Ouro lookahead-gate hazard when the model has that gate.
    HEAD, and a loop op's fused ``head``: ``token_ids`` and ``logprobs`` for the sampled tokens, in op order;
    ``prompt_logprobs`` for the scored tokens of a HEAD op (``HeadOp.score_ids``), in op order.
    ``error`` is set when the stage failed the op; the engine then fails the requests in it.
    """

    stage: Stage
    seq: int
    compute_s: float
    signals: tuple[float, ...] = ()
    lookahead: tuple[float, ...] = ()
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    error: str | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True, slots=True)
class StageLoss:
    """What ``Executor.poll`` returns when the stages lost their state (a stage process died or its stream broke;
    the executor re-attaches every stage with fresh state). Every op issued before it is void: no result will
    come for any of them, and ops submitted between the loss and this ``poll`` are dropped. The scheduler
    recomputes its running requests (``Scheduler.recover``); ops submitted after this ``poll`` run on the
    re-attached stages (queued by the executor until they are back)."""

    reason: str


class Executor(Protocol):
    """Executes stage ops. Implementations: in-process worker thread, gRPC stage clients.

    ``submit`` never blocks on compute; ``poll`` returns the next completed op's result (any stage), waiting at
    most ``timeout`` seconds (None: forever); it returns None on timeout, and a ``StageLoss`` (only executors
    over separate processes) when the stages lost their state.
    """

    @property
    def concurrent_stages(self) -> bool:
        """Whether the stages run their ops concurrently (separate processes), so that an op waiting on a fence
        can leave its stage idle; False for one in-order worker (``Scheduler.stage_progress``)."""
        ...

    def completed(self, stage: Stage) -> int:
        """The last op of ``stage`` known complete (-1: none); it may run ahead of the results polled so far."""
        ...

    def submit(self, op: StageOp) -> None: ...

    def poll(self, timeout: float | None) -> StageResult | StageLoss | None: ...

    def wake(self) -> None:
        """Make a concurrent ``poll`` return None at once (new requests arrived)."""
        ...

    def close(self) -> None: ...


def derive_seed(base: int, index: int) -> int:
    """A 63-bit seed for stream ``index`` of ``base`` (a token's sampling draw, a position's initial state).

    Pure integer mixing (splitmix64), so the random stream of a token never depends on what else is batched.
    """
    x = (base * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def seeded_uniform(seed: int) -> float:
    """The uniform draw ``u`` in ``[0, 1)`` of a 63-bit ``seed`` (``derive_seed``): one more splitmix64 round, its top
    53 bits as a double. Pure integer arithmetic: the host computes it per sampled row, identically for the
    batched sampler and the float64 oracle, on every device."""
    x = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return ((x ^ (x >> 31)) >> 11) * 2.0**-53
