"""The trained model: ``cdb_model.ouro.OuroLM`` over whole sequences, its initialisation, its config and files.

The training forward calls the serving stage methods (``prelude``, ``loop_step``, ``logits``) on all tokens of a
batch at once; ``CausalBatchKV`` gives every token causal attention over its own sequence at the same loop step
(the depth-indexed cache as trained, every token at full depth).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor

from cdb_model.config import ModelConfig
from cdb_model.ouro import OuroLM


class CausalBatchKV:
    """``KVAccess`` for ``batch`` sequences of ``length`` tokens, token-major (row ``b * length + t``)."""

    def __init__(self, batch: int, length: int) -> None:
        self.batch, self.length = batch, length

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, t, h, d = self.batch, self.length, q.shape[1], q.shape[2]
        q4 = q.view(b, t, h, d).transpose(1, 2)  # [B, h, T, d]
        k4 = k.view(b, t, -1, d).transpose(1, 2)  # [B, kvh, T, d]
        v4 = v.view(b, t, -1, d).transpose(1, 2)
        if k4.shape[1] != h:
            k4 = k4.repeat_interleave(h // k4.shape[1], dim=1)  # query head i uses kv head i // rep
            v4 = v4.repeat_interleave(h // v4.shape[1], dim=1)
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=1.0 / math.sqrt(d))
        return out.transpose(1, 2).reshape(b * t, h, d)  # [N, h, d]


@dataclass
class LoopOutput:
    """Per loop step ``t``: normed states ``[N, H]``, gate logits ``[N]``, lookahead hazards ``[N]`` (or None)."""

    states: list[Tensor]
    gate_logits: Tensor  # [R, N]
    lookahead: Tensor | None  # [R, N]


def loop_forward(model: OuroLM, ids: Tensor, depth: int | None = None) -> LoopOutput:
    """Run ``depth`` (default: the trained depth) loop steps over ``ids [B, T]`` (teacher forcing)."""
    b, t = ids.shape
    positions = torch.arange(t, device=ids.device).repeat(b)  # [N]
    kv = CausalBatchKV(b, t)
    rows = model.prelude(ids.reshape(-1), positions, None, [])  # [N, H]
    steps = torch.zeros_like(positions)
    states, logits, looks = [], [], []
    for s in range(depth or model.config.max_depth):
        rows, _, look = model.loop_step(rows, positions, steps + s, kv)
        states.append(rows)
        logits.append(model.gate_logits(rows))
        if look is not None:
            looks.append(look)
    return LoopOutput(states, torch.stack(logits), torch.stack(looks) if looks else None)


def exit_log_pdf(gate_logits: Tensor) -> Tensor:
    """log p_t from gate logits ``[R, ...]``: p_t = lambda_t * prod_{j<t}(1 - lambda_j) for t < R - 1, the last
    step taking the remaining mass (lambda = sigmoid(logit)); computed in log space."""
    log_h = F.logsigmoid(gate_logits)  # log lambda_t
    log_s = F.logsigmoid(-gate_logits)  # log (1 - lambda_t)
    before = torch.cumsum(log_s, dim=0) - log_s  # sum_{j<t} log(1 - lambda_j)
    return torch.cat([(log_h + before)[:-1], before[-1:]], dim=0)


def hf_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_depth: int = 4,
    max_positions: int = 2048,
    rope_theta: float = 10000.0,
    early_exit_threshold: float = 0.5,
) -> dict[str, Any]:
    """``config.json`` in the released Ouro field names (what ``ModelConfig.from_hf`` parses)."""
    return {
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "total_ut_steps": max_depth,
        "early_exit_threshold": early_exit_threshold,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def build(config: ModelConfig, seed: int, gate_bias: float = -2.0) -> OuroLM:
    """A freshly initialised model: embedding N(0, 1) (Ouro does not scale it), linear weights N(0, 0.02^2),
    norms 1, exit gate weight 0 and bias ``gate_bias`` (-2: hazard 0.12 at every step, exit mass
    0.12 / 0.10 / 0.09 / 0.69, so that the deep steps get most of the gradient at first)."""
    torch.manual_seed(seed)
    model = OuroLM(config)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("exit_gate.weight"):
                p.zero_()
            elif name.endswith("exit_gate.bias"):
                p.fill_(gate_bias)
            elif "norm" in name:
                p.fill_(1.0)
            elif name == "model.embed_tokens.weight":
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.02)
    return model


def save_weights(model: OuroLM, path: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_config_files(folder: Path, config: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {
        "bos_token_id": 0,
        "eos_token_id": [0, 2],
        "pad_token_id": 0,
        "do_sample": True,
        "temperature": 0.8,
        "top_p": 0.95,
        "max_new_tokens": 64,
    }
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
