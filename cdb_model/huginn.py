"""Huginn (huginn-0125, "Raven"): prelude blocks, a recurrent core, coda blocks; names mirror the checkpoint.

Bank row = ``[state s | injection e]``, both ``n_embd`` wide.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cdb_model.attention import KVAccess
from cdb_model.base import LoopedLM, init_states
from cdb_model.config import ModelConfig
from cdb_model.layers import HuginnMLP, RMSNorm, compute_dtype, pair_rotation, rope_cos_sin, rope_interleaved
from cdb_scheduler.plan import Stage


class HuginnAttention(nn.Module):
    """Fused ``Wqkv`` (rows q | k | v), ``qk_bias [2, 1, h, d]`` added BEFORE the interleaved RoPE, ``proj``."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = c.num_heads, c.head_dim
        self.Wqkv = nn.Linear(c.hidden_size, 3 * c.q_size, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, c.num_heads, c.head_dim))
        self.proj = nn.Linear(c.q_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: KVAccess, layer: int) -> Tensor:
        """``cos, sin [N, 1, d]`` from ``pair_rotation``."""
        n, h, d = x.shape[0], self.heads, self.head_dim
        qkv = self.Wqkv(x).view(n, 3, h, d)
        qk = (qkv[:, :2] + self.qk_bias[:, 0]).view(n, 2 * h, d)  # the bias BEFORE the rotation; q and k alike
        qk = rope_interleaved(qk, cos, sin)
        out = kv.attend(layer, qk[:, :h], qk[:, h:], qkv[:, 2])  # [N, h, d]
        return self.proj(out.reshape(n, self.heads * self.head_dim))  # [N, H]


class HuginnBlock(nn.Module):
    """Sandwich block, the residual SUM is normed: ``x = norm_2(attn(norm_1(x)) + x)``, same for the MLP."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.norm_1 = RMSNorm(c.hidden_size, c.norm_eps)
        self.attn = HuginnAttention(c)
        self.norm_2 = RMSNorm(c.hidden_size, c.norm_eps)
        self.norm_3 = RMSNorm(c.hidden_size, c.norm_eps)
        self.mlp = HuginnMLP(c.hidden_size, c.intermediate_size)
        self.norm_4 = RMSNorm(c.hidden_size, c.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: KVAccess, layer: int) -> Tensor:
        x = self.norm_2(self.attn(self.norm_1(x), cos, sin, kv, layer) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)


class HuginnTransformer(nn.Module):
    """The ``transformer.*`` namespace of the checkpoint; members of stages not loaded are None."""

    def __init__(self, c: ModelConfig, stages: frozenset[Stage]) -> None:
        super().__init__()
        head, pre, loop = Stage.HEAD in stages, Stage.PRELUDE in stages, Stage.LOOP in stages

        def blocks(n: int) -> nn.ModuleList:
            return nn.ModuleList(HuginnBlock(c) for _ in range(n))

        need_wte = pre or (head and c.tie_embeddings)
        self.wte = nn.Embedding(c.vocab_size, c.hidden_size) if need_wte else None
        self.prelude = blocks(c.num_prelude_layers) if pre else None
        self.adapter = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False) if loop else None
        self.core_block = blocks(c.num_loop_layers) if loop else None
        self.coda = blocks(c.num_coda_layers) if head else None
        self.ln_f = RMSNorm(c.hidden_size, c.norm_eps) if head else None


class HuginnLM(LoopedLM):
    """Huginn stages: PRELUDE = wte * sqrt(n_embd) + prelude blocks (+ initial state); LOOP = adapter + core
    blocks; HEAD = ln_f, coda blocks, ln_f, tied LM head."""

    def __init__(self, config: ModelConfig, stages: Iterable[Stage] | None = None) -> None:
        super().__init__(config, stages)
        self.transformer = HuginnTransformer(config, self.stages)
        self.lm_head: nn.Linear | None = None
        if Stage.HEAD in self.stages and not config.tie_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        c = self.config
        return pair_rotation(*rope_cos_sin(positions, c.head_dim, c.rope_theta, dtype))  # [N, 1, d] each

    def embed(self, token_ids: Tensor) -> Tensor:
        """``wte(ids) * sqrt(n_embd)`` ``[N, H]``: the input of the prelude blocks."""
        self._require(Stage.PRELUDE)
        assert self.transformer.wte is not None
        return self.transformer.wte(token_ids) * math.sqrt(self.config.hidden_size)

    def prelude(self, token_ids: Tensor, positions: Tensor, kv: KVAccess | None, init_seeds: Sequence[int]) -> Tensor:
        t = self.transformer
        x = self.embed(token_ids)  # [N, H]
        assert t.prelude is not None
        if len(t.prelude):
            if kv is None:
                raise ValueError("the Huginn prelude blocks need a KVAccess")
            cos, sin = self._rope(positions, x.dtype)
            for i, block in enumerate(t.prelude):
                x = block(x, cos, sin, kv, i)
        s0 = init_states(init_seeds, self.config.hidden_size, x.dtype, x.device)  # [N, H]
        return torch.cat([s0, x], dim=-1)  # [N, 2H] = [state | injection]

    def loop_step(
        self, rows: Tensor, positions: Tensor, steps: Tensor, kv: KVAccess
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        self._require(Stage.LOOP)
        t = self.transformer
        assert t.adapter is not None and t.core_block is not None
        width = self.config.hidden_size
        s_old, e = rows[:, :width], rows[:, width:]  # [N, H] each
        cos, sin = self._rope(positions, rows.dtype)
        x = t.adapter(rows)  # adapter(concat[s, e]): the row already is [s | e]; [N, H]
        for i, block in enumerate(t.core_block):
            x = block(x, cos, sin, kv, i)
        ct = compute_dtype(x.dtype)
        signal = (x.to(ct) - s_old.to(ct)).norm(dim=-1) / x.to(ct).norm(dim=-1)  # [N] relative latent diff
        return torch.cat([x, e], dim=-1), signal.float(), None

    def latent(self, rows: Tensor) -> Tensor:
        """``ln_f(s)`` ``[N, H]`` of bank rows (upstream ``latent_states``)."""
        self._require(Stage.HEAD)
        assert self.transformer.ln_f is not None
        return self.transformer.ln_f(rows[:, : self.config.hidden_size])

    def coda(self, rows: Tensor, positions: Tensor, kv: KVAccess | None) -> Tensor:
        t = self.transformer
        x = self.latent(rows)  # [N, H]
        assert t.coda is not None and t.ln_f is not None
        if len(t.coda):
            if kv is None:
                raise ValueError("the Huginn coda blocks need a KVAccess")
            cos, sin = self._rope(positions, x.dtype)
            for i, block in enumerate(t.coda):
                x = block(x, cos, sin, kv, i)
        return t.ln_f(x)

    def logits(self, hidden: Tensor) -> Tensor:
        self._require(Stage.HEAD)
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        assert self.transformer.wte is not None
        return F.linear(hidden, self.transformer.wte.weight).float()
