"""The sequential reference path: one request, one token at a time, dense per-request KV.

This is the oracle of every equivalence test of the batched engine, so it is kept deliberately simple. The
semantics the engine must reproduce exactly:

- The prompt is processed in chunks of ``prefill_chunk_size`` tokens (None: one chunk) at FULL depth
  (``policy.max_depth`` steps, every depth slot written). The first generated token is sampled from the last
  prompt position after the coda, with token_index 0, and its recorded depth is ``policy.max_depth``.
- Token ``i >= 1`` (the previous token, at position ``p = len(prompt) + i - 1``) runs the prelude, then loop steps
  ``s = 0, 1, ...`` until the exit policy says stop (one-ahead: decision for step s taken before running it;
  same-step: after observing its signal), then the coda, LM head and ``sample`` with token_index i.
  Under ``last_exited``, an exit after step e copies slot e into the deeper slots of position p.
- Huginn initial state of position p: seed ``derive_seed(init_seed, p)`` if ``init_seed >= 0`` else zeros
  (prompt positions too).
- Generation stops after a stop id (included in the output) or ``max_new_tokens`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cdb_model.attention import DenseKVCache
from cdb_model.base import LoopedLM
from cdb_model.kv import KVLayout
from cdb_model.sampling import sample
from cdb_scheduler.exit_policy import ExitPolicy, Horizon, ReplayDepth
from cdb_scheduler.plan import derive_seed
from cdb_scheduler.sampling import Guide, SamplingParams


@dataclass
class ReferenceOutput:
    tokens: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # loop steps each generated token ran


class _Request:
    """One request's dense KV caches and stage calls."""

    def __init__(self, model: LoopedLM, layout: KVLayout, init_seed: int) -> None:
        self.model, self.layout, self.init_seed = model, layout, init_seed
        self.prelude_kv, self.loop_kv, self.coda_kv = DenseKVCache(), DenseKVCache(), DenseKVCache()

    def _t(self, xs: Sequence[int]) -> Tensor:
        return torch.tensor(list(xs), dtype=torch.long, device=self.model.device)

    def prelude(self, token_ids: Sequence[int], positions: Sequence[int]) -> Tensor:
        seeds = [derive_seed(self.init_seed, p) if self.init_seed >= 0 else -1 for p in positions]
        kv = self.prelude_kv.access(positions, 0)
        return self.model.prelude(self._t(token_ids), self._t(positions), kv, seeds)  # [T, W]

    def step(self, rows: Tensor, positions: Sequence[int], step: int) -> tuple[Tensor, float, float | None]:
        """One loop step of all ``rows``; signal / lookahead of the LAST row."""
        kv = self.loop_kv.access(positions, self.layout.slot(step))
        steps = self._t([step] * len(positions))
        rows, signal, lookahead = self.model.loop_step(rows, self._t(positions), steps, kv)
        return rows, float(signal[-1]), None if lookahead is None else float(lookahead[-1])

    def coda(self, rows: Tensor, positions: Sequence[int]) -> Tensor:
        """Coda over all rows (Huginn: writes their coda KV) -> final hidden ``[T, H]``."""
        return self.model.coda(rows, self._t(positions), self.coda_kv.access(positions, 0))

    def sample_last(
        self,
        hidden: Tensor,
        params: SamplingParams,
        token_index: int,
        prompt: Sequence[int],
        output: Sequence[int],
        mask: bytes = b"",
    ) -> int:
        tokens, _ = sample(self.model.logits(hidden[-1:]), [params], [token_index], [(prompt, output)], [mask])
        return tokens[0]


def reference_generate(
    model: LoopedLM,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    policy: ExitPolicy,
    kv_layout: KVLayout,
    sampling: SamplingParams = SamplingParams(),  # noqa: B008 - frozen dataclass
    stop_token_ids: Sequence[int] = (),
    prefill_chunk_size: int | None = None,
    init_seed: int = -1,
    replay_depths: Sequence[int] | None = None,
    guide: Guide | None = None,
) -> ReferenceOutput:
    """Generate up to ``max_new_tokens`` tokens for one prompt, sequentially (see the module docstring). ``guide``:
    structured output, each token sampled under its mask (a guide without forced skips)."""

    def mask(index: int) -> bytes:
        return b"" if guide is None else guide.mask(index)

    def taken(index: int, token: int) -> int:
        if guide is not None and not guide.accept(index, token):
            raise ValueError(f"the guide refused token {index}: {guide.error}")
        return token

    if not prompt_ids:
        raise ValueError("empty prompt")
    if policy.max_depth > kv_layout.max_depth:
        raise ValueError(f"policy max_depth {policy.max_depth} > KV layout max_depth {kv_layout.max_depth}")
    if isinstance(policy, ReplayDepth) and (replay_depths is None or len(replay_depths) < max_new_tokens - 1):
        raise ValueError("ReplayDepth needs one replay depth per generated token after the first")
    out = ReferenceOutput()
    if max_new_tokens <= 0:
        return out
    req = _Request(model, kv_layout, init_seed)
    n, chunk = len(prompt_ids), prefill_chunk_size or len(prompt_ids)
    with torch.inference_mode():
        for start in range(0, n, chunk):
            positions = list(range(start, min(start + chunk, n)))
            rows = req.prelude(prompt_ids[start : start + chunk], positions)
            for s in range(policy.max_depth):
                rows, _, _ = req.step(rows, positions, s)
            hidden = req.coda(rows, positions)
        token = taken(0, req.sample_last(hidden, sampling, 0, prompt_ids, (), mask(0)))  # the last prompt position
        out.tokens.append(token)
        out.depths.append(policy.max_depth)

        while len(out.tokens) < max_new_tokens and token not in stop_token_ids:
            i = len(out.tokens)
            position = n + i - 1
            rows = req.prelude([token], [position])
            st = policy.new_state(target_depth=replay_depths[i - 1] if replay_depths is not None else 0)
            s, leave = 0, False
            while True:
                if policy.horizon is Horizon.ONE_AHEAD:
                    leave = policy.exits_after(st, s)
                rows, signal, lookahead = req.step(rows, [position], s)
                policy.observe(st, s, signal, lookahead)
                if policy.horizon is Horizon.SAME_STEP:
                    leave = policy.exits_after(st, s)
                if leave:
                    break
                s += 1
            if kv_layout.copies_on_exit and s + 1 < kv_layout.n_slots:
                req.loop_kv.copy_position(position, kv_layout.slot(s), range(s + 1, kv_layout.n_slots))
            hidden = req.coda(rows, [position])
            token = taken(i, req.sample_last(hidden, sampling, i, prompt_ids, out.tokens, mask(i)))
            out.tokens.append(token)
            out.depths.append(s + 1)
    return out


def reference_prompt_logprobs(
    model: LoopedLM,
    prompt_ids: Sequence[int],
    *,
    max_depth: int,
    kv_layout: KVLayout,
    prefill_chunk_size: int | None = None,
    init_seed: int = -1,
) -> list[float]:
    """The logprob of each prompt token after the first, from the previous position's hidden state after the
    full-depth prefill (``max_depth`` loop steps, in chunks as the engine prefills), the coda and the LM head: the
    semantics of the engine's prompt scoring (``RequestParams.prompt_logprobs``)."""
    req = _Request(model, kv_layout, init_seed)
    n, chunk = len(prompt_ids), prefill_chunk_size or len(prompt_ids)
    out: list[float] = []
    with torch.inference_mode():
        for start in range(0, n, chunk):
            positions = list(range(start, min(start + chunk, n)))
            rows = req.prelude(prompt_ids[start : start + chunk], positions)
            for s in range(max_depth):
                rows, _, _ = req.step(rows, positions, s)
            lp = torch.log_softmax(model.logits(req.coda(rows, positions)).double(), dim=-1)  # [T, V]
            out += [float(lp[i, prompt_ids[p + 1]]) for i, p in enumerate(positions) if p + 1 < n]
    return out
