"""Request validation: token ids of a prompt, or ``InvalidRequest`` naming the field and the limit.

Every field is checked against ``cdb_engine.limits.REQUEST_BOUNDS`` (the ranges the engine and the wire carry, and
the size and count limits, tabled in ``cdb_engine.limits``) before the work it bounds: a text prompt's size before it
is tokenized, chat messages' size before the template renders them (``check_messages_size``), a request id's length
before it is registered (``check_request_id``). A value that passes can neither overflow a field of the stage
protocol nor break a torch op on the engine thread.

Per-request ``exit_threshold`` ranges, per exit rule (the API documents the same): Ouro's gate CDF q in (0, 1]
(1 = full depth; 0 would exit every token at once and is refused), Huginn's latent diff q >= 0 (0 = full depth),
always a finite number.

Importing this module makes the tokenizers raise ``InvalidRequest`` for a caller's bad input (a chat for a model
without a chat template, malformed messages), so that a chat endpoint's errors map like every other request
error.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from cdb_engine.config import RequestParams
from cdb_engine.errors import InvalidRequest
from cdb_engine.limits import REQUEST_BOUNDS, Limits, RequestBounds, build_policy
from cdb_model.kv_layout import KVPolicy
from cdb_model.tokenizer import Tokenizer, use_request_error
from cdb_scheduler.exit_policy import ExitRule

MAX_LOGPROBS = REQUEST_BOUNDS.max_logprobs
MAX_PRIORITY = 2**31 - 1  # a request's priority is an int32 on both APIs
MAX_CACHE_SALT = 1024  # bytes of a request's prefix-cache salt
MAX_BIAS = 100.0  # a logit bias is in [-MAX_BIAS, MAX_BIAS]; -MAX_BIAS bans its token (OpenAI's meaning)

use_request_error(InvalidRequest)


def utf8_size(text: str, field: str) -> int:
    """Bytes of ``text`` in UTF-8; ``InvalidRequest`` for text that is not valid Unicode (a lone surrogate)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRequest(field, "is not valid Unicode (a lone surrogate)") from None


def _longer(text: str, max_bytes: int, field: str) -> bool:
    """``text`` is over ``max_bytes`` in UTF-8 (a longer string is refused before it is encoded)."""
    return len(text) > max_bytes or utf8_size(text, field) > max_bytes


def check_text_size(text: str, field: str, bounds: RequestBounds = REQUEST_BOUNDS) -> None:
    """``InvalidRequest`` naming ``field`` for text over the prompt bound (``max_prompt_bytes``), before it is
    tokenized."""
    if _longer(text, bounds.max_prompt_bytes, field):
        raise InvalidRequest(field, f"longer than {bounds.max_prompt_bytes} bytes")


def check_request_id(request_id: str, bounds: RequestBounds = REQUEST_BOUNDS) -> None:
    """``InvalidRequest`` naming ``request_id`` when it is longer than the bound or not printable ASCII: an id
    travels in gRPC metadata (``cdb-request-id``: printable ASCII only, so another id would fail that send after
    admission) and into log lines (no control character may start a forged line)."""
    if _longer(request_id, bounds.max_request_id_bytes, "request_id"):
        raise InvalidRequest("request_id", f"longer than {bounds.max_request_id_bytes} bytes")
    if not (request_id.isascii() and request_id.isprintable()):
        raise InvalidRequest("request_id", "must be printable ASCII (U+0020 to U+007E)")


def check_messages_size(messages: Sequence[Mapping[str, str]], bounds: RequestBounds = REQUEST_BOUNDS) -> None:
    """Bound chat messages before a template renders them: their number, and their strings' total UTF-8 size
    (``max_prompt_bytes``, the same bound as a text prompt's)."""
    if len(messages) > bounds.max_messages:
        raise InvalidRequest("messages", f"more than {bounds.max_messages} messages")
    total = 0
    for message in messages:
        for value in message.values():
            total += utf8_size(value, "messages")
            if total > bounds.max_prompt_bytes:
                raise InvalidRequest("messages", f"their text exceeds {bounds.max_prompt_bytes} bytes")


def _prompt_ids(limits: Limits, tokenizer: Tokenizer, prompt: str | list[int], bounds: RequestBounds) -> list[int]:
    """The prompt's ids, its size bounded before it is tokenized or scanned."""
    if isinstance(prompt, str):
        if _longer(prompt, bounds.max_prompt_bytes, "prompt"):
            raise InvalidRequest("prompt", f"longer than {bounds.max_prompt_bytes} bytes")
        ids = tokenizer.encode(prompt)
    else:
        ids = prompt
    if not ids:
        raise InvalidRequest("prompt", "must not be empty")
    if len(ids) > limits.max_input_tokens:
        raise InvalidRequest("prompt", f"{len(ids)} tokens exceed max_input_tokens {limits.max_input_tokens}")
    ids = list(ids)
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest("prompt", f"unknown token ids {bad[:5]} (vocabulary size {limits.vocab_size})")
    return ids


def validate(
    limits: Limits,
    tokenizer: Tokenizer,
    prompt: str | list[int],
    params: RequestParams,
    kv_policy: KVPolicy,
    bounds: RequestBounds = REQUEST_BOUNDS,
) -> list[int]:
    """Token ids of ``prompt``, or ``InvalidRequest`` naming the field and the limit."""
    ids = _prompt_ids(limits, tokenizer, prompt, bounds)
    if params.max_tokens < 0:
        raise InvalidRequest("max_tokens", f"must be >= 0 (0: prefill only), got {params.max_tokens}")
    if len(ids) + params.max_tokens > limits.max_total_tokens:
        raise InvalidRequest(
            "max_tokens",
            f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceed max_total_tokens {limits.max_total_tokens}",
        )
    _check_sampling(params, bounds)
    _check_processing(limits, params)
    _check_stops(limits, params, bounds)
    _check_depths(limits, params, kv_policy)
    _check_resume(limits, params, len(ids))
    if not -MAX_PRIORITY <= params.priority <= MAX_PRIORITY:
        raise InvalidRequest("priority", f"must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {params.priority}")
    if params.speculative and limits.no_speculation:
        raise InvalidRequest("speculative", limits.no_speculation)
    if params.structure is not None:
        _check_structured(params)
    if _longer(params.cache_salt, MAX_CACHE_SALT, "cache_salt"):
        raise InvalidRequest("cache_salt", f"longer than {MAX_CACHE_SALT} bytes")
    return ids


def _check_structured(params: RequestParams) -> None:
    """What structured output cannot be combined with: its grammar decides where the output ends, and its walk
    follows only the tokens a request keeps."""
    proc = params.sampling.processing
    if params.ignore_eos:
        raise InvalidRequest("ignore_eos", "cannot be combined with structured output (its grammar ends the output)")
    if proc is not None and proc.min_tokens:
        raise InvalidRequest("min_tokens", "cannot be combined with structured output (its grammar ends the output)")
    if params.speculative:
        raise InvalidRequest("speculative", "a structured-output request does not draft (its grammar walks each token)")


def _check_resume(limits: Limits, params: RequestParams, prompt_len: int) -> None:
    """The resumed tokens of a broken stream, client state to check like a prompt: as many depths as ids, depths in
    range, room left under ``max_tokens``, and a prefill of prompt and resumed ids within ``max_input_tokens`` (they
    are prefilled again); then only ids this request could have generated (``_check_resumed_ids``)."""
    tokens, depths = params.resume_tokens, params.resume_depths
    if not tokens and not depths:
        return
    if len(tokens) != len(depths):
        raise InvalidRequest("resume", f"{len(tokens)} token ids but {len(depths)} depths")
    if len(tokens) >= params.max_tokens:
        raise InvalidRequest(
            "resume", f"{len(tokens)} tokens leave nothing to generate (max_tokens {params.max_tokens})"
        )
    if prompt_len + len(tokens) > limits.max_input_tokens:
        raise InvalidRequest(
            "resume",
            f"prompt ({prompt_len}) + resumed tokens ({len(tokens)}) exceed max_input_tokens {limits.max_input_tokens}"
            " (they are prefilled again)",
        )
    if any(not 1 <= d <= limits.max_depth for d in depths):
        raise InvalidRequest("resume", f"depths must be in [1, {limits.max_depth}]")
    _check_resumed_ids(limits, params)


def _check_resumed_ids(limits: Limits, params: RequestParams) -> None:
    """Resumed ids in the vocabulary and none the request's ``logit_bias`` bans (-100, OpenAI's ban): it could not
    have generated them. Its stop tokens are refused with the scheduler's record (``RequestPreparer.request``), its
    stop strings with the text (``RequestPreparer.output``). Special tokens are not refused: a stream hands out every
    token's id (gRPC ``Token.id``, HTTP ``cdb.token_ids``), whatever its text shows, and a model samples them (a
    prompt may hold them too)."""
    tokens = params.resume_tokens
    bad = [t for t in tokens if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest("resume", f"unknown token ids {bad[:5]} (vocabulary size {limits.vocab_size})")
    proc = params.sampling.processing
    banned = {t for t, b in proc.logit_bias if b <= -MAX_BIAS} if proc is not None else set()
    if hit := [t for t in tokens if t in banned]:
        raise InvalidRequest("resume", f"token ids {hit[:5]} that logit_bias bans (-{MAX_BIAS:g})")


def _check_sampling(params: RequestParams, bounds: RequestBounds) -> None:
    s = params.sampling
    t = s.temperature
    if not math.isfinite(t) or t < 0:
        raise InvalidRequest("temperature", f"must be a finite number >= 0, got {t}")
    if t > bounds.max_temperature or 0 < t < bounds.min_temperature:
        raise InvalidRequest(
            "temperature", f"must be 0 (greedy) or in [{bounds.min_temperature:g}, {bounds.max_temperature:g}], got {t}"
        )
    if not (0.0 < s.top_p <= 1.0):
        raise InvalidRequest("top_p", f"must be in (0, 1], got {s.top_p}")
    if not (0.0 <= s.min_p <= 1.0):
        raise InvalidRequest("min_p", f"must be in [0, 1], got {s.min_p}")
    if s.top_k < 0:
        raise InvalidRequest("top_k", f"must be >= 0, got {s.top_k}")
    if s.top_k > bounds.max_top_k:
        raise InvalidRequest("top_k", f"must be <= {bounds.max_top_k} (0: no filter), got {s.top_k}")
    if not 0 <= s.seed <= bounds.max_seed:
        raise InvalidRequest("seed", f"must be in [0, {bounds.max_seed}], got {s.seed}")
    if not 0 <= s.logprobs <= bounds.max_logprobs:
        raise InvalidRequest("logprobs", f"must be in [0, {bounds.max_logprobs}], got {s.logprobs}")


MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit)


def _check_processing(limits: Limits, params: RequestParams) -> None:
    """Penalties, logit bias and min_tokens, in the ranges OpenAI and vLLM accept."""
    proc = params.sampling.processing
    if proc is None:
        return
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(proc, name)
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise InvalidRequest(name, f"must be in [-2, 2], got {value}")
    r = proc.repetition_penalty
    if not (math.isfinite(r) and 0.0 < r <= 10.0):
        raise InvalidRequest("repetition_penalty", f"must be in (0, 10] (1: off), got {r}")
    if len(proc.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest("logit_bias", f"more than {MAX_LOGIT_BIAS} entries")
    ids = [t for t, _ in proc.logit_bias]
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest("logit_bias", f"unknown token ids {bad[:5]} (vocabulary size {limits.vocab_size})")
    if len(set(ids)) != len(ids):
        raise InvalidRequest("logit_bias", "a token id appears twice")
    if any(not (math.isfinite(b) and -MAX_BIAS <= b <= MAX_BIAS) for _, b in proc.logit_bias):
        raise InvalidRequest("logit_bias", f"biases must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
    if not 0 <= proc.min_tokens <= params.max_tokens:
        raise InvalidRequest("min_tokens", f"must be in [0, max_tokens {params.max_tokens}], got {proc.min_tokens}")


def _check_stops(limits: Limits, params: RequestParams, bounds: RequestBounds) -> None:
    if len(params.stop_token_ids) > bounds.max_stop_token_ids:
        raise InvalidRequest("stop_token_ids", f"more than {bounds.max_stop_token_ids} ids")
    bad_stop = [t for t in params.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad_stop:
        raise InvalidRequest("stop_token_ids", f"unknown token ids {bad_stop[:5]}")
    if len(params.stop_strings) > bounds.max_stop_strings:
        raise InvalidRequest("stop_strings", f"more than {bounds.max_stop_strings} strings")
    for stop in params.stop_strings:
        if not stop:
            raise InvalidRequest("stop_strings", "must not contain an empty string")
        if _longer(stop, bounds.max_stop_string_bytes, "stop_strings"):
            raise InvalidRequest("stop_strings", f"a string is longer than {bounds.max_stop_string_bytes} bytes")


def _check_depths(limits: Limits, params: RequestParams, kv_policy: KVPolicy) -> None:
    if params.exit_threshold is not None:
        if not math.isfinite(params.exit_threshold):
            raise InvalidRequest("exit_threshold", f"must be a finite number, got {params.exit_threshold}")
        if limits.exit_rule in (ExitRule.FIXED, ExitRule.REPLAY):
            raise InvalidRequest("exit_threshold", f"not used by the exit rule '{limits.exit_rule}'")
        if params.replay_depths is not None:
            raise InvalidRequest("exit_threshold", "not used with replay_depths")
        if kv_policy is KVPolicy.DEPTH_INDEXED:
            raise InvalidRequest("exit_threshold", "kv_policy depth_indexed serves full depth only")
        try:
            build_policy(limits, params.exit_threshold)
        except ValueError as exc:
            raise InvalidRequest("exit_threshold", str(exc)) from None
    if limits.exit_rule is ExitRule.REPLAY and params.replay_depths is None:
        raise InvalidRequest("replay_depths", "required by the exit rule 'replay'")
    if params.replay_depths is not None:
        if not limits.replay_allowed:
            raise InvalidRequest("replay_depths", "refused: the server was not started with --allow-replay-depths")
        if not params.replay_depths:
            raise InvalidRequest("replay_depths", "must not be empty")
        if len(params.replay_depths) > limits.max_total_tokens:
            raise InvalidRequest("replay_depths", f"more than max_total_tokens ({limits.max_total_tokens}) values")
        if any(not 1 <= d <= limits.max_depth for d in params.replay_depths):
            raise InvalidRequest("replay_depths", f"depths must be in [1, {limits.max_depth}]")


def schema_spec(value: Any, field: str) -> str:
    """The JSON text of a JSON schema given as an object or a boolean, or as the JSON text of one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequest(field, f"is not valid JSON ({e.msg}, at character {e.pos})") from None
    if not isinstance(value, dict | bool):
        raise InvalidRequest(field, "must be a JSON schema: an object (or true / false), or its JSON text")
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise InvalidRequest(field, "must be a JSON schema without NaN or infinite numbers") from None
