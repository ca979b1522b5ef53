"""The released configurations of Ouro-1.4B and Huginn-0125 (``config.json`` as published), in one place.

Random-weight checkpoints in the released layouts (``cdb_bench.random_checkpoint``), the synthetic stages' cost
profiles (``cdb_engine.synthetic``) and the layout tests read them here.
"""

from __future__ import annotations

from typing import Any

OURO_14B: dict[str, Any] = {
    "model_type": "ouro",
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "intermediate_size": 5632,
    "vocab_size": 49152,
    "max_position_embeddings": 65536,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "total_ut_steps": 4,
    "early_exit_threshold": 1.0,
    "eos_token_id": 0,
}
HUGINN_0125: dict[str, Any] = {
    "model_type": "huginn_raven",
    "n_embd": 5280,
    "n_heads": 55,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4,
    "n_layers_in_coda": 2,
    "intermediate_size": 17920,
    "vocab_size": 65536,
    "padded_vocab_size": 65536,
    "block_size": 4096,
    "rope_base": 50000,
    "norm_eps": 1e-6,
    "qk_bias": True,
    "tie_embeddings": True,
    "mean_recurrence": 32,
}
