"""What the engine hands back: per-request events, offline completions, live counters, and the observer hook.

Names: ``request_id`` (str) is the caller's id of a request, from the public API down to the engine's events;
``rid`` (int) is the engine's own id of it, the one the scheduler core, the stage ops and the stages use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from cdb_scheduler.request import FinishReason
from cdb_scheduler.sampling import TokenLogprobs


class TokenEvent(msgspec.Struct, array_like=True, gc=False):
    """One generated token of a request. A msgspec struct: built in C (one per token, on the engine thread), and
    carried over the front-end link as a MessagePack array of its fields (no field names in the frame)."""

    request_id: str
    index: int
    token_id: int
    text: str
    depth: int
    logprobs: TokenLogprobs | None
    time_ns: int = 0  # time.time_ns() when the engine took the stage result that produced it (0: not stamped)
    # token 0 of a request with ``prompt_logprobs``: those of prompt tokens 1.. (at full depth; token 0 has none)
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


class FinishEvent(msgspec.Struct, array_like=True, gc=False):
    """A request's end. ``generated_tokens`` and ``total_loop_steps`` count the tokens this request generated (its
    usage); a resumed stream's tokens (``RequestParams.resume_tokens``) are counted apart, in ``resumed_tokens``."""

    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    total_loop_steps: int
    text: str = ""  # held-back text released at the end
    error: str | None = None
    queue_s: float = 0.0  # submission to first admission (prefill start); 0 if never admitted
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # as ``TokenEvent``'s, when no token was reported before
    # self-speculative decoding of this request: successors drafted, drafts verified right and wrong
    spec_drafts: int = 0
    spec_accepted: int = 0
    spec_rejected: int = 0
    resumed_tokens: int = 0  # tokens a broken stream had delivered, sent back to resume it (not generated here)


Event = TokenEvent | FinishEvent


@dataclass(slots=True)
class Completion:
    """Result of one offline request."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    total_loop_steps: int = 0
    token_times: list[float] = field(default_factory=list)  # time.perf_counter() when each token was reported
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.. (``prompt_logprobs``)

    def record(self, ev: Event) -> bool:
        """Add one event of the request; True at its finish."""
        self.prompt_logprobs.extend(ev.prompt_logprobs)
        if isinstance(ev, TokenEvent):
            self.token_ids.append(ev.token_id)
            self.depths.append(ev.depth)
            self.text += ev.text
            self.logprobs.append(ev.logprobs)
            self.token_times.append(time.perf_counter())
            return False
        self.text += ev.text
        self.finish_reason = ev.finish_reason
        self.total_loop_steps = ev.total_loop_steps
        return True


@dataclass(frozen=True, slots=True)
class EngineStats:
    waiting: int
    running: int
    held_rows: int
    used_kv_blocks: int
    total_kv_blocks: int
    loop_steps: int
    tokens: int
    last_progress_monotonic: float
    healthy: bool
    error: str | None
    recoveries: int = 0  # stage losses healed (``Scheduler.recover``)
    recomputed: int = 0  # requests recomputed by them
    cached_kv_blocks: int = 0  # KV blocks holding a cached prompt prefix (held or evictable)


class RequestObserver(Protocol):
    """Hooks on one streamed request (``Engine.open_stream``); the services' metrics and spans implement it."""

    def queued(self, rid: int) -> None:
        """On the engine thread: the scheduler took the request; ``rid`` keys its stage ops."""
        ...

    def event(self, event: Event) -> None:
        """On the consumer's event loop: ``event`` is about to be handed to the consumer."""
        ...

    def gone(self, exc: BaseException | None) -> None:
        """The consumer left before the finish event (``exc``: why, when known); the request was aborted."""
        ...
