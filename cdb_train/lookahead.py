"""The lookahead exit gate: distilled from the frozen same-step gate, then measured against it.

``model.lookahead_exit_gate`` is a ``Linear(hidden, 1)`` on the normed state after step ``t``; its sigmoid
``mu_t`` predicts the same-step gate's hazard ``lambda_{t+1}``. Under one-step-ahead decisions the step being
decided is ``s >= 1`` (step 0 never exits: minimum served depth 2) and the exit rule computes
``CDF(s) = F(s - 1) + S(s - 1) * mu_{s-1}`` from the observed hazards (``F``, ``S``: exit CDF and survival of
the same-step hazards through step ``s - 1``; ``cdb_scheduler.exit_policy.OuroHazard``).

Distillation loss, over the decidable steps ``s = 1 .. R-2`` (the last step always exits), both terms folded to
the minimum exit depth of 2 (the exit mass of depth 1 moved to depth 2, i.e. the hazard of step 1 becomes
``1 - (1 - lambda_0)(1 - lambda_1)``):
- binary cross-entropy between the folded student hazard and the folded teacher hazard;
- mean absolute difference of the exit CDFs the rule computes, ``|F(s-1) + S(s-1) mu_{s-1} - F(s)|``.
Only the gate learns; the LM is frozen. The gate starts from the same-step gate's weights.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from torch import Tensor, nn
from tqdm import tqdm

from cdb_model.loader import load_model
from cdb_model.ouro import OuroLM
from cdb_scheduler.exit_policy import Horizon, OuroHazard
from cdb_train import bpe, corpus
from cdb_train.evaluate import StepScores, depth_profile, score, windows
from cdb_train.model import loop_forward
from cdb_train.train import read_metrics, write_metrics

THRESHOLDS = (0.2, 0.4, 0.5, 0.7)
_EPS = 1e-6


@dataclass
class LookaheadArgs:
    model: Path
    cache: Path = corpus.DEFAULT_CACHE
    batches: int = 40
    batch: int = 16
    seq: int = 256
    updates_per_batch: int = 10
    lr: float = 1e-2
    seed: int = 1
    threads: int = 1
    command: str = ""
    train_docs: list[str] | None = None
    heldout_docs: list[str] | None = None


def distill_loss(student_logits: Tensor, teacher_hazard: Tensor) -> tuple[Tensor, dict[str, float]]:
    """``student_logits [R-2, N]`` (lookahead gate on the states after steps 0 .. R-3), ``teacher_hazard [R, N]``
    (frozen same-step gate after steps 0 .. R-1) -> (BCE + CDF L1, logged terms)."""
    lam = teacher_hazard
    survival = torch.cumprod(1.0 - lam, dim=0)  # S(t) = prod_{j<=t} (1 - lambda_j)
    before = torch.cat([torch.ones_like(lam[:1]), survival[:-1]])  # S(t - 1)
    mu = torch.sigmoid(student_logits)  # mu_{s-1} for s = 1 .. R-2
    s_prev = before[1 : 1 + mu.shape[0]]  # S(s - 1)
    # Folded hazards of the decidable steps: step 1 carries the exit mass of step 0.
    t_fold = torch.cat([1.0 - survival[1:2], lam[2 : 1 + mu.shape[0]]])
    m_fold = torch.cat([1.0 - survival[0:1] * (1.0 - mu[:1]), mu[1:]])
    bce = F.binary_cross_entropy(m_fold.clamp(_EPS, 1 - _EPS), t_fold)
    cdf = (s_prev * (mu - lam[1 : 1 + mu.shape[0]])).abs().mean()  # |CDF_rule(s) - CDF_teacher(s)|
    return bce + cdf, {"bce": float(bce.detach()), "cdf_l1": float(cdf.detach())}


def _train_stream(a: LookaheadArgs, tok_file: Path) -> tuple[Tensor, list[int]]:
    if a.train_docs is not None and a.heldout_docs is not None:
        train_docs, held_docs = a.train_docs, a.heldout_docs
    else:
        folder = a.cache / "corpus"
        if not (folder / "source.json").is_file():
            corpus.prepare_corpus(a.cache)
        train_docs = corpus.read_documents(folder / "train.txt")
        held_docs = corpus.read_documents(folder / "heldout.txt")
    tok = Tokenizer.from_file(str(tok_file))
    return torch.tensor(bpe.encode_documents(tok, train_docs)), bpe.encode_documents(tok, held_docs)


def distill(model: OuroLM, train_ids: Tensor, a: LookaheadArgs) -> tuple[nn.Linear, list[dict[str, float]]]:
    """Train the lookahead gate on the frozen ``model`` (its same-step gate as teacher)."""
    c = model.config
    assert model.model.early_exit_gate is not None
    gate = nn.Linear(c.hidden_size, 1)
    with torch.no_grad():
        gate.weight.copy_(model.model.early_exit_gate.weight.float())
        gate.bias.copy_(model.model.early_exit_gate.bias.float())
    opt = torch.optim.Adam(gate.parameters(), lr=a.lr)
    gen = torch.Generator().manual_seed(a.seed)
    log: list[dict[str, float]] = []
    decidable = c.max_depth - 2
    for i in tqdm(range(a.batches), desc="lookahead", mininterval=2.0, dynamic_ncols=True):
        starts = torch.randint(0, len(train_ids) - a.seq - 1, (a.batch,), generator=gen)
        w = torch.stack([train_ids[s : s + a.seq] for s in starts.tolist()])
        with torch.no_grad():
            out = loop_forward(model, w)
            states = torch.stack(out.states[:decidable]).float()  # [R-2, N, H]
            teacher = torch.sigmoid(out.gate_logits.float())  # [R, N]
        for _ in range(a.updates_per_batch):
            loss, logged = distill_loss(gate(states).squeeze(-1), teacher)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        log.append({"batch": i, "loss": float(loss.detach()), **logged})
    return gate, log


def served_depths(hazard: Tensor, lookahead: Tensor | None, q: float, horizon: Horizon, min_depth: int) -> Tensor:
    """Served depth of every token ``[M]`` under ``OuroHazard`` (the scheduler's own rule), the per-step signals
    ``hazard [R, M]`` / ``lookahead [R, M]`` coming from a full-depth pass."""
    r = hazard.shape[0]
    policy = OuroHazard(q, r, min_depth, horizon)
    hz, la = hazard.t().tolist(), None if lookahead is None else lookahead.t().tolist()
    out = []
    for i, signals in enumerate(hz):
        st = policy.new_state()
        s = 0
        while True:
            leave = policy.exits_after(st, s) if horizon is Horizon.ONE_AHEAD else False
            policy.observe(st, s, signals[s], None if la is None else la[i][s])
            if horizon is Horizon.SAME_STEP:
                leave = policy.exits_after(st, s)
            if leave:
                break
            s += 1
        out.append(s + 1)
    return torch.tensor(out)


def measure(scores: StepScores, q: float) -> dict[str, Any]:
    """Agreement of one-ahead decisions (lookahead gate) with same-step ones, and mean served depths."""
    assert scores.lookahead is not None
    hz, la = scores.hazard, scores.lookahead
    r, m = hz.shape
    same = served_depths(hz, None, q, Horizon.SAME_STEP, 1)
    same2 = served_depths(hz, None, q, Horizon.SAME_STEP, 2)
    ahead_la = served_depths(hz, la, q, Horizon.ONE_AHEAD, 1)
    ahead_same = served_depths(hz, None, q, Horizon.ONE_AHEAD, 1)
    # Per decision: steps s = 1 .. R-2 that the same-step rule (min depth 2) takes, i.e. s < its served depth.
    survival = torch.cumprod(1.0 - hz.double(), dim=0)
    cdf = 1.0 - survival  # F(s)
    steps = torch.arange(1, r - 1)[:, None]  # [R-2, 1]
    rule_la = (cdf[:-2] + survival[:-2] * la[:-2].double()) >= q  # one-ahead with lookahead, deciding step s
    rule_ss = cdf[1:-1] >= q  # same-step, deciding step s
    taken = steps < same2[None, :]
    agree_dec = ((rule_la == rule_ss) & taken).sum() / taken.sum().clamp_min(1)

    def hist(d: Tensor) -> list[float]:
        return [round(int(c) / m, 4) for c in torch.bincount(d - 1, minlength=r)]

    return {
        "threshold": q,
        "tokens": m,
        "agreement_tokens": round(float((ahead_la == same2).float().mean()), 4),
        "agreement_decisions": round(float(agree_dec), 4),
        "lookahead_exits_late": round(float((ahead_la > same2).float().mean()), 4),
        "lookahead_exits_early": round(float((ahead_la < same2).float().mean()), 4),
        "mean_depth_same_step": round(float(same.float().mean()), 4),
        "mean_depth_same_step_min2": round(float(same2.float().mean()), 4),
        "mean_depth_one_ahead_lookahead": round(float(ahead_la.float().mean()), 4),
        "mean_depth_one_ahead_same_gate": round(float(ahead_same.float().mean()), 4),
        "hist_same_step": hist(same),
        "hist_one_ahead_lookahead": hist(ahead_la),
        "hist_one_ahead_same_gate": hist(ahead_same),
    }


def add_lookahead_gate(folder: Path, gate: nn.Linear) -> None:
    """Write the gate into ``model.safetensors`` (bf16, like the other tensors) and flag it in config.json."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    dtype = tensors["model.early_exit_gate.weight"].dtype
    tensors["model.lookahead_exit_gate.weight"] = gate.weight.detach().to(dtype).contiguous()
    tensors["model.lookahead_exit_gate.bias"] = gate.bias.detach().to(dtype).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["has_lookahead_gate"] = True
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def run(a: LookaheadArgs) -> dict[str, Any]:
    """Distil, ship the gate in ``a.model``, measure on the held-out split, add the figures to metrics.json."""
    t0 = time.time()
    torch.set_num_threads(a.threads)
    teacher = load_model(str(a.model))
    assert isinstance(teacher, OuroLM)
    if teacher.config.has_lookahead_gate:
        raise ValueError(f"{a.model} already has a lookahead gate")
    train_ids, held_ids = _train_stream(a, a.model / "tokenizer.json")
    gate, log = distill(teacher, train_ids, a)
    add_lookahead_gate(a.model, gate)
    distill_s = time.time() - t0
    shipped = load_model(str(a.model))
    assert isinstance(shipped, OuroLM) and shipped.config.has_lookahead_gate
    metrics = read_metrics(a.model)
    held_w = windows(held_ids, a.seq)
    held = score(shipped, held_w)
    default_q = shipped.config.early_exit_threshold
    tok = Tokenizer.from_file(str(a.model / "tokenizer.json"))
    metrics["heldout"]["depth_profile"] = depth_profile(
        held, held_w[:, 1:].reshape(-1), lambda i: tok.decode([i]), default_q
    )
    qs = sorted({default_q, *THRESHOLDS})
    metrics["lookahead"] = {
        "distillation": {
            "batches": a.batches,
            "batch": a.batch,
            "seq": a.seq,
            "updates_per_batch": a.updates_per_batch,
            "lr": a.lr,
            "seed": a.seed,
            "wall_s": round(distill_s, 1),
            "final": log[-1],
            "command": a.command,
        },
        "default_threshold": default_q,
        "by_threshold": [measure(held, q) for q in qs],
    }
    write_metrics(a.model, metrics)
    (a.model / "lookahead_log.json").write_text(json.dumps(log) + "\n")
    return metrics
