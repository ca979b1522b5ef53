"""The tokenizer routes (vLLM's shapes: a remote tokenizer, e.g. the evaluation harness's, speaks them):
``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from cdb_engine.validation import check_messages_size, check_text_size
from services.http.context import ApiContext
from services.http.errors import ApiError, api_error
from services.http.schemas import CHAT_FIELDS, FIELDS, DetokenizeRequest, TokenizeRequest


class TokenRoutes:
    """The tokenizer routes of one app."""

    def __init__(self, ctx: ApiContext) -> None:
        self.ctx = ctx
        self.prep, self.templates = ctx.prep, ctx.templates

    def tokenize_ids(self, body: TokenizeRequest) -> list[int]:  # on a worker thread: templates and tokenizers are slow
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            chat = [{"role": m.role, "content": m.content or ""} for m in body.messages]
            check_messages_size(chat)
            return self.templates.apply(chat, add_generation_prompt=body.add_generation_prompt)
        if isinstance(body.prompt, list):
            self.check_token_ids(body.prompt, "prompt")
            return list(body.prompt)
        assert body.prompt is not None
        check_text_size(body.prompt, "prompt")
        return self.prep.tokenizer.encode(body.prompt)

    def tokenized(self, body: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        """``tokenize_ids`` bounded by ``max_model_len`` (a text within the 1 MiB body bound may be a hundred times
        longer), and each id's text where asked: on a worker thread, so that the event loop (health, every other
        stream) never waits for a long input."""
        ids = self.tokenize_ids(body)
        limit = self.prep.limits.max_total_tokens
        if len(ids) > limit:
            param = "messages" if body.messages is not None else "prompt"
            raise ApiError(400, f"{len(ids)} tokens, more than {limit} (max_model_len)", param=param)
        if not body.return_token_strs:
            return ids, None
        decode = self.prep.tokenizer.decode
        return ids, [decode([i], skip_special_tokens=False) for i in ids]

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        if len(ids) > self.prep.limits.max_total_tokens:
            raise ApiError(400, f"more than {self.prep.limits.max_total_tokens} token ids (max_model_len)", param=param)
        bad = [t for t in ids if not 0 <= t < self.prep.limits.vocab_size]
        if bad:
            raise ApiError(
                400, f"unknown token ids {bad[:5]} (vocabulary size {self.prep.limits.vocab_size})", param=param
            )

    async def tokenize(self, body: TokenizeRequest) -> Response:
        """Token ids of a prompt or a chat, as the completions endpoints would see them."""
        self.ctx.check_model(body.model)
        try:
            ids, strs = await run_in_threadpool(self.tokenized, body)
        except Exception as exc:
            return api_error(exc, CHAT_FIELDS if body.messages is not None else FIELDS).response()
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": self.prep.limits.max_total_tokens,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, body: DetokenizeRequest) -> Response:
        """The text of token ids (special tokens skipped, as in generated text)."""
        self.ctx.check_model(body.model)
        try:
            self.check_token_ids(body.tokens, "tokens")
            text = await run_in_threadpool(self.prep.tokenizer.decode, body.tokens)
        except Exception as exc:
            return api_error(exc, FIELDS).response()
        return JSONResponse({"prompt": text})

    async def tokenizer_info(self) -> dict[str, Any]:
        """What a remote tokenizer needs: the class, sizes, special tokens and ids, and the chat template (the
        harness's remote tokenizer reads ``eos_token``: the stop string it adds, and the prefix of an empty
        context)."""
        tok = self.prep.tokenizer
        eos = tok.eos_token_id
        return {
            "tokenizer_class": type(tok).__name__,
            "vocab_size": self.prep.limits.vocab_size,
            "model_max_length": self.prep.limits.max_total_tokens,
            "eos_token": tok.decode([eos], skip_special_tokens=False) if eos is not None else None,
            "bos_token": None,  # none given: /tokenize adds what the tokenizer's own configuration says
            "pad_token": None,
            "eos_token_id": eos,
            "stop_token_ids": list(tok.stop_token_ids),
            "chat_template": self.templates.source,
        }
