"""vLLM's request fields, each honoured here or refused: no field a vLLM user sends is silently ignored.

``COMPLETION`` and ``CHAT`` list the fields of vLLM's ``CompletionRequest`` and ``ChatCompletionRequest``
(``vllm/entrypoints/openai/protocol.py``), those of its current release and those its earlier ones took
(``guided_*``, ``best_of``, ``structural_tag``). A field this server's request models declare
(``services.http.schemas``) is honoured; every other one is in ``REFUSED`` with the values that ask for nothing
(vLLM's defaults, and null; for ``guided_decoding_backend``, the names of this server's backend): any other value is
refused 400 naming the field and saying why (``refuse_unhonoured``). ``tests/http/test_vllm_fields.py`` enumerates
both lists against the models and the server. A key that is no vLLM field either is ignored, as OpenAI-compatible
servers do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cdb_engine.errors import InvalidRequest
from services.http.structured import BACKENDS

_OPENAI_COMMON = (
    "model", "frequency_penalty", "logit_bias", "max_tokens", "n", "presence_penalty", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "user",
)  # fmt: skip
_SAMPLING = (
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "best_of",
)  # fmt: skip
_EXTRA = (
    "add_special_tokens", "response_format", "structured_outputs", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern",
)  # fmt: skip
COMPLETION = (*_OPENAI_COMMON, "prompt", "echo", "logprobs", "suffix", *_SAMPLING, "prompt_embeds", *_EXTRA)
CHAT = (
    *_OPENAI_COMMON, "messages", "logprobs", "top_logprobs", "max_completion_tokens", "response_format", "tools",
    "tool_choice", "reasoning_effort", "include_reasoning", "parallel_tool_calls", *_SAMPLING, "bad_words", "echo",
    "add_generation_prompt", "continue_final_message", "documents", "chat_template", "chat_template_kwargs",
    "mm_processor_kwargs", "structural_tag", *_EXTRA,
)  # fmt: skip

REFUSED: Mapping[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1, 1.0), "beam search's length penalty is not supported"),
    "truncate_prompt_tokens": ((), "prompt truncation is not supported: send the tokens to keep"),
    "allowed_token_ids": ((), "not supported (logit_bias can ban tokens)"),
    "bad_words": (([],), "not supported (logit_bias can ban tokens)"),
    "spaces_between_special_tokens": ((True,), "special tokens decode as the tokenizer does: only true"),
    "prompt_embeds": ((), "prompts are text or token ids"),
    "structural_tag": ((), "not supported (response_format, structured_outputs or guided_* constrain the output)"),
    "guided_decoding_backend": (BACKENDS, "only 'auto' or 'guidance' (llguidance, this server's)"),
    "guided_whitespace_pattern": ((), "not supported: JSON whitespace is the grammar's default"),
    "logits_processors": ((), "custom logits processors are not supported"),
    "return_tokens_as_token_ids": ((False,), "not supported: streamed chunks carry cdb.token_ids"),
    "return_token_ids": ((False,), "not supported: streamed chunks carry cdb.token_ids"),
    "kv_transfer_params": ((), "disaggregated prefill is not supported"),
    "vllm_xargs": ((), "not supported"),
    "reasoning_effort": ((), "reasoning models are not served here"),
    "include_reasoning": ((True,), "reasoning models are not served here"),
    "continue_final_message": ((False,), "not supported (send the assistant's text as a completion prompt)"),
    "documents": ((), "not supported"),
    "chat_template": ((), "a per-request chat template is not accepted (the server's --chat-template)"),
    "mm_processor_kwargs": ((), "multimodal input is not supported"),
    "echo": ((False,), "a chat does not echo its messages (only false)"),
    "best_of": ((1,), "only best_of=1 is supported"),
    "add_special_tokens": ((), "the tokenizer's own configuration decides (omit it)"),
}


def refuse_unhonoured(extra: Mapping[str, Any] | None) -> None:
    """``InvalidRequest`` naming the first vLLM field among a body's undeclared keys (``extra``) that asks for
    something not done here (``REFUSED``)."""
    for name, value in (extra or {}).items():
        refused = REFUSED.get(name)
        if refused is None:
            continue
        neutral, why = refused
        if value is not None and not any(value == v and type(value) is type(v) for v in neutral):
            raise InvalidRequest(name, why)
