"""The golden vectors of both models (upstream code, float32) through the loader and the stage API."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cdb_model.attention import DenseKVCache
from cdb_model.base import LoopedLM
from cdb_scheduler.exit_policy import Horizon, OuroHazard

Golden = tuple[LoopedLM, dict[str, torch.Tensor]]
S = 12  # prompt length of the golden inputs


def _pos() -> torch.Tensor:
    return torch.arange(S)


def _ouro_steps(model: LoopedLM, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-step normed hidden [S, H] and hazards [S] of one prompt, with a dense depth-indexed cache."""
    cache = DenseKVCache()
    x = model.prelude(ids, _pos(), None, [-1] * S)
    hidden, hazards = [], []
    for t in range(model.config.max_depth):
        x, signal, lookahead = model.loop_step(x, _pos(), torch.full((S,), t), cache.access(range(S), t))
        assert lookahead is None
        hidden.append(x)
        hazards.append(signal)
    return hidden, hazards


def test_ouro_embeddings_steps_gate(ouro_golden: Golden) -> None:
    model, e = ouro_golden
    for b in range(2):
        ids = e["input_ids"][b]
        torch.testing.assert_close(model.prelude(ids, _pos(), None, [-1] * S), e["embeddings"][b], atol=0, rtol=0)
        hidden, hazards = _ouro_steps(model, ids)
        for t, (h, lam) in enumerate(zip(hidden, hazards, strict=True)):
            torch.testing.assert_close(h, e["step_hidden"][t, b], atol=1e-5, rtol=1e-5)
            logits = model.logits(model.coda(h, _pos(), None))
            assert logits.dtype == torch.float32
            torch.testing.assert_close(logits, e["step_logits"][t, b], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(model.gate_logits(h), e["gate_logits"][t, b], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lam, e["hazard"][t, b], atol=1e-5, rtol=1e-5)


def test_ouro_exit_distribution_and_outputs(ouro_golden: Golden) -> None:
    model, e = ouro_golden
    T = model.config.max_depth
    for b in range(2):
        hidden, hazards = _ouro_steps(model, e["input_ids"][b])
        step_logits = torch.stack([model.logits(h) for h in hidden])  # [T, S, V]
        pdf = torch.zeros(S, T)
        cdf = torch.zeros(S, T)
        exit_05 = []
        for i in range(S):
            # The policy's own bookkeeping: cdf += lambda * survival; the last step takes the remaining mass.
            pol = OuroHazard(0.5, T, horizon=Horizon.SAME_STEP)
            st = pol.new_state()
            chosen = None
            for t in range(T):
                before = st.cdf
                pol.observe(st, t, float(hazards[t][i]))
                cdf[i, t] = st.cdf if t < T - 1 else 1.0
                pdf[i, t] = cdf[i, t] - before
                if chosen is None and pol.exits_after(st, t):
                    chosen = t
            exit_05.append(chosen)
        torch.testing.assert_close(pdf, e["exit_pdf"][b], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cdf, e["exit_cdf"][b], atol=1e-5, rtol=1e-5)
        assert exit_05 == e["threshold_0p5_exit_step"][b].tolist()
        picked = step_logits[torch.tensor(exit_05), torch.arange(S)]  # [S, V]
        torch.testing.assert_close(picked, e["threshold_0p5_logits"][b], atol=1e-4, rtol=1e-4)
        assert e["default_exit_step"][b].tolist() == [T - 1] * S  # threshold 1.0: full depth
        torch.testing.assert_close(step_logits[-1], e["default_logits"][b], atol=1e-4, rtol=1e-4)
        expected = torch.einsum("st,tsv->sv", pdf, step_logits)
        torch.testing.assert_close(expected, e["expected_logits"][b], atol=1e-4, rtol=1e-4)


def test_ouro_expected_loss(ouro_golden: Golden) -> None:
    model, e = ouro_golden
    T = model.config.max_depth
    mixtures = []
    for b in range(2):
        hidden, hazards = _ouro_steps(model, e["input_ids"][b])
        lam = torch.stack(hazards, dim=1)  # [S, T]
        survival = torch.cumprod(torch.cat([torch.ones(S, 1), 1 - lam[:, :-1]], dim=1), dim=1)  # [S, T]
        pdf = lam * survival
        pdf[:, T - 1] = survival[:, T - 1]
        mixtures.append(torch.einsum("st,tsv->sv", pdf, torch.stack([model.logits(h) for h in hidden])))
    logits = torch.stack(mixtures)  # [2, S, V]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), e["input_ids"][:, 1:].reshape(-1))
    torch.testing.assert_close(loss, e["expected_loss"], atol=1e-5, rtol=1e-5)


def _huginn_run(model: LoopedLM, ids: torch.Tensor, s0: torch.Tensor | None, steps: int) -> list[torch.Tensor]:
    """Rows [S, 2H] after each of ``steps`` recurrence steps from the initial state ``s0`` (None: zeros)."""
    H = model.config.hidden_size
    rows = model.prelude(ids, _pos(), DenseKVCache().access(range(S), 0), [-1] * S)
    assert torch.count_nonzero(rows[:, :H]) == 0  # seed < 0: zero initial state
    if s0 is not None:
        rows = torch.cat([s0, rows[:, H:]], dim=-1)  # [S, 2H] = [s0 | e]
    cache, out = DenseKVCache(), []
    for t in range(steps):
        rows, _, _ = model.loop_step(rows, _pos(), torch.full((S,), t), cache.access(range(S), t))
        out.append(rows)
    return out


def _decode(model: LoopedLM, rows: torch.Tensor) -> torch.Tensor:
    return model.logits(model.coda(rows, _pos(), DenseKVCache().access(range(S), 0)))


def test_huginn_prelude(huginn_golden: Golden) -> None:
    model, e = huginn_golden
    H = model.config.hidden_size
    for b in range(2):
        ids = e["input_ids"][b]
        torch.testing.assert_close(model.embed(ids), e["input_embeds_scaled"][b], atol=1e-6, rtol=1e-6)
        rows = model.prelude(ids, _pos(), DenseKVCache().access(range(S), 0), [-1] * S)
        torch.testing.assert_close(rows[:, H:], e["prelude_output"][b], atol=1e-5, rtol=1e-5)


def test_huginn_explicit_init_recurrence(huginn_golden: Golden) -> None:
    model, e = huginn_golden
    H = model.config.hidden_size
    for b in range(2):
        states = _huginn_run(model, e["input_ids"][b], e["init_state"][b], 8)
        for k, rows in enumerate(states):
            torch.testing.assert_close(rows[:, :H], e["step_states"][k, b], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(_decode(model, rows), e["step_logits"][k, b], atol=1e-4, rtol=1e-4)
        for n in (4, 8):
            torch.testing.assert_close(model.latent(states[n - 1]), e[f"latent_states_steps{n}"][b], atol=1e-5, rtol=0)
            torch.testing.assert_close(_decode(model, states[n - 1]), e[f"logits_steps{n}"][b], atol=1e-4, rtol=1e-4)


def test_huginn_zero_init_and_signal(huginn_golden: Golden) -> None:
    model, e = huginn_golden
    H = model.config.hidden_size
    for b in range(2):
        ids = e["input_ids"][b]
        states = _huginn_run(model, ids, None, 8)
        for k, rows in enumerate(states):
            torch.testing.assert_close(rows[:, :H], e["zeroinit_step_states"][k, b], atol=1e-5, rtol=1e-5)
        for n in (4, 8):
            torch.testing.assert_close(
                _decode(model, states[n - 1]), e[f"zeroinit_logits_steps{n}"][b], atol=1e-4, rtol=1e-4
            )
        # Relative latent difference: 1 at the first step from a zero state, then ||s_k - s_k-1|| / ||s_k||.
        rows = model.prelude(ids, _pos(), DenseKVCache().access(range(S), 0), [-1] * S)
        cache = DenseKVCache()
        prev = torch.zeros(S, H)
        for k in range(3):
            rows, signal, _ = model.loop_step(rows, _pos(), torch.full((S,), k), cache.access(range(S), k))
            ref = e["zeroinit_step_states"][k, b]
            torch.testing.assert_close(signal, (ref - prev).norm(dim=-1) / ref.norm(dim=-1), atol=1e-5, rtol=1e-5)
            prev = ref
