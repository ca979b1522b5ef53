"""Self-speculative decoding inside continuous depth batching: a looped model drafts its own next token.

A token ``X`` that has run ``d`` loop steps (the draft depth) is also read by the loop op's fused head: its state
at depth ``d`` is sampled exactly as its real exit will be (same sampling settings, same seeded uniform of
``(seed, token index)``) and the sample, the *draft*, is embedded as the input of ``X``'s successor ``S`` in a
bank row of its own. ``S`` runs its loop steps while ``X`` goes on looping, in the same loop ops as every other
request's tokens. When ``X`` exits, its real token is sampled as usual; if it equals the draft, ``S`` simply goes
on (its work so far is exactly the work it would have done), otherwise ``S`` and everything drafted from it are
dropped. ``X``'s real successor does not wait for that verdict: the head embeds the real token into ``X``'s row as
always, and that successor (the *fallback*) starts at once, beside ``S``; it is dropped if the draft was right and
goes on if not, so a wrong draft costs no loop op. Until the verdict a fallback drafts nothing and, should it exit,
samples nothing: what followed an alternative could overwrite the KV the other one's successors read.

Lossless by construction, for greedy and sampled decoding alike: every reported token is a real sample of a
token whose inputs are all real, and a draft only decides whether work done early can be kept. What makes the
kept work exact is the order in which ``S`` reads KV: step ``s`` of ``S`` attends to ``X``'s KV at depth slot
``s``, so it runs only in a loop op after the one that ran ``X``'s step ``s``, or after ``X`` has exited (KV policy
``last_exited`` copies ``X``'s exit-step KV into the deeper slots first, in the op that follows the decision).
That holds for ``last_exited`` and ``depth_indexed``; with ``single`` (one slot: every step reads the
predecessor's final KV) and ``first_then_shared`` nothing can start before the predecessor exits, so those
policies do not speculate. Exit decisions are each token's own: a kept ``S`` exits at the depth it would have.
A token that exits before its predecessor is verified is sampled as usual, but its token is held (``Item.sampled``)
and reported once the tokens before it are, so tokens are reported in order; its own successor follows its real
sample and stands or falls with it. Rejected work leaves no trace: its KV positions are rewritten by the fallback
before any later token reads them (loop ops run in order), its pending KV copies are dropped, its rows freed.

When it pays (the closed form the adaptive rule follows). With a mean depth ``D`` (loop steps per token), a
successor starts ``D`` loop ops after its predecessor without speculation; with a draft at depth ``d`` accepted
with probability ``a`` it starts after ``d`` ops, and after about ``D + 1`` when rejected (the fallback starts
with no delay, but drafts its own successor only once confirmed, an op later). So the expected ops per token are
``a d + (1 - a)(D + 1)``, below ``D`` exactly when ``a > 1 / (D + 1 - d)`` (the break-even acceptance), and the
speed-up at light load is ``D / (a d + (1 - a)(D + 1))``: at most ``D / d``. A draft costs one bank row and one
loop slot per op, so requests draft only while rows are free, no request waits for admission (at heavy load
CDB's own refill fills the width) and the loop op holds fewer tokens than ``--speculative-max-occupancy`` of its
width (auto: 0.5 on a GPU, where the host path's cost per op still grows with its tokens; 0.25 on a CPU, where
every token of an op costs compute too): near the knee, drafts would slow every other request down. Per
request, the acceptance is a moving average; when it falls below the break-even at the current depth the request
drafts one step deeper (a deeper read agrees more often, but leads less), and when no depth pays it pauses for a
while and starts again.
"""

from __future__ import annotations

from dataclasses import replace

from cdb_scheduler.plan import SamplingParams
from cdb_scheduler.request import Request, SpecState

ACCEPTANCE_WEIGHT = 0.25  # of the newest verdict in the moving average
PAUSE_TOKENS = 16  # generated tokens without drafting once no draft depth pays


_DRAFT_SAMPLING: dict[SamplingParams, SamplingParams] = {}


def draft_sampling(sampling: SamplingParams) -> SamplingParams:
    """A draft is sampled like the real token (same settings and seeded stream: the two agree whenever the states
    do) but reports no logprobs."""
    got = _DRAFT_SAMPLING.get(sampling)
    if got is None:
        if len(_DRAFT_SAMPLING) >= 4096:
            _DRAFT_SAMPLING.clear()
        got = _DRAFT_SAMPLING[sampling] = replace(sampling, logprobs=0, return_logprob=False)
    return got


def break_even(mean_depth: float, depth: int) -> float:
    """The acceptance above which drafting at ``depth`` shortens a token's ops (``1 / (D + 1 - d)``)."""
    lead = mean_depth + 1 - depth
    return 1.0 / lead if lead > 1 else 1.0


def mean_depth(req: Request, max_depth: int) -> float:
    """The request's own mean served depth so far (``max_depth`` before its first decode token)."""
    n = len(req.depths)
    return req.loop_steps / n if n and req.loop_steps else float(max_depth)


def observe(req: Request, state: SpecState, matched: bool, *, base_depth: int, max_depth: int, adaptive: bool) -> None:
    """A draft of ``req`` was verified: update its acceptance and, when adaptive, its draft depth or pause."""
    state.acceptance += ACCEPTANCE_WEIGHT * ((1.0 if matched else 0.0) - state.acceptance)
    if not adaptive or matched:
        return
    depth = mean_depth(req, max_depth)
    if state.acceptance >= break_even(depth, state.depth):
        return
    if state.depth + 1 < depth and state.depth + 1 < max_depth:
        state.depth += 1  # a deeper read agrees more often; start hopeful there
    else:
        state.depth = base_depth
        state.paused_until = len(req.output) + PAUSE_TOKENS
    state.acceptance = 1.0
