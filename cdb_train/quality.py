"""``cdb eval``: quality against depth on held-out text, per loop-KV policy and exit threshold q.

Every point is one (KV policy, q) pair run through the sequential reference path's stage calls
(``cdb_model.reference._Request``), token by token, with the policy's own KV layout, so later tokens attend to the
KV an early exit leaves behind:

- perplexity, teacher-forced: each window's first ``prefix`` tokens are prefilled at full depth; every later true
  token runs loop steps until ``OuroHazard(q)`` exits (one step ahead with the lookahead gate, the serving
  default), and the LM head on the exit state scores the next true token. Only these decoded positions are scored.
- greedy agreement with full depth: from held-out prompts, greedy continuations; the first token comes from the
  full-depth prefill and is not counted, the next ``new_tokens`` are compared with the full-depth continuation
  (``depth_indexed``, q = 1.0). ``greedy_agreement`` counts tokens up to the first divergence;
  ``greedy_agreement_positionwise`` counts equal tokens at equal positions.

``depth_indexed`` is the upstream-exact reference: every token runs all steps (each step writes its own slot, as
trained) and the head reads the exit step's state, so its compute is full depth (S = 1) whatever q is; the KV does
not depend on q, so one teacher-forced pass scores every q. ``last_exited`` copies the exit slot into the deeper
slots, ``single`` keeps one slot, ``first_then_shared(k)`` needs ``min_depth >= k``. S = (F0 + r Fr) / (F0 + d Fr)
with d the mean number of loop steps computed per token.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from cdb_model.base import LoopedLM
from cdb_model.kv import KVLayout, KVPolicy
from cdb_model.loader import load_model, load_tokenizer, resolve_source
from cdb_model.reference import _Request
from cdb_scheduler.exit_policy import ExitState, Horizon, OuroHazard
from cdb_train import corpus
from cdb_train.evaluate import windows
from cdb_train.quality_report import knee, plot, point, table

POLICIES = (KVPolicy.DEPTH_INDEXED, KVPolicy.LAST_EXITED, KVPolicy.SINGLE, KVPolicy.FIRST_THEN_SHARED)
THRESHOLDS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0)
SHARED_AFTER = 2  # k of first_then_shared (the engine's default)
HORIZON = Horizon.ONE_AHEAD  # the serving default; the policy uses the lookahead gate where the model has one
SPLIT = corpus.DEFAULT_CACHE / "corpus" / "heldout.txt"  # written by ``python -m cdb_train prepare``


@dataclass(frozen=True)
class EvalArgs:
    model: str = "ouro-kjv"
    heldout: Path | None = None  # None: the held-out split, else the model's heldout_sample.txt
    windows: int = 8
    window: int = 256
    prefix: int = 1
    prompts: int = 8
    prompt_tokens: int = 16
    new_tokens: int = 32
    thresholds: tuple[float, ...] = THRESHOLDS
    policies: tuple[KVPolicy, ...] = POLICIES
    tolerance: float = 0.01
    min_agreement: float = 0.6


QUICK = {"windows": 2, "window": 104, "prompts": 2, "new_tokens": 16, "thresholds": (0.5, 1.0)}


def exit_policy(kv: KVPolicy, q: float, max_depth: int) -> OuroHazard:
    min_depth = SHARED_AFTER if kv is KVPolicy.FIRST_THEN_SHARED else 1
    return OuroHazard(q, max_depth, min_depth, HORIZON)


def _layout(kv: KVPolicy, max_depth: int) -> KVLayout:
    return KVLayout(kv, max_depth, SHARED_AFTER)


def _prefill(req: _Request, ids: Sequence[int], depth: int) -> Tensor:
    """Full depth over the prompt -> the last position's final hidden ``[1, H]``."""
    positions = list(range(len(ids)))
    rows = req.prelude(ids, positions)
    for s in range(depth):
        rows, _, _ = req.step(rows, positions, s)
    return req.coda(rows, positions)[-1:]


def _position(
    req: _Request, token: int, position: int, policies: Sequence[OuroHazard], all_steps: bool
) -> tuple[list[int], dict[int, Tensor]]:
    """One decode position: (each policy's exit step, final hidden ``[1, H]`` per exit step). ``all_steps``: run
    every step whatever the exits (``depth_indexed``), else stop at the exit of the (single) policy."""
    rows = req.prelude([token], [position])
    states: list[ExitState] = [p.new_state() for p in policies]
    exits: list[int | None] = [None] * len(policies)
    hidden: dict[int, Tensor] = {}
    for s in range(policies[0].max_depth):
        for i, p in enumerate(policies):
            if exits[i] is None and p.horizon is Horizon.ONE_AHEAD and p.exits_after(states[i], s):
                exits[i] = s
        rows, signal, lookahead = req.step(rows, [position], s)
        for i, p in enumerate(policies):
            if exits[i] is None:
                p.observe(states[i], s, signal, lookahead)
                if p.horizon is Horizon.SAME_STEP and p.exits_after(states[i], s):
                    exits[i] = s
        if s in exits:
            hidden[s] = req.coda(rows, [position])
        if not all_steps and None not in exits:
            break
    done = [int(e) for e in exits if e is not None]
    assert len(done) == len(policies), "the last step always exits"
    layout = req.layout
    if layout.copies_on_exit and done[0] + 1 < layout.n_slots:
        req.loop_kv.copy_position(position, layout.slot(done[0]), range(done[0] + 1, layout.n_slots))
    return done, hidden


def forced(model: LoopedLM, kv: KVPolicy, qs: Sequence[float], wins: Tensor, prefix: int) -> list[dict[str, Any]]:
    """Teacher-forced NLL and served depth of every decoded position of ``wins [W, T + 1]``, per q. One pass
    scores every q under ``depth_indexed`` (all steps run, the KV does not depend on q); else one q per pass."""
    r = model.config.max_depth
    all_steps = kv is KVPolicy.DEPTH_INDEXED
    if not all_steps and len(qs) != 1:
        raise ValueError("a policy that stops at the exit scores one q per pass")
    policies = [exit_policy(kv, q, r) for q in qs]
    runs: list[dict[str, Any]] = [
        {"q": p.q, "min_depth": p.min_depth, "nll": [], "depths": [], "steps": r if all_steps else 0} for p in policies
    ]
    with torch.inference_mode():
        for w in wins.tolist():
            req = _Request(model, _layout(kv, r), -1)
            _prefill(req, w[:prefix], r)
            for p in range(prefix, len(w) - 1):
                exits, hidden = _position(req, w[p], p, policies, all_steps)
                logp = {s: torch.log_softmax(model.logits(h)[0].double(), -1) for s, h in hidden.items()}
                for run, e in zip(runs, exits, strict=True):
                    run["nll"].append(-float(logp[e][w[p + 1]]))
                    run["depths"].append(e + 1)
    return runs


def greedy(
    model: LoopedLM, kv: KVPolicy, q: float, prompts: Sequence[Sequence[int]], new_tokens: int
) -> tuple[list[list[int]], list[int]]:
    """Greedy continuations (the ``new_tokens`` after the full-depth first token) and their served depths."""
    r = model.config.max_depth
    policy = [exit_policy(kv, q, r)]
    out, depths = [], []
    with torch.inference_mode():
        for prompt in prompts:
            req = _Request(model, _layout(kv, r), -1)
            token = int(model.logits(_prefill(req, prompt, r)).argmax(-1))
            seq = []
            for i in range(new_tokens):
                (e,), hidden = _position(req, token, len(prompt) + i, policy, kv is KVPolicy.DEPTH_INDEXED)
                token = int(model.logits(hidden[e]).argmax(-1))
                seq.append(token)
                depths.append(e + 1)
            out.append(seq)
    return out, depths


def _heldout_ids(a: EvalArgs, quick: bool) -> tuple[list[int], str]:
    """The evaluated token stream (documents separated by end-of-text) and where it came from."""
    folder = Path(resolve_source(a.model))
    if a.heldout is not None:
        path, source = a.heldout, str(a.heldout)
    elif not quick and SPLIT.is_file():
        path, source = SPLIT, "held-out split of `cdb train prepare` (corpus/heldout.txt)"
    else:
        path, source = folder / "heldout_sample.txt", f"{folder.name}/heldout_sample.txt"
    tok = load_tokenizer(a.model)
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    ids: list[int] = []
    for doc in corpus.read_documents(path):
        ids.extend([*tok.encode(doc), eos])
    return ids, source


def _spread(wins: Tensor, n: int) -> Tensor:
    """``n`` windows evenly spaced over the stream (all of them when there are fewer)."""
    if wins.shape[0] <= n:
        return wins
    return wins[torch.linspace(0, wins.shape[0] - 1, n).round().long()]


def evaluate(a: EvalArgs, quick: bool = False, log: Any = None) -> dict[str, Any]:
    """Every (KV policy, q) point, the full-depth reference and the knee (see the module docstring)."""

    t0 = time.time()
    model = load_model(a.model)
    c = model.config
    if c.arch != "ouro":
        raise ValueError("cdb eval sweeps Ouro's exit threshold: it needs an Ouro model")
    ids, source = _heldout_ids(a, quick)
    all_wins = windows(ids, a.window)
    wins, prompts = _spread(all_wins, a.windows), _spread(all_wins, a.prompts)[:, : a.prompt_tokens].tolist()
    qs = sorted({*a.thresholds, 1.0})
    f0, fr = c.param_counts()
    ctx: dict[str, Any] = {"max_depth": c.max_depth, "F0": f0, "Fr": fr}
    ctx["reference_greedy"] = greedy(model, KVPolicy.DEPTH_INDEXED, 1.0, prompts, a.new_tokens)[0]
    points = []
    for kv in POLICIES:
        if kv is KVPolicy.DEPTH_INDEXED:
            runs = forced(model, kv, qs, wins, a.prefix)
        else:
            runs = [forced(model, kv, [q], wins, a.prefix)[0] for q in qs]
        for run in runs:
            points.append(point(kv, run, greedy(model, kv, run["q"], prompts, a.new_tokens), ctx))
        if log is not None:
            print(f"{kv}: {len(runs)} points, {time.time() - t0:.1f} s", file=log, flush=True)
    full = next(p for p in points if p["kv_policy"] == KVPolicy.DEPTH_INDEXED and p["q"] == 1.0)
    for p in points:
        p["ppl_vs_full_depth"] = round(p["ppl"] / full["ppl"] - 1.0, 5)
    return {
        "model": a.model,
        "max_depth": c.max_depth,
        "F0": f0,
        "Fr": fr,
        "default_threshold": c.early_exit_threshold,
        "decisions": {"rule": "hazard (Ouro exit CDF >= q)", "horizon": str(HORIZON)},
        "decisions_lookahead_gate": c.has_lookahead_gate,
        "first_then_shared_k": SHARED_AFTER,
        "heldout": {
            "source": source,
            "windows": int(wins.shape[0]),
            "window": a.window,
            "prefix": a.prefix,
            "tokens_scored": int(wins.shape[0]) * (a.window - a.prefix),
        },
        "greedy": {"prompts": len(prompts), "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens},
        "full_depth_ppl": full["ppl"],
        "points": points,
        "knee": knee(points, full["ppl"], a.tolerance, a.min_agreement),
        "quick": quick,
        "wall_s": round(time.time() - t0, 1),
    }


def build_parser() -> argparse.ArgumentParser:
    d = EvalArgs()
    p = argparse.ArgumentParser(
        prog="cdb eval",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
        epilog="cdb eval --harness: the evaluation harness (lm_eval) through the server's API over q instead "
        "(cdb eval --harness --help)",
    )
    p.add_argument("--model", default=d.model, help=f"shipped name or checkpoint folder (default {d.model})")
    p.add_argument("--heldout", type=Path, default=None, help="text file (documents separated by blank lines)")
    p.add_argument("--windows", type=int, default=d.windows, help="teacher-forced windows, evenly spaced")
    p.add_argument("--window", type=int, default=d.window, help="tokens per window")
    p.add_argument("--prefix", type=int, default=d.prefix, help="tokens of each window prefilled at full depth")
    p.add_argument("--prompts", type=int, default=d.prompts, help="greedy prompts")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="tokens per greedy prompt")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens, help="greedy tokens compared per prompt")
    p.add_argument("--thresholds", default=",".join(map(str, d.thresholds)), help="exit thresholds q (1.0 added)")
    p.add_argument("--tolerance", type=float, default=d.tolerance, help="knee: perplexity within this of full")
    p.add_argument(
        "--min-agreement", type=float, default=d.min_agreement, help="knee: greedy agreement with full depth at least"
    )
    p.add_argument("--quick", action="store_true", help="CI: the shipped sample, 2 x 104 tokens, q in {0.5, 1.0}")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out", type=Path, default=None, help="write eval.json and quality_vs_depth.png here")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p


def main(argv: list[str] | None = None) -> int:
    import sys

    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    qs = tuple(float(x) for x in args.thresholds.split(","))
    fields = ("windows", "window", "prefix", "prompts", "prompt_tokens", "new_tokens", "tolerance", "min_agreement")
    kw: dict[str, Any] = {k: getattr(args, k) for k in fields}
    kw["thresholds"] = qs
    if args.quick:
        kw.update(QUICK)
    a = EvalArgs(model=args.model, heldout=args.heldout, **kw)
    result = evaluate(a, quick=args.quick, log=sys.stderr)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        plot(result, args.out / "quality_vs_depth.png")
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0
