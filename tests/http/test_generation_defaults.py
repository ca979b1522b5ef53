"""What a request leaves unset comes from the checkpoint's ``generation_config.json`` when it says how to sample
(as ``transformers`` samples), else from OpenAI's defaults; a chat without a length takes its ``max_new_tokens``."""

from __future__ import annotations

from cdb_model.generation import HF_DEFAULT_TOP_K, GenerationDefaults
from cdb_model.loader import load_generation_defaults
from services.http.schemas import ChatCompletionRequest, CompletionRequest, says_sampling

SAMPLES = GenerationDefaults(eos_token_ids=(0,), do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=64)


def test_unset_sampling_fields_take_the_checkpoints_values() -> None:
    _, params = CompletionRequest(prompt="x").to_engine(SAMPLES)
    s = params.sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.8, 0.95, HF_DEFAULT_TOP_K)
    _, params = CompletionRequest(prompt="x", temperature=0.0, top_p=0.5).to_engine(SAMPLES)  # the caller's win
    assert (params.sampling.temperature, params.sampling.top_p) == (0.0, 0.5)


def test_a_greedy_checkpoint_decodes_greedily_and_none_means_openais_defaults() -> None:
    greedy = GenerationDefaults(do_sample=False, temperature=0.7)
    assert CompletionRequest(prompt="x").to_engine(greedy)[1].sampling.temperature == 0.0
    eos_only = GenerationDefaults(eos_token_ids=(0, 2))  # says nothing about sampling
    assert not says_sampling(eos_only)
    for defaults in (eos_only, None):
        s = CompletionRequest(prompt="x").to_engine(defaults)[1].sampling
        assert (s.temperature, s.top_p, s.top_k) == (1.0, 1.0, 0)


def test_the_shipped_models_generation_config_is_read() -> None:
    shipped = load_generation_defaults("ouro-kjv")
    assert says_sampling(shipped) and shipped.max_new_tokens is not None
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert chat.to_params(shipped.max_new_tokens, shipped).sampling.temperature == shipped.temperature
