"""The workload's own FLOP ratio S_w: full depth's FLOPs over CDB's on the same tokens, prefill and attention counted.

The paper's bound S = (F0 + r Fr) / (F0 + d Fr) counts one token's parameters only. S_w counts, per request:

- every prompt position: the non-looped blocks and ``r`` loop steps (prefill always runs at full depth), with
  attention over the positions before it; the LM head only for the last position (it samples token 0);
- every later token k >= 1: the non-looped blocks, ``d_k`` loop steps (``r`` under full depth) with attention
  over its context, and the LM head.

FLOPs are 2 per multiply-add: 2 * parameters per token and block, and 4 * context * q_size per attention layer
(scores and the weighted sum). The same tokens are served in both modes, so S_w is what a perfect scheduler would
gain on this workload; the realized fraction is the measured throughput ratio over S_w.
"""

from __future__ import annotations

from collections.abc import Sequence

from cdb_model.config import ModelConfig


def _costs(mc: ModelConfig) -> tuple[float, float, float, int, int]:
    """(non-looped block FLOPs, one loop step's FLOPs, LM head FLOPs, non-looped attention layers, loop layers),
    per token and without attention."""
    f0, fr = mc.param_counts()
    head = mc.vocab_size * mc.hidden_size
    return 2.0 * (f0 - head), 2.0 * fr, 2.0 * head, mc.num_prelude_layers + mc.num_coda_layers, mc.num_loop_layers


def request_flops(mc: ModelConfig, prompt_len: int, depths: Sequence[int], max_depth: int) -> float:
    """FLOPs of one request: ``depths`` are the served depths of its generated tokens 1..n-1 (token 0 comes
    from the prefill)."""
    rest, step, head, l0, lr = _costs(mc)
    attn = 4.0 * mc.q_size
    total = head
    for p in range(prompt_len):
        total += rest + max_depth * step + attn * (p + 1) * (l0 + max_depth * lr)
    for k, d in enumerate(depths, start=1):
        ctx = prompt_len + k  # its input sits at position prompt_len + k - 1
        total += rest + d * step + head + attn * ctx * (l0 + d * lr)
    return total


def workload_flop_ratio(
    mc: ModelConfig, prompt_lens: Sequence[int], depths: Sequence[Sequence[int]], max_depth: int
) -> float:
    """S_w: FLOPs at full depth over FLOPs at the given depths, for the same requests and tokens."""
    full = sum(request_flops(mc, p, [max_depth] * len(ds), max_depth) for p, ds in zip(prompt_lens, depths))
    adaptive = sum(request_flops(mc, p, ds, max_depth) for p, ds in zip(prompt_lens, depths))
    return full / adaptive
