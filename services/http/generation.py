"""The generation routes: ``POST /v1/completions`` and ``POST /v1/chat/completions``, one engine request per choice
(``calls.Choice``) admitted at the front door, streamed as SSE or answered once all have finished."""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from cdb_engine.config import RequestParams
from cdb_engine.errors import InvalidRequest
from cdb_engine.limits import REQUEST_BOUNDS
from cdb_engine.validation import check_messages_size, check_request_id
from services.api.door import Ticket
from services.api.shares import host_key, share_scope
from services.http.calls import Choice, open_call
from services.http.context import ApiContext
from services.http.errors import api_error
from services.http.responses import ChatRender, CompletionRender, merged_response
from services.http.schemas import CHAT_FIELDS, FIELDS, ChatCompletionRequest, CompletionRequest
from services.http.streaming import EventStream, sse_body, until_done_or_gone
from services.http.tools import ToolCallRender


class GenerationRoutes:
    """The generation routes of one app."""

    def __init__(self, ctx: ApiContext) -> None:
        self.ctx = ctx

    async def run(
        self,
        request: Request,
        choices: Sequence[Choice],
        *,
        stream: bool,
        fields: Mapping[str, str],
        operation: str,
        max_tokens: int,
        echo: Callable[[Choice, Ticket], None] | None = None,
    ) -> Response:
        """Admit the request's choices, one engine request each (a refusal of any is the error reply, and ends
        those admitted before it), then stream them or answer once all have finished. ``echo(choice, call)``:
        what an admitted choice begins with (its prompt)."""
        door, auth = self.ctx.door, self.ctx.auth
        headers = request.headers.items()
        response_id = choices[0].render.id
        calls: list[Ticket] = []
        where = fields
        try:
            caller = share_scope(auth.scope_of(headers), host_key(request.client.host if request.client else ""))
            for choice in choices:
                where = choice.fields
                call = await open_call(
                    door,
                    choice.request_id,
                    choice.prepare,
                    operation=operation,
                    max_tokens=max_tokens,
                    headers=headers,
                    caller=caller,
                    streaming=stream,
                )
                calls.append(call)
                choice.render.prompt_ids = list(call.prompt_ids)
                if echo is not None:
                    echo(choice, call)
        except Exception as exc:
            for call in calls:
                await call.close()
            return api_error(exc, where).response()
        renders = [c.render for c in choices]
        reply_headers = {"X-Request-Id": response_id}
        if stream:
            return EventStream(sse_body(calls, renders, fields), calls, headers=reply_headers)
        try:
            await until_done_or_gone(calls, renders, request)
        except Exception as exc:
            return api_error(exc, fields).response()
        return JSONResponse(merged_response(renders), headers=reply_headers)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """One choice per prompt and sample (``CompletionRequest.choices``); ``echo`` begins each with its prompt
        (with ``logprobs``: the prompt's, from the prefill at full depth)."""
        ctx = self.ctx
        prep, served, generation = ctx.prep, ctx.served, ctx.generation
        ctx.check_model(body.model)
        prompts = body.prompts()
        try:
            body.check_choices(len(prompts), ctx.capacity, ctx.share)
            response_id = f"cmpl-{base_id(request, body)}"
        except InvalidRequest as exc:
            return _refused(exc, FIELDS)
        several = len(prompts) > 1
        choices = [
            Choice(
                CompletionRender(
                    response_id,
                    served,
                    prep.tokenizer,
                    include_usage=body.include_usage,
                    continuous_usage=body.continuous_usage,
                    prompt_logprobs=body.prompt_logprobs is not None,
                    logprobs=body.logprobs is not None,
                    index=index,
                    sample=sample,
                ),
                functools.partial(body.to_engine, generation, prompt, sample),
                {**FIELDS, "prompt": f"prompt[{index // body.samples}]"} if several else FIELDS,
                prompt,
            )
            for index, prompt, sample in body.choices()
        ]

        def echo(choice: Choice, call: Ticket) -> None:
            prompt = choice.prompt
            text = prompt if isinstance(prompt, str) else prep.tokenizer.decode(call.prompt_ids)
            choice.render.echo_prompt(text, call.prompt_ids)

        return await self.run(
            request,
            choices,
            stream=body.stream,
            fields=FIELDS,
            operation="text_completion",
            max_tokens=body.requested_max_tokens(),
            echo=echo if body.echo and body.resume is None else None,  # a resumed stream echoed its prompt before
        )

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        """One choice per sample (``n``)."""
        ctx = self.ctx
        prep, served, generation, templates = ctx.prep, ctx.served, ctx.generation, ctx.templates
        ctx.check_model(body.model)
        fields = {**CHAT_FIELDS, "max_tokens": body.max_tokens_field}
        try:
            body.check_choices(capacity=ctx.capacity, share=ctx.share)
            response_id = f"chatcmpl-{base_id(request, body)}"
            tool = body.tool_call()
        except InvalidRequest as exc:
            return _refused(exc, fields)

        def prepare(sample: int) -> tuple[str | list[int], RequestParams]:  # on a worker thread (admit)
            body.refuse_unsupported()
            chat = body.chat_messages()
            check_messages_size([{k: _text(v) for k, v in m.items()} for m in chat])  # before the template renders
            ids = templates.apply(
                chat,
                add_generation_prompt=body.add_generation_prompt,
                template_kwargs=body.chat_template_kwargs,
                tools=body.tools,
            )
            requested = body.requested_max_tokens()
            if requested is None:  # the checkpoint's max_new_tokens, else up to the context limit
                requested = generation.max_new_tokens or max(1, prep.limits.max_total_tokens - len(ids))
            return ids, body.to_params(requested, generation, sample)

        render = functools.partial(ToolCallRender, tool=tool) if tool is not None else ChatRender
        choices = [
            Choice(
                render(
                    response_id,
                    served,
                    prep.tokenizer,
                    include_usage=body.include_usage,
                    continuous_usage=body.continuous_usage,
                    prompt_logprobs=body.prompt_logprobs is not None,
                    logprobs=body.logprobs,
                    index=sample,
                    sample=sample,
                ),
                functools.partial(prepare, sample),
                fields,
            )
            for sample in range(body.samples)
        ]
        max_tokens = body.requested_max_tokens() or prep.limits.max_total_tokens
        return await self.run(
            request, choices, stream=body.stream, fields=fields, operation="chat", max_tokens=max_tokens
        )


def base_id(request: Request, body: CompletionRequest | ChatCompletionRequest) -> str:
    """The request's own id, as vLLM takes it: the ``X-Request-Id`` header, else the body's ``request_id``, else a
    fresh one; the response's id is made of it, and so the engine's request ids and the request log's lines."""
    given = request.headers.get("x-request-id") or body.request_id
    if given is None:
        return uuid.uuid4().hex
    check_request_id(given, replace(REQUEST_BOUNDS, max_request_id_bytes=REQUEST_BOUNDS.max_request_id_bytes // 2))
    return given


def _refused(exc: InvalidRequest, fields: Mapping[str, str]) -> JSONResponse:
    return api_error(exc, fields).response()


def _text(value: Any) -> str:
    """A message's value as the text its size is bounded by (an assistant's ``tool_calls``: their JSON)."""
    return value if isinstance(value, str) else json.dumps(value)
