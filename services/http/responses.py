"""Engine events -> OpenAI response objects: streamed chunks and whole responses, completions and chat.

One ``Render`` per request follows its events (text, served depths, logprobs) and shapes them: ``token(ev)`` /
``finish(ev)`` give the SSE chunks, ``response()`` the non-streamed body. Each token's served loop depth is an
extension field of the choice, ``"cdb": {"depths": [...]}`` (plus ``mean_depth`` and ``total_loop_steps`` once
the request has finished); a streamed token's chunk also carries its id (``"token_ids"``), which a client resumes
a broken stream with (the request's ``resume`` extension).
"""

from __future__ import annotations

import time
from typing import Any

from cdb_engine.events import FinishEvent, TokenEvent
from cdb_model.tokenizer import Tokenizer
from cdb_scheduler.plan import TokenLogprobs
from cdb_scheduler.request import FinishReason

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "abort"}


class Render:
    """Shapes one request's events; subclasses give the completions and chat formats."""

    chunk_object = ""
    full_object = ""

    def __init__(
        self, response_id: str, model: str, tokenizer: Tokenizer, *, include_usage: bool = False, logprobs: bool = False
    ) -> None:
        self.id, self.model, self.tokenizer = response_id, model, tokenizer
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.created = int(time.time())
        self.text = ""
        self.depths: list[int] = []
        self.lp: list[tuple[int, TokenLogprobs]] = []  # (token id, its logprobs), in order
        self.offsets: list[int] = []  # text offset of each token
        self.end: FinishEvent | None = None

    # --- shared -------------------------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _record(self, ev: TokenEvent | FinishEvent) -> None:
        if isinstance(ev, TokenEvent):
            self.offsets.append(len(self.text))
            self.depths.append(ev.depth)
            if ev.logprobs is not None:
                self.lp.append((ev.token_id, ev.logprobs))
        else:
            self.end = ev
        self.text += ev.text

    def _envelope(self, choices: list[dict[str, Any]], usage: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage and usage:
            out["usage"] = None
        return out

    def usage(self) -> dict[str, int]:
        assert self.end is not None
        prompt, completion = self.end.prompt_tokens, self.end.generated_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def finish_reason(self) -> str:
        assert self.end is not None
        return _FINISH.get(self.end.finish_reason, "stop")

    def summary(self, depths: list[int]) -> dict[str, Any]:
        """The depth extension of a finished choice."""
        assert self.end is not None
        mean = sum(self.depths) / len(self.depths) if self.depths else None
        return {"depths": depths, "mean_depth": mean, "total_loop_steps": self.end.total_loop_steps}

    def token(self, ev: TokenEvent) -> dict[str, Any]:
        """The chunk streamed for one token."""
        self._record(ev)
        lp = self._logprobs(self.lp[-1:], self.offsets[-1:]) if self.logprobs and ev.logprobs is not None else None
        cdb = {"depths": [ev.depth], "token_ids": [ev.token_id]}  # what a broken stream resumes with
        return self._envelope([self._chunk_choice(ev.text, lp, None, cdb)])

    def finish(self, ev: FinishEvent) -> list[dict[str, Any]]:
        """The last chunk (held-back text, ``finish_reason``) and, when asked, the usage chunk."""
        self._record(ev)
        chunks = [self._envelope([self._chunk_choice(ev.text, None, self.finish_reason(), self.summary([]))])]
        if self.include_usage:
            chunks.append({**self._envelope([], usage=False), "usage": self.usage()})
        return chunks

    def first(self) -> list[dict[str, Any]]:
        """Chunks streamed before the first token (chat: the role)."""
        return []

    def response(self) -> dict[str, Any]:
        """The non-streamed body once every event has been recorded (``add``)."""
        lp = self._logprobs(self.lp, self.offsets) if self.logprobs else None
        choice = self._full_choice(lp)
        choice["cdb"] = self.summary(self.depths)
        return {**self._envelope([choice], usage=False), "object": self.full_object, "usage": self.usage()}

    def add(self, ev: TokenEvent | FinishEvent) -> None:
        self._record(ev)

    # --- per format ---------------------------------------------------------------------------------------------
    def _chunk_choice(
        self, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None, cdb: dict[str, Any]
    ) -> dict[str, Any]:
        raise NotImplementedError

    def _full_choice(self, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        raise NotImplementedError

    def _logprobs(self, entries: list[tuple[int, TokenLogprobs]], offsets: list[int]) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRender(Render):
    """``text_completion`` objects (``/v1/completions``); ``logprobs`` in the legacy format."""

    chunk_object = full_object = "text_completion"

    def _chunk_choice(
        self, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None, cdb: dict[str, Any]
    ) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, "cdb": cdb}

    def _full_choice(self, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": 0, "text": self.text, "logprobs": logprobs, "finish_reason": self.finish_reason()}

    def _logprobs(self, entries: list[tuple[int, TokenLogprobs]], offsets: list[int]) -> dict[str, Any]:
        return {
            "tokens": [self.token_text(t) for t, _ in entries],
            "token_logprobs": [lp.logprob for _, lp in entries],
            "top_logprobs": [{self.token_text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)} for _, lp in entries],
            "text_offset": offsets,
        }


class ChatRender(Render):
    """``chat.completion`` / ``chat.completion.chunk`` objects; ``logprobs.content`` entries per token."""

    chunk_object = "chat.completion.chunk"
    full_object = "chat.completion"

    def first(self) -> list[dict[str, Any]]:
        choice = self._chunk_choice("", None, None, {"depths": []})
        choice["delta"] = {"role": "assistant", "content": ""}
        return [self._envelope([choice])]

    def _chunk_choice(
        self, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None, cdb: dict[str, Any]
    ) -> dict[str, Any]:
        delta = {"content": text} if text or finish_reason is None else {}
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, "cdb": cdb}

    def _full_choice(self, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": self.text}
        return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": self.finish_reason()}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _logprobs(self, entries: list[tuple[int, TokenLogprobs]], offsets: list[int]) -> dict[str, Any]:
        content = []
        for token_id, lp in entries:
            entry = self._entry(token_id, lp.logprob)
            entry["top_logprobs"] = [self._entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]
            content.append(entry)
        return {"content": content}
