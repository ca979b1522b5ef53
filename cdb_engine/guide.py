"""``Guide``: one structured-output request's walk of its grammar, off the engine thread.

The scheduler asks a guide three things per token, all on its engine thread: the token's mask (``mask``, once
``ready``), whether the grammar forces it (``forced``), and to take the token sampled (``accept``). The grammar work
behind them (the matcher consuming the token, its fast-forward tokens, the next mask: ≈ 15 µs a token with a 2,048-id
vocabulary, far more with a large one) runs on the process's ``GuideWorker`` thread, most of it in llguidance without
the GIL: ``accept`` checks the token against the mask it was sampled under (a bit test) and hands the rest over.

A walk goes from an accepted token to the next position the grammar leaves free: with ``forced_skip``, every forced
token on the way (the fast-forward tokens, a position with one allowed id, the end once the grammar is complete) is
recorded and consumed at once, its mask that one id; the free position's mask is computed, and the walk's results are
published together (``frontier``: the free position). So whether a token is forced is known as soon as the mask of
the token before it is, a function of the grammar and the tokens before it, never of timing.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

_WAIT_S = 60.0  # a walk is microseconds; past this the worker is gone


class GuideWorker:
    """The thread that walks every guide of a process, in submission order (one per process: ``of_process``)."""

    _process: GuideWorker | None = None
    _made = threading.Lock()

    @classmethod
    def of_process(cls) -> GuideWorker:
        with cls._made:
            if cls._process is None:
                cls._process = cls()
            return cls._process

    @classmethod
    def _forked(cls) -> None:  # a child of a fork has none of its parent's threads: it starts its own
        cls._process = None
        cls._made = threading.Lock()

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._jobs: queue.SimpleQueue[tuple[Guide, int]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def submit(self, guide: Guide, token: int) -> None:
        if self._thread is None:
            with self._start:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="cdb-guides", daemon=True)
                    self._thread.start()
        self._jobs.put((guide, token))

    def _run(self) -> None:
        while True:
            guide, token = self._jobs.get()
            guide.walk(token)


os.register_at_fork(after_in_child=GuideWorker._forked)


class Guide:
    """One request's walk of its grammar (the scheduler's ``cdb_scheduler.sampling.Guide``)."""

    def __init__(
        self, matcher: Any, mask_bytes: int, stop_ids: Sequence[int], forced_skip: bool, worker: GuideWorker
    ) -> None:
        self._matcher = matcher
        self._mask_bytes = mask_bytes
        self._stops = sum(1 << t for t in stop_ids)  # the model's stop ids, as mask bits
        self._eos = stop_ids[0] if stop_ids else -1
        self.forced_skip = forced_skip
        self._worker = worker
        self._cond = worker.cond
        self._masks: dict[int, bytes] = {}  # published by walks, taken by ``accept``
        self._forced: dict[int, int] = {}  # index -> the token the grammar forces there (kept once accepted)
        self.frontier = 0  # the free position the last walk reached (its mask is known)
        self._pending = 0  # walks submitted and not yet published
        self.error = ""
        self.walk(-1)  # the start: here, on the caller's thread

    # -- the engine thread ------------------------------------------------------------------------------------------

    def mask_now(self, index: int, wait: bool) -> bytes:
        """Token ``index``'s mask if it is known, else b""; ``wait``: for the walks under way first (the token before
        it may be accepted and its walk not yet published)."""
        mask = self._masks.get(index)
        if mask is None and wait and self._pending:
            self._settle()
            mask = self._masks.get(index)
        return mask or b""

    def fate(self, index: int) -> int:
        """What is known of token ``index`` now: the token the grammar forces there (>= 0), -1 (it is sampled), or
        -2 (not known: a token before it is not)."""
        if index > self.frontier:
            return -2
        return self._forced.get(index, -1)

    def mask(self, index: int) -> bytes:
        """Token ``index``'s mask (``cdb_scheduler.plan.MASKS``), after the walks under way."""
        mask = self.mask_now(index, wait=True)
        if not mask:
            raise RuntimeError(f"no mask for token {index}: {self.error or 'its walk has not reached it'}")
        return mask

    def forced(self, index: int) -> int:
        """The token ``index`` must be (-1: it is sampled, or the tokens before it are not all known)."""
        token = self._forced.get(index, -1)
        if token < 0 and index > self.frontier and self._pending:
            self._settle()
            token = self._forced.get(index, -1)
        return token

    def accept(self, index: int, token: int) -> bool:
        """Token ``index`` was sampled as ``token``; False (``error`` says why) when the grammar does not allow it."""
        if index not in self._masks and index not in self._forced and self._pending:
            self._settle()  # (the walk that reaches it is under way: a resume's tokens come one after another)
        forced = self._forced.get(index, -1)  # (kept: whether a token was forced stays known)
        if forced >= 0:
            self._masks.pop(index, None)
            if forced != token:
                self.error = f"token {index} is {token}, the grammar forced {forced}"
            return forced == token and not self.error
        mask = self._masks.pop(index, None)
        if self.error or mask is None or index != self.frontier or not (token >> 3 < len(mask) and _bit(mask, token)):
            self.error = self.error or f"token {index} ({token}) is not one the grammar allows there"
            return False
        if (self._stops >> token) & 1:  # the output ends: nothing to walk
            return True
        with self._cond:
            self._pending += 1
        self._worker.submit(self, token)
        return True

    def accept_all(self, tokens: Sequence[int]) -> bool:
        """A resumed stream's tokens, from the start."""
        return all(self.accept(i, t) for i, t in enumerate(tokens))

    def _settle(self) -> None:
        """Wait for the walks submitted so far."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._pending, _WAIT_S):
                self.error = self.error or "the grammar's walk did not finish"

    # -- the worker thread ------------------------------------------------------------------------------------------

    def walk(self, token: int) -> None:
        """Consume the accepted ``token`` (-1: none, the start), then walk to the next free position."""
        m, j = self._matcher, self.frontier
        masks: dict[int, bytes] = {}
        forced: dict[int, int] = {}
        error = ""
        if token >= 0:
            j += 1
            if not m.consume_token(token):
                error = m.get_error() or f"token {j - 1} was refused"
        while not error:
            for t in m.compute_ff_tokens() if self.forced_skip and not m.is_stopped() else ():
                masks[j], forced[j] = self._one(t), t
                m.consume_token(t)
                j += 1
            if m.is_stopped():  # nothing can follow: the output ends (at any of the model's stop ids)
                mask = self._stops.to_bytes(self._mask_bytes, "little")
            else:
                mask = m.compute_bitmask()[: self._mask_bytes]
            if m.is_error():
                error = m.get_error()
                break
            bits = int.from_bytes(mask, "little")
            only = bits.bit_length() - 1 if bits and not bits & (bits - 1) else -1
            if only < 0 and bits and not bits & ~self._stops:  # the grammar is complete: the output ends
                only = self._eos
            if not self.forced_skip or only < 0:
                masks[j] = mask
                break
            masks[j], forced[j] = self._one(only), only
            j += 1
            if (self._stops >> only) & 1:  # the end: nothing to consume after it
                break
            m.consume_token(only)
        if error:  # the position may only end the output (and ``accept`` fails the request, naming the error)
            masks[j] = self._stops.to_bytes(self._mask_bytes, "little")
        with self._cond:
            self._masks.update(masks)
            self._forced.update(forced)
            self.frontier = j
            if error:
                self.error = self.error or " ".join(error.split())[:400]
            if token >= 0:
                self._pending -= 1
            self._cond.notify_all()

    def _one(self, token: int) -> bytes:
        return (1 << token).to_bytes(self._mask_bytes, "little")


def _bit(mask: bytes, token: int) -> bool:
    return bool(mask[token >> 3] >> (token & 7) & 1)
