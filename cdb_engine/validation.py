"""Request validation: token ids of a prompt, or ``InvalidRequest`` naming the field and the limit.

Per-request ``exit_threshold`` ranges, per exit rule (the API documents the same): Ouro's gate CDF q in (0, 1]
(1 = full depth; 0 would exit every token at once and is refused), Huginn's latent diff q >= 0 (0 = full depth),
always a finite number.

Importing this module makes the tokenizers raise ``InvalidRequest`` for a caller's bad input (a chat for a model
without a chat template, malformed messages), so that a chat endpoint's errors map like every other request
error.
"""

from __future__ import annotations

import math

from cdb_engine.config import RequestParams
from cdb_engine.errors import InvalidRequest
from cdb_engine.limits import Limits, build_policy
from cdb_model.kv import KVPolicy
from cdb_model.tokenizer import Tokenizer, use_request_error
from cdb_scheduler.exit_policy import ExitRule

MAX_LOGPROBS = 20

use_request_error(InvalidRequest)


def validate(
    limits: Limits, tokenizer: Tokenizer, prompt: str | list[int], params: RequestParams, kv_policy: KVPolicy
) -> list[int]:
    """Token ids of ``prompt``, or ``InvalidRequest`` naming the field and the limit."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise InvalidRequest("prompt", "must not be empty")
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest("prompt", f"unknown token ids {bad[:5]} (vocabulary size {limits.vocab_size})")
    if len(ids) > limits.max_input_tokens:
        raise InvalidRequest("prompt", f"{len(ids)} tokens exceed max_input_tokens {limits.max_input_tokens}")
    if params.max_tokens < 1:
        raise InvalidRequest("max_tokens", f"must be >= 1, got {params.max_tokens}")
    if len(ids) + params.max_tokens > limits.max_total_tokens:
        raise InvalidRequest(
            "max_tokens",
            f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceed max_total_tokens {limits.max_total_tokens}",
        )
    s = params.sampling
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise InvalidRequest("temperature", f"must be a finite number >= 0, got {s.temperature}")
    if not (0.0 < s.top_p <= 1.0):
        raise InvalidRequest("top_p", f"must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise InvalidRequest("top_k", f"must be >= 0, got {s.top_k}")
    if not 0 <= s.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {s.logprobs}")
    bad_stop = [t for t in params.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad_stop:
        raise InvalidRequest("stop_token_ids", f"unknown token ids {bad_stop[:5]}")
    if any(not s for s in params.stop_strings):
        raise InvalidRequest("stop_strings", "must not contain an empty string")
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
        if any(not 1 <= d <= limits.max_depth for d in params.replay_depths):
            raise InvalidRequest("replay_depths", f"depths must be in [1, {limits.max_depth}]")
    return ids
