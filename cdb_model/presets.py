"""Built-in models that need no files: seeded random weights, byte tokenizer (vocab >= 259).

| preset | use | max_depth | default threshold (``early_exit_threshold``) |
|---|---|---|---|
| ``ouro-tiny`` | tests, demo | 4 | q = 0.5 |
| ``huginn-tiny`` | tests, demo | 8 | latent diff 0.2 |
| ``ouro-bench`` | benchmarks: F0/Fr ~ 0.08 like Ouro-1.4B | 4 | q = 0.5 |
| ``huginn-bench`` | benchmarks: F0/Fr ~ 1.18 like huginn-0125 | 16 | latent diff 0.1 |

Exit signals are shaped so that depths vary across tokens (measured on sampled byte text, decode tokens):
- Ouro: the gate weight is N(0, (gain / sqrt(H))^2) with a fixed bias, so per-token hazards spread roughly
  0.05 - 0.8 (10th - 90th percentile); at q = 0.5 ouro-tiny exits after 1/2/3/4 steps about 28/25/17/22 % of
  the time (ouro-bench about 45/11/11/25 %).
- Huginn: the state half of the adapter is scaled down (gain < 1), making the recurrence contractive; the
  relative latent difference decays at token-dependent rates. huginn-tiny at 0.2 exits at depths 4..8 (mostly
  5-7); huginn-bench at 0.1 at depths 10..16.
The presets have no Ouro lookahead gate.

Weights are drawn per tensor from a generator seeded by (preset, tensor name), so a model built for a subset of
stages holds exactly the same values as the full one. ``cdb bench step`` prints F0, Fr and the time of one loop
step over 32 decode tokens.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from cdb_model.config import ModelConfig
from cdb_scheduler.plan import Stage

if TYPE_CHECKING:  # (torch is imported where a model is built: the presets' configs are read without it)
    import torch

    from cdb_model.base import LoopedLM


def _ouro(**kw: Any) -> ModelConfig:
    return ModelConfig(
        arch="ouro",
        num_prelude_layers=0,
        num_coda_layers=0,
        rope_theta=1e6,
        norm_eps=1e-6,
        max_positions=4096,
        tie_embeddings=False,
        stop_token_ids=(0, 2),
        early_exit_threshold=0.5,
        **kw,
    )


def _huginn(**kw: Any) -> ModelConfig:
    return ModelConfig(
        arch="huginn",
        rope_theta=50000.0,
        norm_eps=1e-6,
        max_positions=4096,
        tie_embeddings=True,
        stop_token_ids=(0, 2),
        **kw,
    )


_PRESETS: dict[str, ModelConfig] = {
    "ouro-tiny": _ouro(
        name="ouro-tiny",
        vocab_size=512,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        num_loop_layers=2,
        max_depth=4,
    ),
    "huginn-tiny": _huginn(
        name="huginn-tiny",
        vocab_size=512,
        hidden_size=96,
        num_heads=4,
        num_kv_heads=4,
        head_dim=24,
        intermediate_size=192,
        num_prelude_layers=1,
        num_loop_layers=2,
        num_coda_layers=1,
        max_depth=8,
        early_exit_threshold=0.2,
    ),
    "ouro-bench": _ouro(
        name="ouro-bench",
        vocab_size=1024,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=8,
        head_dim=32,
        intermediate_size=704,
        num_loop_layers=4,
        max_depth=4,
    ),
    "huginn-bench": _huginn(
        name="huginn-bench",
        vocab_size=3328,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=8,
        head_dim=32,
        intermediate_size=896,
        num_prelude_layers=2,
        num_loop_layers=4,
        num_coda_layers=2,
        max_depth=16,
        early_exit_threshold=0.1,
    ),
}

# Exit-signal shaping (see the module docstring): Ouro gate logit std / mean, Huginn adapter state gain.
_OURO_GATE = {"ouro-tiny": (2.5, -0.5), "ouro-bench": (2.5, 1.3)}  # (logit std gain, bias)
_HUGINN_STATE_GAIN = {"huginn-tiny": 0.55, "huginn-bench": 0.6}


def preset_names() -> list[str]:
    return list(_PRESETS)


def preset_config(name: str) -> ModelConfig:
    try:
        return _PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r} (presets: {', '.join(_PRESETS)})") from None


def init_tensor(preset: str, name: str, shape: tuple[int, ...], c: ModelConfig) -> torch.Tensor:
    """Deterministic float32 values of one tensor."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{preset}/{name}".encode()))

    def normal(std: float, *size: int) -> torch.Tensor:
        return torch.randn(size or shape, generator=g) * std

    leaf = name.rsplit(".", 2)[-2]
    if leaf.startswith(("norm", "ln_f", "input_layernorm", "post_attention_layernorm")):
        return 1.0 + normal(0.1)
    if leaf == "embed_tokens":
        return normal(1.0)
    if leaf == "wte":
        return normal(c.hidden_size**-0.5)
    if name.endswith("qk_bias"):
        return normal(0.5)
    if leaf.endswith("exit_gate"):
        gain, bias = _OURO_GATE[preset]
        return torch.full(shape, bias) if name.endswith("bias") else normal(gain * c.hidden_size**-0.5)
    if leaf == "adapter":  # [H, 2H]: contractive in the state, full gain on the injection
        h = c.hidden_size
        return torch.cat([normal(_HUGINN_STATE_GAIN[preset] * h**-0.5, h, h), normal(h**-0.5, h, h)], dim=1)
    return normal(shape[-1] ** -0.5)  # Linear weights: N(0, 1 / fan_in)


def build_preset(
    name: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    stages: Iterable[Stage] | None = None,
) -> LoopedLM:
    """A preset model holding only ``stages`` (None: all), in ``dtype`` (None: float32)."""
    import torch

    from cdb_model.models import build_empty

    dtype = torch.float32 if dtype is None else dtype
    c = preset_config(name)
    model = build_empty(c, stages)
    sd = {
        k: init_tensor(name, k, tuple(t.shape), c).to(device=device, dtype=dtype) for k, t in model.state_dict().items()
    }
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval().requires_grad_(False)
