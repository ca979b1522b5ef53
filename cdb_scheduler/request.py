"""Request records and loop work items.

Lifecycle of a request (numbered; see docs/design.md):
1. WAITING: queued for prefill (also after preemption, with its generated tokens kept for replay).
2. RUNNING: resident. Prompt chunks are prefilled at full depth; the last chunk's head samples token 0
   (``max_tokens`` 0: samples nothing, the request ends there). With ``score_prompt`` the head also scores every
   prompt position against the next prompt token, at that full depth (``prompt_logprobs``).
   Each next token k >= 1 is one work item: prelude of token k-1 at position P+k-1, loop steps until its exit,
   head samples token k. When item k goes to the head, item k+1 is queued at once (its input token is read
   from the token bank): at most one item per request is in the loop, and a successor of a request that
   turns out to have ended (stop id) is dropped. With self-speculative decoding (``cdb_scheduler.speculation``)
   items drafted from it run ahead, each in a row of its own, until their predecessors are verified.
3. FINISHED: stop id, length, stop string, abort or error. Row and KV blocks are returned at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cdb_scheduler.exit_policy import ExitPolicy, ExitState
from cdb_scheduler.plan import KVCopy
from cdb_scheduler.sampling import Guide, SamplingParams, TokenLogprobs


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(slots=True)
class Request:
    """One generation request as the scheduler sees it (token ids only; text lives in the engine)."""

    rid: int  # the engine's id of the request (``request_id`` is the caller's, in the engine)
    prompt: list[int]
    max_tokens: int
    policy: ExitPolicy
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    init_seed: int = -1  # Huginn initial state: < 0 zero, else seeded per position
    replay_depths: list[int] | None = None  # benchmark replay: depth of generated token k at [k-1]
    score_prompt: bool = False  # the prefill also scores the prompt: logprob of token p+1 at position p
    arrival: float = 0.0  # time.monotonic() at submission (set by the engine)
    admitted: float = 0.0  # time.monotonic() at first admission to prefill (0: never admitted)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    # progress counters
    prefilled: int = 0  # prompt tokens whose KV is written
    output: list[int] = field(default_factory=list)  # generated tokens (kept across preemption)
    depths: list[int] = field(default_factory=list)  # served depth of each generated token
    emitted: int = 0  # tokens already reported (replay after preemption does not report again)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # of prompt tokens 1.. (``score_prompt``)
    loop_steps: int = 0  # loop steps run for this request's decode tokens (prefill not counted)
    # resources
    row: int = -1
    blocks: list[int] = field(default_factory=list)
    epoch: int = 0  # bumped on preemption: items of an older epoch are stale
    num_preemptions: int = 0
    # self-speculative decoding (``cdb_scheduler.speculation``)
    speculate: bool | None = None  # the request's own choice (None: the server's)
    spec: SpecState | None = None  # set at admission when the request may speculate
    spec_rows: list[int] = field(default_factory=list)  # rows of its speculative items (``row`` is the oldest's)
    priority: int = 0  # lower first (vLLM's meaning): the waiting queue's order, and preempted last
    guide: Guide | None = None  # structured output: its grammar's walk (masks, forced tokens)
    # ``--priority-depth``: its own policy and the shallow one it runs while it is below the most urgent priority
    # and requests wait (``cdb_scheduler.priority_depth``); ``policy`` is the one in force
    depth_policies: tuple[ExitPolicy, ExitPolicy] | None = None
    prefix_hashes: list[bytes] = field(default_factory=list)  # its prompt's full blocks (prefix caching; [] off)
    writing: list[bytes] = field(default_factory=list)  # of those, the ones its prefill writes (not yet cached)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def computed_tokens(self) -> int:
        """Tokens whose KV is (being) written: the preemption victim is the request with the fewest."""
        return self.prefilled + max(0, len(self.output) - 1)

    @property
    def alive(self) -> bool:
        return self.status is not Status.FINISHED


@dataclass(slots=True)
class Item:
    """The work of one generated token ``index`` (>= 1): input token at ``position``, loop steps, head."""

    req: Request
    epoch: int
    index: int  # generation index of the token this item produces
    position: int  # position of its input token (= prompt_len + index - 1)
    input_token: int  # token id at ``position``; -1: sampled by the head into the token bank, not yet known
    exit_state: ExitState
    next_step: int  # next loop step to issue
    depth: int  # served depth, set when the exit is decided
    exited: bool
    forced_depth: int  # replay after preemption: the depth recorded the first time
    pending_since: int  # loop seq of an issued step whose fate is not yet decided
    exited_at: int  # loop ops issued when it joined the head queue
    embedded: bool  # its input's embedding is already in its row (written by the head op that sampled it)
    row: int  # the bank row it runs in (its request's ``row``, or one of its ``spec_rows``)
    # The op that writes its input into its row: a prelude op (``gate_head`` False) or the head op that samples and
    # embeds it (True); -1: none (known written, or written by the loop op that takes it); and the first loop op that
    # takes it before that op is known complete. See ``Scheduler.stage_progress``.
    gate_seq: int
    gate_head: bool
    gate_loop: int
    # Speculation: ``pred`` is the unverified predecessor whose sample is this item's input: its draft (``draft``,
    # -1 until the drafting op returns) or, ``FOLLOWS_REAL``, its real sample (the predecessor is unverified itself);
    # ``succ`` the item that follows this one that way; ``sampled``: its own real token and logprobs, sampled before
    # it was verified, reported once it is.
    pred: Item | None
    succ: Item | None
    draft: int
    sampled: tuple[int, TokenLogprobs | None] | None
    fallback: Item | None  # its real successor while ``succ`` runs from a draft (kept if the draft is wrong)
    held: bool  # a fallback that exited before the verdict: sampled only if kept
    copy: KVCopy | None  # its copy-on-exit, once decided
    # Structured output: the depth from which it exits as soon as its token is known forced (0: never; see
    # ``WorkQueues.skip_cap``)
    skip_cap: int
    mask: bytes  # structured output: its token's mask, once known at its head (``head.held_back``); b"": none

    # One per generated token: written out, so that the compiled scheduler builds it natively (the dataclass's own
    # ``__init__`` is a Python function even in a compiled class: ≈ 0.7 µs a token on the engine thread). The
    # fields' starting values are here, not on the fields.
    def __init__(
        self, req: Request, epoch: int, index: int, position: int, input_token: int, exit_state: ExitState
    ) -> None:
        self.req, self.epoch, self.index, self.position = req, epoch, index, position
        self.input_token, self.exit_state = input_token, exit_state
        self.next_step = self.depth = self.forced_depth = self.exited_at = self.gate_loop = self.skip_cap = 0
        self.exited = self.embedded = self.gate_head = self.held = False
        self.pending_since = self.row = self.gate_seq = self.draft = -1
        self.pred = self.succ = self.fallback = None
        self.sampled = None
        self.copy = None
        self.mask = b""

    @property
    def live(self) -> bool:
        req = self.req  # (Request.alive inlined: this runs for every queued item on every scheduling round)
        return req.epoch == self.epoch and req.status is not Status.FINISHED

    @property
    def replay(self) -> bool:
        return self.forced_depth > 0


FOLLOWS_REAL = -3  # ``Item.draft`` of an item whose input is its unverified predecessor's real sample
FALLBACK = -4  # ``Item.draft`` of a predecessor's real successor started beside a drafted one (until the verdict)


@dataclass(slots=True)
class SpecState:
    """A speculating request's draft depth and its measured acceptance (``cdb_scheduler.speculation``)."""

    depth: int  # loop steps a token has run when its successor is drafted from it
    acceptance: float = 1.0  # moving average of accepted drafts (starts hopeful)
    paused_until: int = 0  # no drafting before this many generated tokens (acceptance too low to pay)
    drafts: int = 0  # successors drafted from its tokens
    accepted: int = 0  # drafts verified right
    rejected: int = 0  # drafts verified wrong
    asked: bool = False  # the request asked to speculate itself: it drafts whether or not the loop cost says it pays


@dataclass(slots=True)
class TokenOut:
    """A generated token reported to the engine."""

    rid: int
    index: int
    token_id: int
    depth: int
    logprobs: TokenLogprobs | None

    def __init__(self, rid: int, index: int, token_id: int, depth: int, logprobs: TokenLogprobs | None) -> None:
        self.rid, self.index, self.token_id = rid, index, token_id  # (native: one per reported token)
        self.depth, self.logprobs = depth, logprobs


@dataclass(slots=True)
class Finished:
    """A request ended; its resources are already free."""

    rid: int
    reason: FinishReason
    generated: int
    loop_steps: int
    error: str | None = None


Event = TokenOut | Finished
