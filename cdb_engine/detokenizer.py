"""Streaming detokenization: text deltas per token, in time independent of the length of the output so far, and
``TextOutput``, the one stop-string rule of a request's output, wherever its text is made."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from cdb_engine.events import FinishEvent
from cdb_model.tokenizer import Tokenizer
from cdb_scheduler.request import FinishReason

_INCOMPLETE = "\ufffd"  # what a decoder gives for the first bytes of an unfinished UTF-8 sequence
# Ids held back at most: no UTF-8 sequence spans more (4 bytes, a byte per id at worst); more are ids that decode
# to nothing or to broken bytes, which waiting cannot mend, and each held id would be decoded again per push.
_MAX_PENDING = 8


@dataclass(slots=True)
class Detokenizer:
    """Streams text deltas; holds back an incomplete UTF-8 sequence and text that may begin a stop string.

    Each ``push`` decodes only a short window: the ids since the last emitted boundary (``read``) plus those of
    the chunk before it (``prefix``), which gives tokenizers whose decoding depends on the previous token (a
    leading space, a byte fallback) their context; the context's decoded length is kept (``context``), so it is
    decoded again only when the boundary moves. ``text`` holds the stable text so far (without stop strings: only
    what is not handed out yet); ``sent`` counts the characters of it already handed out. ``skip_special``: special
    tokens decode to nothing (vLLM's ``skip_special_tokens``); ``include_stop``: the text ends after the stop string
    it hit, not before it (vLLM's ``include_stop_str_in_output``).
    """

    tokenizer: Tokenizer
    stop_strings: tuple[str, ...]
    skip_special: bool = True
    include_stop: bool = False
    ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0
    prefix: int = 0  # ids[prefix:read] decode to the context chunk before the pending ids
    read: int = 0  # ids[read:] are not yet part of ``text``
    context: int = 0  # len(decode(ids[prefix:read])): fixed until the boundary moves, so decoded once per move

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; returns (new text, whether a stop string was hit — the text stops before it)."""
        ids = self.ids
        ids.append(token_id)
        window = self.tokenizer.decode(ids[self.prefix :], self.skip_special)
        settled = len(window) > self.context and not window.endswith(_INCOMPLETE)
        if settled or len(ids) - self.read >= _MAX_PENDING:
            self.text += window[self.context :]
            self.prefix, self.read = self.read, len(ids)
            context = (
                self.tokenizer.decode(ids[self.prefix : self.read], self.skip_special)
                if self.prefix < self.read
                else ""
            )
            self.context = len(context)
        if not self.stop_strings:  # nothing to hold back or search: all new stable text goes out, none is kept
            delta, self.text, self.sent = self.text[self.sent :], "", 0
            return delta, False
        return self._release(final=False)

    def flush(self) -> str:
        """Text held back at the end of the stream."""
        self.text += self.tokenizer.decode(self.ids[self.prefix :], self.skip_special)[self.context :]
        self.prefix = self.read = len(self.ids)
        self.context = 0
        return self._release(final=True)[0]

    def _release(self, *, final: bool) -> tuple[str, bool]:
        text = self.text
        for stop in self.stop_strings:
            at = text.find(stop, max(0, self.sent - len(stop) + 1))
            if at >= 0:
                end = at + len(stop) if self.include_stop else at
                delta = text[self.sent : end]
                self.sent = end
                return delta, True
        end = len(text)
        if not final:
            hold = max((len(s) - 1 for s in self.stop_strings), default=0)
            for k in range(min(hold, end - self.sent), 0, -1):  # a suffix that may grow into a stop string
                if any(s.startswith(text[end - k : end]) for s in self.stop_strings):
                    end -= k
                    break
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta, False


@dataclass(slots=True)
class TextOutput(Detokenizer):
    """One request's output text: a ``Detokenizer`` with the stop-string rule, the same in the engine and in a
    front-end process.

    A stop string ends the text before it (``stopped``); the owner then ends the request with
    ``FinishReason.STOP``. Tokens that still arrive after the stop (an engine in another process went on until it
    heard) are dropped, and the finish is reported as if the request had stopped there: counts without them,
    reason STOP, no text after the stop. A request that ended by itself on the token that hit the stop string keeps
    its own reason (the engine finds it already ended when it would stop it). Text held back at the end is
    released with the finish, unless a stop string ended the request.
    """

    stopped: bool = False
    dropped: int = 0  # tokens dropped after the stop
    dropped_steps: int = 0  # and their loop steps

    def token_text(self, token_id: int, depth: int) -> str | None:
        """The token's text (None: dropped after a stop string); sets ``stopped`` when it hits one."""
        if self.stopped:
            self.dropped += 1
            self.dropped_steps += depth
            return None
        text, self.stopped = self.push(token_id)
        return text

    def finish(self, event: FinishEvent) -> FinishEvent:
        """The engine's finish as the stream reports it (the class docstring)."""
        if not self.dropped:
            tail = self.flush() if event.finish_reason is not FinishReason.STOP else ""
            return msgspec.structs.replace(event, text=tail) if tail else event
        return msgspec.structs.replace(
            event,
            finish_reason=FinishReason.STOP,
            generated_tokens=event.generated_tokens - self.dropped,
            total_loop_steps=event.total_loop_steps - self.dropped_steps,
            text="",
        )
