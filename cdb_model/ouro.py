"""Ouro (ByteDance Ouro-1.4B / 2.6B): a fully looped decoder; module names mirror the checkpoint keys."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cdb_model.attention import KVAccess
from cdb_model.base import LoopedLM
from cdb_model.config import ModelConfig
from cdb_model.layers import OuroMLP, RMSNorm, compute_dtype, fuse_linears, half_rotation, rope_cos_sin, rope_split_half
from cdb_scheduler.plan import Stage


class OuroAttention(nn.Module):
    """q/k/v/o without bias, split-half RoPE, GQA (query head i uses kv head i // (heads / kv_heads))."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.q_size, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.kv_size, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.kv_size, bias=False)
        self.o_proj = nn.Linear(c.q_size, c.hidden_size, bias=False)
        self._qkv: Tensor | None = None

    def fuse(self) -> None:
        """Compute q, k and v with one matmul from now on (inference)."""
        self._qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: KVAccess, layer: int) -> Tensor:
        """``cos, sin [N, 1, d]`` from ``half_rotation``."""
        n, h, kvh, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        if self._qkv is None:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        else:
            qkv = F.linear(x, self._qkv)  # [N, (h + 2 kvh) d]
        qk = rope_split_half(qkv[:, : (h + kvh) * d].view(n, h + kvh, d), cos, sin)  # q and k rotate alike
        v = qkv[:, (h + kvh) * d :].view(n, kvh, d)
        out = kv.attend(layer, qk[:, :h], qk[:, h:], v)  # [N, h, d]
        return self.o_proj(out.reshape(n, self.heads * self.head_dim))  # [N, H]


class OuroDecoderLayer(nn.Module):
    """Sandwich layer with four RMSNorms: each sub-block's output is normed BEFORE the residual add."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.self_attn = OuroAttention(c)
        self.mlp = OuroMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.input_layernorm_2 = RMSNorm(c.hidden_size, c.norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.post_attention_layernorm_2 = RMSNorm(c.hidden_size, c.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: KVAccess, layer: int) -> Tensor:
        x = x + self.input_layernorm_2(self.self_attn(self.input_layernorm(x), cos, sin, kv, layer))
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))


class OuroBody(nn.Module):
    """The ``model.*`` namespace of the checkpoint; members of stages not loaded are None."""

    def __init__(self, c: ModelConfig, stages: frozenset[Stage]) -> None:
        super().__init__()
        need_embed = Stage.PRELUDE in stages or Stage.HEAD in stages  # the head embeds refills (embed_input)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if need_embed else None
        self.layers: nn.ModuleList | None = None
        self.norm: RMSNorm | None = None
        self.early_exit_gate: nn.Linear | None = None
        self.lookahead_exit_gate: nn.Linear | None = None
        if Stage.LOOP in stages:
            self.layers = nn.ModuleList(OuroDecoderLayer(c) for _ in range(c.num_loop_layers))
            self.norm = RMSNorm(c.hidden_size, c.norm_eps)
            self.early_exit_gate = nn.Linear(c.hidden_size, 1, bias=True)
            if c.has_lookahead_gate:
                self.lookahead_exit_gate = nn.Linear(c.hidden_size, 1, bias=True)


def _hazard(gate: nn.Linear, h: Tensor) -> Tensor:
    """sigmoid(gate(h)) as float32 ``[N]``; the (tiny) gate runs in float32 (float64 for float64 models)."""
    ct = compute_dtype(h.dtype)
    logit = F.linear(h.to(ct), gate.weight.to(ct), gate.bias.to(ct))  # [N, 1]
    return torch.sigmoid(logit).squeeze(-1).float()


class OuroLM(LoopedLM):
    """Ouro stages: PRELUDE = embedding (no scaling); LOOP = all layers + ``model.norm`` + exit gate(s);
    HEAD = ``lm_head`` on the normed state (the coda is the identity)."""

    def __init__(self, config: ModelConfig, stages: Iterable[Stage] | None = None) -> None:
        super().__init__(config, stages)
        self.model = OuroBody(config, self.stages)
        self.lm_head: nn.Linear | None = None
        if Stage.HEAD in self.stages and not config.tie_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def prelude(self, token_ids: Tensor, positions: Tensor, kv: KVAccess | None, init_seeds: Sequence[int]) -> Tensor:
        self._require(Stage.PRELUDE)
        assert self.model.embed_tokens is not None
        return self.model.embed_tokens(token_ids)  # [N, H]

    def loop_step(
        self, rows: Tensor, positions: Tensor, steps: Tensor, kv: KVAccess
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        self._require(Stage.LOOP)
        m = self.model
        assert m.layers is not None and m.norm is not None and m.early_exit_gate is not None
        c = self.config
        cos, sin = half_rotation(*rope_cos_sin(positions, c.head_dim, c.rope_theta, rows.dtype))  # [N, 1, d]
        h = rows
        for i, layer in enumerate(m.layers):
            h = layer(h, cos, sin, kv, i)
        h = m.norm(h)  # [N, H]: the step output, input of the next step, the gates and the LM head
        lookahead = _hazard(m.lookahead_exit_gate, h) if m.lookahead_exit_gate is not None else None
        return h, _hazard(m.early_exit_gate, h), lookahead

    def gate_logits(self, h: Tensor) -> Tensor:
        """Raw exit-gate output ``[N]`` for normed states ``h [N, H]`` (diagnostics / tests)."""
        self._require(Stage.LOOP)
        assert self.model.early_exit_gate is not None
        return self.model.early_exit_gate(h).squeeze(-1)

    def coda(self, rows: Tensor, positions: Tensor, kv: KVAccess | None) -> Tensor:
        self._require(Stage.HEAD)
        return rows

    def embed_input(self, token_ids: Tensor) -> Tensor:
        self._require(Stage.HEAD)
        assert self.model.embed_tokens is not None
        return self.model.embed_tokens(token_ids)  # [N, H], as the prelude computes it

    def logits(self, hidden: Tensor) -> Tensor:
        self._require(Stage.HEAD)
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        assert self.model.embed_tokens is not None
        return F.linear(hidden, self.model.embed_tokens.weight).float()
