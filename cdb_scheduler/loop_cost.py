"""What a loop op costs against its width, fitted online, and whether drafts pay at that cost.

``LoopCost`` fits ``c(w) = alpha + beta * w`` (what a decode loop op of ``w`` tokens costs the whole path: the
wall time from its issue, or from the previous loop op's result if that came later, to its result; the stage's
compute and every hand-over and host step around it) by least squares over the recent ops, each weighing
``FORGET`` of the sums (about the last ``1 / FORGET`` ops count). A GPU's op costs nearly the same at any width up
to the device's limit (alpha dominates); a CPU's grows with every token (beta dominates). The slope is trusted
once the recent widths spread (weighted variance ``MIN_VARIANCE``); until then the last trusted fit stands, and
before the first one ``explore`` lets every ``EXPLORE_EVERY``-th op draft, so that the cost at a larger width is
seen, and until ``MIN_VERDICTS`` drafts are verified, so that their acceptance is known (a draft adds a token
for a few ops: at most about ``max_depth / EXPLORE_EVERY`` of a loop op's tokens are spent exploring, and only
until then).

``drafts_that_pay`` is the speculation's rule under ``--speculative auto``: a loop op of requests ``j`` with
``D_j`` loop ops per token (their mean depth) produces ``sum_j 1 / D_j`` tokens per ``c(n)``; a request that
drafts at depth ``d`` with acceptance ``a`` needs ``E = a d + (1 - a)(D + 1)`` ops per token instead
(``cdb_scheduler.speculation``; ``a`` read as at most the server's acceptance until a few of its own drafts are
verified, at most ``PRIOR_ACCEPTANCE`` until a few of any are: exploring ops draft until then), and its draft adds
a token to the op. Drafts are taken, the largest gain first,
while the op's tokens per second grow by more than ``MARGIN``: with a cost proportional to the width a draft never
pays (it doubles a lone request's op to save well under half of its ops); with a flat cost, every draft whose
``E < D`` does.

``DraftTrial`` checks the rule's answer against what is measured: the server's reported tokens per second of
loop time in adjacent epochs with the rule's drafts and without any, so that host work the fit cannot see (per
draft, on the path around the op) never makes ``auto`` lose to ``off`` by more than a fraction of an epoch in
``TRIAL_EXPLORE``.
"""

from __future__ import annotations

import math

FORGET = 0.02  # weight of the newest op in the fit's running sums
MIN_VARIANCE = 0.05  # weighted variance of the recent widths (tokens^2) before the slope is trusted
EXPLORE_EVERY = 16  # before the first trusted fit, one op in this many may draft
MARGIN = 0.02  # a draft must raise the op's tokens per second by more than this fraction
PRIOR_ACCEPTANCE = 0.5  # a request's acceptance as the rule reads it until MIN_VERDICTS of its drafts are verified
MIN_VERDICTS = 4


class LoopCost:
    """The fit of the module docstring; ``observe`` each decode loop op, ``explore`` once per op formed."""

    def __init__(self) -> None:
        self.weight = 0.0
        self.sx = 0.0
        self.sy = 0.0
        self.sxx = 0.0
        self.sxy = 0.0
        self.alpha = 0.0
        self.beta = 0.0
        self.trusted = False
        self.formed = 0

    def observe(self, width: int, seconds: float) -> None:
        """A decode loop op of ``width`` tokens took ``seconds`` (the module docstring)."""
        if width <= 0 or seconds <= 0.0:
            return
        keep = 1.0 - FORGET
        x = float(width)
        self.weight = keep * self.weight + FORGET
        self.sx = keep * self.sx + FORGET * x
        self.sy = keep * self.sy + FORGET * seconds
        self.sxx = keep * self.sxx + FORGET * x * x
        self.sxy = keep * self.sxy + FORGET * x * seconds
        mx, my = self.sx / self.weight, self.sy / self.weight
        var = self.sxx / self.weight - mx * mx
        if var >= MIN_VARIANCE:
            beta = max(0.0, (self.sxy / self.weight - mx * my) / var)
            alpha = my - beta * mx
            if alpha < 0.0:  # (noise: a line through the origin, the costliest slope the data allow)
                alpha, beta = 0.0, my / mx
            self.alpha, self.beta, self.trusted = alpha, beta, True
        elif not self.trusted:  # one width so far: all of it could be per token (the cautious reading)
            self.alpha, self.beta = 0.0, my / mx

    def cost(self, width: int) -> float:
        return self.alpha + self.beta * width

    def explore(self, need_verdicts: bool = False) -> bool:
        """Whether the op being formed may draft to learn the slope (before the first trusted fit), or the drafts'
        acceptance (``need_verdicts``: fewer than ``MIN_VERDICTS`` drafts verified so far)."""
        self.formed += 1
        return (not self.trusted or need_verdicts) and self.formed % EXPLORE_EVERY == 0


def expected_ops(depth: float, draft_depth: int, acceptance: float) -> float:
    """Loop ops per token of a request drafting at ``draft_depth`` with ``acceptance`` (mean depth ``depth``)."""
    return acceptance * draft_depth + (1.0 - acceptance) * (depth + 1.0)


def judged_acceptance(acceptance: float, verdicts: int, accepted_all: int, verdicts_all: int) -> float:
    """The acceptance the rule reads: the request's own once ``MIN_VERDICTS`` of its drafts are verified; before
    that at most the server's (``accepted_all`` of ``verdicts_all``) once it has that many, else at most
    ``PRIOR_ACCEPTANCE`` (a request's own starts hopeful, at 1, to let the adaptive depth rule try)."""
    if verdicts >= MIN_VERDICTS:
        return acceptance
    prior = accepted_all / verdicts_all if verdicts_all >= MIN_VERDICTS else PRIOR_ACCEPTANCE
    return min(acceptance, prior)


def drafts_that_pay(cost: LoopCost, width: int, base_rate: float, gains: list[float]) -> int:
    """How many of the candidate drafts (``gains``: each one's ``1 / E - 1 / D``, best first) a loop op of ``width``
    tokens should start, its requests producing ``base_rate`` tokens per op without them."""
    taken = 0
    rate = base_rate
    now = cost.cost(width)
    if now <= 0.0:  # no op observed yet
        return 0
    best = rate / now
    for gain in gains:
        if gain <= 0.0:
            break
        trial = (rate + gain) / cost.cost(width + taken + 1)
        if trial <= best * (1.0 + MARGIN):
            break
        rate, best, taken = rate + gain, trial, taken + 1
    return taken


TRIAL_OPS = 64  # decode loop ops per trial epoch
TRIAL_EXPLORE = 8  # once the arms are compared, one epoch in this many runs the losing arm
TRIAL_PAIRS = 4  # adjacent epochs of both arms compared before the verdict stands (until then they alternate)
TRIAL_WEIGHT = 0.2  # of the newest pair's log ratio in the moving average
TRIAL_MARGIN = 0.02  # drafting must raise the reported tokens per second by more than this fraction


class DraftTrial:
    """Whether drafting (the drafts ``drafts_that_pay`` picks) raises the tokens the server reports per second,
    measured rather than modelled: the fit above sees what a loop op costs at each width, not the host's work per
    draft (sampling, verifying, holding and reporting its tokens), which can decide the result where the host is
    the bottleneck. Decode loop ops run in epochs of ``TRIAL_OPS``, each with drafting on or off (``drafting``);
    every two adjacent epochs of the two arms give a ratio of their tokens per second of loop time (the sum of
    the ops' times as ``LoopCost.observe`` reads them: idle time between requests is not counted), averaged in
    log space. Until ``TRIAL_PAIRS`` ratios are in, the arms alternate; then the winning arm runs and one epoch in
    ``TRIAL_EXPLORE`` tries the other (at most about 1 / ``TRIAL_EXPLORE`` of a loss, only while the answer is
    wrong). Adjacent epochs see the same load, so a load that changes over minutes does not decide the verdict.
    An epoch in which the rule wanted no draft compares nothing (both arms did the same)."""

    def __init__(self) -> None:
        self.drafting = True  # the arm of the epoch being run
        self.verdict = True  # whether drafting wins, as far as measured
        self.log_ratio = 0.0  # moving average of log(rate with drafts / rate without)
        self.pairs = 0
        self.epochs = 0
        self.ops = 0
        self.seconds = 0.0
        self.tokens = 0  # reported tokens at the start of the epoch
        self.drafts = 0  # drafts started at the start of the epoch
        self.last_rate = -1.0  # the previous epoch's tokens per second (-1: none to compare with)
        self.last_arm = True

    def observe(self, seconds: float, tokens: int, drafts: int) -> None:
        """A decode loop op took ``seconds``; ``tokens`` (reported) and ``drafts`` (that the rule picked) are the
        server's counts so far."""
        if self.ops == 0:
            self.tokens, self.drafts = tokens, drafts
        self.ops += 1
        self.seconds += seconds
        if self.ops < TRIAL_OPS:
            return
        rate = (tokens - self.tokens) / self.seconds if self.seconds > 0.0 else -1.0
        if self.drafting and drafts == self.drafts:
            rate = -1.0  # no draft was wanted: nothing to compare
        self._compare(rate)
        self.ops, self.seconds = 0, 0.0
        self.epochs += 1
        self.drafting = self._next_arm()

    def _compare(self, rate: float) -> None:
        last, arm = self.last_rate, self.drafting
        if rate > 0.0 and last > 0.0 and arm != self.last_arm:
            on, off = (rate, last) if arm else (last, rate)
            sample = math.log(on / off)
            self.log_ratio = sample if self.pairs == 0 else self.log_ratio + TRIAL_WEIGHT * (sample - self.log_ratio)
            self.pairs += 1
            if self.pairs >= TRIAL_PAIRS:
                self.verdict = self.log_ratio > math.log1p(TRIAL_MARGIN)
        self.last_rate, self.last_arm = rate, arm

    def _next_arm(self) -> bool:
        if self.pairs < TRIAL_PAIRS:
            return not self.drafting
        explore = self.epochs % TRIAL_EXPLORE == 0
        return self.verdict != explore
