"""``RequestPreparer``: everything a request needs before it reaches a scheduler, built from the configuration alone.

The model's config, its tokenizer and the resolved limits: enough to validate and tokenize a request, build its
scheduler record and make its output text, with no engine, scheduler or executor. The engine prepares its own
requests with one; a front-end process builds one to prepare requests for an engine in another process.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.detokenizer import TextOutput
from cdb_engine.errors import InvalidRequest
from cdb_engine.grammar import Grammars
from cdb_engine.limits import Limits, build_policy, priority_policy, resolve_limits
from cdb_engine.validation import validate
from cdb_model.config import ModelConfig
from cdb_model.kv_layout import KVPolicy
from cdb_model.loader import load_config, load_tokenizer
from cdb_model.tokenizer import Tokenizer
from cdb_scheduler.prefix_cache import prefix_hashes
from cdb_scheduler.request import Request
from cdb_scheduler.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestPreparer:
    """Validation, tokenization and output text of requests for one model configuration."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer
    limits: Limits
    grammars: Grammars
    prefix_salt: bytes = b""  # prefix caching: what a prompt block's KV depends on besides its tokens (b"": off)

    @classmethod
    def of(cls, config: EngineConfig) -> RequestPreparer:
        model_config = load_config(config.model)
        tokenizer = load_tokenizer(config.model, config.tokenizer)
        stops = model_config.stop_token_ids
        # (a forced token's position exits early: not under a KV policy that needs every token at full depth)
        skip = config.forced_skip and config.kv_policy is not KVPolicy.DEPTH_INDEXED
        grammars = Grammars(tokenizer, model_config.vocab_size, stops, skip)
        limits = resolve_limits(config, model_config)
        salt = prefix_salt(config, limits.max_depth) if config.enable_prefix_caching else b""
        return cls(config, model_config, tokenizer, limits, grammars, salt)

    def validate(self, prompt: str | list[int], params: RequestParams) -> list[int]:
        """The prompt's token ids, or ``InvalidRequest`` naming the field and the limit (a structure that does not
        compile too: compiled here once, cached for the request's guide)."""
        ids = validate(self.limits, self.tokenizer, prompt, params, self.config.kv_policy)
        if params.structure is not None:
            self.grammars.check(params.structure)
        return ids

    def output(self, params: RequestParams) -> TextOutput:
        """The request's output text; a resumed stream's is primed with the tokens it had delivered, so that the
        text of what follows (an unfinished character, a stop string across the boundary) is what it would have
        been."""
        out = TextOutput(self.tokenizer, params.stop_strings, params.skip_special_tokens, params.include_stop_str)
        for token in params.resume_tokens:
            if out.push(token)[1]:
                raise InvalidRequest("resume", "the resumed tokens already end at a stop string")
        return out

    async def output_async(self, params: RequestParams) -> TextOutput:
        """``output(params)`` for a caller on an event loop: a resumed stream's priming (a decode of every resumed
        id, up to ``max_input_tokens`` of them) runs on a worker thread; without resumed ids, here (no thread
        hop)."""
        if params.resume_tokens:
            return await asyncio.to_thread(self.output, params)
        return self.output(params)

    def request(self, rid: int, prompt_ids: Sequence[int], params: RequestParams) -> Request:
        """The scheduler's record of a validated request under the engine's id ``rid``."""
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.model_config.stop_token_ids)
        if any(t in stop for t in params.resume_tokens):
            raise InvalidRequest("resume", "the resumed tokens already end at a stop token")
        req = Request(
            rid=rid,
            prompt=list(prompt_ids),
            max_tokens=params.max_tokens,
            policy=build_policy(self.limits, params.exit_threshold, replay=params.replay_depths is not None),
            sampling=_with_stop_ids(params.sampling, stop),
            stop_token_ids=frozenset(stop),
            init_seed=self.config.init_seed,
            replay_depths=list(params.replay_depths) if params.replay_depths is not None else None,
            score_prompt=params.prompt_logprobs,
            speculate=params.speculative,
            arrival=time.monotonic(),
            priority=params.priority,
        )
        if self.config.priority_depth is not None and params.replay_depths is None:
            shallow = priority_policy(self.limits, self.config.priority_depth, params.exit_threshold)
            req.depth_policies = (req.policy, shallow) if shallow is not None else None
        if params.structure is not None:
            req.guide = guide = self.grammars.guide(params.structure)
            if not guide.accept_all(params.resume_tokens):
                raise InvalidRequest("resume", f"the resumed tokens do not follow the structure: {guide.error}")
        if params.resume_tokens:  # recomputed at their depths and not reported again, as after a preemption
            req.output, req.depths = list(params.resume_tokens), list(params.resume_depths)
            req.loop_steps = sum(params.resume_depths)
        if self.prefix_salt:
            salt = self.prefix_salt
            if params.cache_salt:  # a tenant's own cache: its hashes match no other salt's
                salt = hashlib.blake2b(salt + params.cache_salt.encode(), digest_size=16).digest()
            req.prefix_hashes = prefix_hashes(salt, req.prompt, self.config.kv_block_size)
        return req


def prefix_salt(config: EngineConfig, max_depth: int) -> bytes:
    """What a prompt block's KV depends on besides the tokens (``cdb_scheduler.prefix_cache``): the model and its
    dtype, the KV policy and its shared slots, the depth, Huginn's initial-state seed, and the chunking and block
    size (a prompt's prefill runs at full depth: exit rules and thresholds play no part)."""
    c = config
    key: tuple[object, ...] = ("cdb prefix v1", c.model, c.tokenizer, str(c.dtype), str(c.kv_policy), max_depth)
    key += (c.kv_shared_after, c.init_seed, c.prefill_chunk_size, c.kv_block_size, c.synthetic_cost, c.synthetic_depths)
    return hashlib.blake2b(repr(key).encode(), digest_size=16).digest()


def _with_stop_ids(sampling: SamplingParams, stop: set[int]) -> SamplingParams:
    """``min_tokens`` bans the request's stop ids (its own and, unless ``ignore_eos``, the model's) until then."""
    proc = sampling.processing
    if proc is None or proc.min_tokens <= 0:
        return sampling
    return replace(sampling, processing=replace(proc, stop_ids=tuple(sorted(stop))))
