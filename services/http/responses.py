"""Engine events -> OpenAI response objects: streamed chunks and whole responses, completions and chat.

One ``Render`` per engine request (one choice: its ``index``) follows its events (text, served depths, logprobs)
and shapes them: ``before(ev)`` / ``token(ev)`` / ``finish(ev)`` give the SSE chunks, ``response()`` the
non-streamed body; ``merged_response`` and ``usage_of`` join the choices of a request with several (a list of
prompts, ``n`` > 1). Each token's served loop depth is an extension field of the choice, ``"cdb": {"depths":
[...]}`` (plus ``mean_depth`` and ``total_loop_steps`` once the request has finished); a streamed token's chunk
also carries its id (``"token_ids"``), which a client resumes a broken stream with (the request's ``resume``
extension). A completion with ``echo`` starts with its prompt (``echo_prompt``): its text, and with ``logprobs``
each prompt token's logprob (the first's is null), computed at full depth by the prefill.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from cdb_engine.events import FinishEvent, TokenEvent
from cdb_model.tokenizer import Tokenizer
from cdb_scheduler.request import FinishReason
from cdb_scheduler.sampling import TokenLogprobs

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "abort"}


class Render:
    """Shapes one request's events; subclasses give the completions and chat formats."""

    chunk_object = ""
    full_object = ""

    def __init__(
        self,
        response_id: str,
        model: str,
        tokenizer: Tokenizer,
        *,
        include_usage: bool = False,
        continuous_usage: bool = False,
        logprobs: bool = False,
        prompt_logprobs: bool = False,
        index: int = 0,
        sample: int = 0,
    ) -> None:
        """``index``: the choice's index in the response; ``sample``: which of its prompt's ``n`` samples it is
        (the usage counts a prompt's tokens once, with its sample 0)."""
        self.id, self.model, self.tokenizer = response_id, model, tokenizer
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # every chunk carries the usage so far (vLLM's stream option)
        self.prompt_ids: list[int] = []  # set once the request is admitted (its tokenized prompt)
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs: each prompt token's, with the first event
        self.prompt_scores: list[dict[str, Any] | None] | None = None  # (sent with the first chunk that carries it)
        self.logprobs = logprobs
        self.index, self.sample = index, sample
        self.created = int(time.time())
        self.text = ""
        self.depths: list[int] = []
        self.lp: list[tuple[int, TokenLogprobs | None]] = []  # (token id, its logprobs), in order
        self.offsets: list[int] = []  # text offset of each token
        self.end: FinishEvent | None = None
        self.echo: tuple[str, list[int]] | None = None  # the prompt to echo (text, ids), until it is sent

    # --- shared -------------------------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def echo_prompt(self, text: str, ids: Sequence[int]) -> None:
        """Begin the choice with its prompt (``echo``): ``text`` and its token ids, whose logprobs come with the
        first event (``TokenEvent.prompt_logprobs`` / ``FinishEvent.prompt_logprobs``)."""
        self.echo = (text, list(ids))

    def _record_echo(self, ev: TokenEvent | FinishEvent) -> None:
        """The echoed prompt, before the first event: its text, and its tokens' logprobs (the first token's is
        None: nothing precedes it) at offsets within the prompt text."""
        assert self.echo is not None and not self.text and not self.lp
        text, ids = self.echo
        self.echo = None
        self.text = text
        if not self.logprobs:
            return
        scores: list[TokenLogprobs | None] = [None, *ev.prompt_logprobs]
        offset = 0
        for token_id, lp in zip(ids, scores):
            self.lp.append((token_id, lp))
            self.offsets.append(offset)
            offset += len(self.token_text(token_id))

    def before(self, ev: TokenEvent | FinishEvent) -> list[dict[str, Any]]:
        """Chunks streamed before the request's first event: the echoed prompt (with its logprobs)."""
        if self.echo is None:
            return []
        self._record_echo(ev)
        lp = self._logprobs(self.lp, self.offsets) if self.logprobs else None
        return [self._envelope([self._chunk_choice(self.text, lp, None, {"depths": []})])]

    def _record(self, ev: TokenEvent | FinishEvent) -> None:
        if self.echo is not None:
            self._record_echo(ev)
        if self.prompt_logprobs and self.prompt_scores is None:
            self.prompt_scores = prompt_scores(self.prompt_ids, ev.prompt_logprobs, self.token_text)
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
        if self.continuous_usage and usage:
            n = len(self.depths)
            out["usage"] = {
                "prompt_tokens": len(self.prompt_ids),
                "completion_tokens": n,
                "total_tokens": len(self.prompt_ids) + n,
            }
        elif self.include_usage and usage:
            out["usage"] = None
        return out

    def usage(self) -> dict[str, int]:
        return usage_of([self])

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
        return self._envelope([self._with_prompt(self._chunk_choice(ev.text, lp, None, cdb))])

    def finish(self, ev: FinishEvent) -> dict[str, Any]:
        """The choice's last chunk (held-back text, ``finish_reason``)."""
        self._record(ev)
        choice = self._chunk_choice(ev.text, None, self.finish_reason(), self.summary([]))
        return self._envelope([self._with_prompt(choice)])

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The chunk after every choice's last, when usage is asked (``stream_options.include_usage``)."""
        return {**self._envelope([], usage=False), "usage": usage}

    def first(self) -> list[dict[str, Any]]:
        """Chunks streamed before the first token (chat: the role)."""
        return []

    def response(self) -> dict[str, Any]:
        """The non-streamed body once every event has been recorded (``add``)."""
        lp = self._logprobs(self.lp, self.offsets) if self.logprobs else None
        choice = self._with_prompt(self._full_choice(lp))
        choice["cdb"] = self.summary(self.depths)
        return {**self._envelope([choice], usage=False), "object": self.full_object, "usage": self.usage()}

    def add(self, ev: TokenEvent | FinishEvent) -> None:
        self._record(ev)

    def _with_prompt(self, choice: dict[str, Any]) -> dict[str, Any]:
        """``choice`` with the prompt's logprobs, the first time they are there (``prompt_logprobs``)."""
        if self.prompt_scores is not None:
            choice["prompt_logprobs"], self.prompt_scores = self.prompt_scores, None
            self.prompt_logprobs = False  # (sent: not made again)
        return choice

    # --- per format ---------------------------------------------------------------------------------------------
    def _chunk_choice(
        self, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None, cdb: dict[str, Any]
    ) -> dict[str, Any]:
        raise NotImplementedError

    def _full_choice(self, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        raise NotImplementedError

    def _logprobs(self, entries: list[tuple[int, TokenLogprobs | None]], offsets: list[int]) -> dict[str, Any]:
        raise NotImplementedError


def prompt_scores(
    ids: Sequence[int], scores: Sequence[TokenLogprobs], text: Callable[[int], str]
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` of a prompt: None for its first token (nothing precedes it), then per token a map
    ``{token id: {logprob, rank, decoded_token}}`` of the token itself and the top alternatives the request asked
    for (ranks from 1, most likely first; a prompt token outside the alternatives has rank null: this server
    computes the top alternatives, not the full ranking)."""
    out: list[dict[str, Any] | None] = [None]
    for token, lp in zip(ids[1:], scores, strict=False):
        entry = {
            str(t): {"logprob": v, "rank": r + 1, "decoded_token": text(t)}
            for r, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True))
        }
        if str(token) not in entry:
            entry = {str(token): {"logprob": lp.logprob, "rank": None, "decoded_token": text(token)}, **entry}
        out.append(entry)
    return out


def usage_of(renders: Sequence[Render]) -> dict[str, int]:
    """The usage of a response whose choices these are (finished): each prompt's tokens once (with its sample 0),
    every choice's generated tokens; a resumed stream's tokens apart, as ``resumed_tokens`` (when there are any):
    generated by the broken stream, not by this request."""
    prompt = completion = resumed = 0
    for r in renders:
        assert r.end is not None
        prompt += r.end.prompt_tokens if r.sample == 0 else 0
        completion += r.end.generated_tokens
        resumed += r.end.resumed_tokens
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return usage | ({"resumed_tokens": resumed} if resumed else {})


def merged_response(renders: Sequence[Render]) -> dict[str, Any]:
    """The non-streamed body of a response with these choices (finished), in index order."""
    out = renders[0].response()
    if len(renders) > 1:
        out["choices"] = [r.response()["choices"][0] for r in sorted(renders, key=lambda r: r.index)]
        out["usage"] = usage_of(renders)
    return out


class CompletionRender(Render):
    """``text_completion`` objects (``/v1/completions``); ``logprobs`` in the legacy format."""

    chunk_object = full_object = "text_completion"

    def _chunk_choice(
        self, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None, cdb: dict[str, Any]
    ) -> dict[str, Any]:
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, "cdb": cdb}

    def _full_choice(self, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": self.index, "text": self.text, "logprobs": logprobs, "finish_reason": self.finish_reason()}

    def _logprobs(self, entries: list[tuple[int, TokenLogprobs | None]], offsets: list[int]) -> dict[str, Any]:
        """The legacy format; an echoed prompt's first token has null ``token_logprobs`` and ``top_logprobs``."""
        return {
            "tokens": [self.token_text(t) for t, _ in entries],
            "token_logprobs": [lp.logprob if lp is not None else None for _, lp in entries],
            "top_logprobs": [
                {self.token_text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)} if lp is not None else None
                for _, lp in entries
            ],
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
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, "cdb": cdb}

    def _full_choice(self, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": self.text}
        return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": self.finish_reason()}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _logprobs(self, entries: list[tuple[int, TokenLogprobs | None]], offsets: list[int]) -> dict[str, Any]:
        content = []
        for token_id, lp in entries:
            assert lp is not None  # a chat never echoes its prompt
            entry = self._entry(token_id, lp.logprob)
            entry["top_logprobs"] = [self._entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]
            content.append(entry)
        return {"content": content}
