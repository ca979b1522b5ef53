"""``RequestPreparer``: everything a request needs before it reaches a scheduler, built from the configuration alone.

The model's config, its tokenizer and the resolved limits: enough to validate and tokenize a request and to make
its output text, with no engine, scheduler or executor. The engine prepares its own requests with one; a front-end
process builds one to prepare requests for an engine in another process.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.detokenizer import Detokenizer, TextOutput
from cdb_engine.errors import InvalidRequest
from cdb_engine.limits import Limits, resolve_limits
from cdb_engine.validation import validate
from cdb_model.config import ModelConfig
from cdb_model.loader import load_config, load_tokenizer
from cdb_model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class RequestPreparer:
    """Validation, tokenization and output text of requests for one model configuration."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer
    limits: Limits

    @classmethod
    def of(cls, config: EngineConfig) -> RequestPreparer:
        model_config = load_config(config.model)
        return cls(config, model_config, load_tokenizer(config.model), resolve_limits(config, model_config))

    def validate(self, prompt: str | list[int], params: RequestParams) -> list[int]:
        """The prompt's token ids, or ``InvalidRequest`` naming the field and the limit."""
        return validate(self.limits, self.tokenizer, prompt, params, self.config.kv_policy)

    def output(self, params: RequestParams) -> TextOutput:
        """The request's output text; a resumed stream's is primed with the tokens it had delivered, so that the
        text of what follows (an unfinished character, a stop string across the boundary) is what it would have
        been."""
        detok = Detokenizer(self.tokenizer, params.stop_strings)
        for token in params.resume_tokens:
            if detok.push(token)[1]:
                raise InvalidRequest("resume", "the resumed tokens already end at a stop string")
        return TextOutput(detok)
