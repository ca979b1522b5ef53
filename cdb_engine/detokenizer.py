"""Streaming detokenization: text deltas per token, in time independent of the length of the output so far."""

from __future__ import annotations

from dataclasses import dataclass, field

from cdb_model.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"  # what a decoder gives for the first bytes of an unfinished UTF-8 sequence


@dataclass(slots=True)
class Detokenizer:
    """Streams text deltas; holds back an incomplete UTF-8 sequence and text that may begin a stop string.

    Each ``push`` decodes only a short window: the ids since the last emitted boundary (``read``) plus those of
    the chunk before it (``prefix``), which gives tokenizers whose decoding depends on the previous token (a
    leading space, a byte fallback) their context. ``text`` holds the stable text so far; ``sent`` counts the
    characters of it already handed out.
    """

    tokenizer: Tokenizer
    stop_strings: tuple[str, ...]
    ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0
    prefix: int = 0  # ids[prefix:read] decode to the context chunk before the pending ids
    read: int = 0  # ids[read:] are not yet part of ``text``

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; returns (new text, whether a stop string was hit — the text stops before it)."""
        self.ids.append(token_id)
        context = self.tokenizer.decode(self.ids[self.prefix : self.read])
        window = self.tokenizer.decode(self.ids[self.prefix :])
        if len(window) > len(context) and not window.endswith(_INCOMPLETE):
            self.text += window[len(context) :]
            self.prefix, self.read = self.read, len(self.ids)
        return self._release(final=False)

    def flush(self) -> str:
        """Text held back at the end of the stream."""
        context = self.tokenizer.decode(self.ids[self.prefix : self.read])
        self.text += self.tokenizer.decode(self.ids[self.prefix :])[len(context) :]
        self.prefix = self.read = len(self.ids)
        return self._release(final=True)[0]

    def _release(self, *, final: bool) -> tuple[str, bool]:
        text = self.text
        for stop in self.stop_strings:
            at = text.find(stop, max(0, self.sent - len(stop) + 1))
            if at >= 0:
                delta = text[self.sent : at]
                self.sent = at
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
