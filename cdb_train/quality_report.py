"""``cdb eval`` figures: one (KV policy, q) point from its runs, the knee, the table and the quality-vs-depth plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

SERVING_POLICY = "last_exited"


def agreement(got: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> tuple[float, float]:
    """(tokens before the first divergence, tokens equal at equal positions), both as a fraction of all tokens."""
    total = sum(len(r) for r in ref)
    prefix = equal = 0
    for g, r in zip(got, ref, strict=True):
        same = [a == b for a, b in zip(g, r, strict=True)]
        prefix += same.index(False) if False in same else len(same)
        equal += sum(same)
    return prefix / max(1, total), equal / max(1, total)


def point(
    kv: str, run: dict[str, Any], greedy_out: tuple[list[list[int]], list[int]], ctx: dict[str, Any]
) -> dict[str, Any]:
    """One (policy, q) row: ``run`` from a teacher-forced pass, ``greedy_out`` (continuations, depths), ``ctx``
    with ``max_depth``, ``F0``, ``Fr`` and the full-depth ``reference_greedy`` continuations."""
    r, f0, fr = ctx["max_depth"], ctx["F0"], ctx["Fr"]
    n = len(run["nll"])
    depths = torch.tensor(run["depths"])
    mean_depth = float(depths.float().mean())
    steps = run["steps"] or mean_depth  # depth_indexed runs every step whatever its exit
    prefix, positionwise = agreement(greedy_out[0], ctx["reference_greedy"])
    return {
        "kv_policy": str(kv),
        "q": run["q"],
        "min_depth": run["min_depth"],
        "mean_depth": round(mean_depth, 4),
        "mean_steps_computed": round(steps, 4),
        "S": round((f0 + r * fr) / (f0 + steps * fr), 4),
        "ppl": round(math.exp(sum(run["nll"]) / n), 4),
        "nll": round(sum(run["nll"]) / n, 5),
        "depth_histogram": [round(int(c) / n, 4) for c in torch.bincount(depths - 1, minlength=r)],
        "greedy_agreement": round(prefix, 4),
        "greedy_agreement_positionwise": round(positionwise, 4),
        "greedy_mean_depth": round(sum(greedy_out[1]) / max(1, len(greedy_out[1])), 4),
    }


def knee(
    points: Sequence[dict[str, Any]], full_ppl: float, tolerance: float, min_agreement: float = 0.0
) -> dict[str, Any]:
    """The serving policy's point of lowest mean served depth whose perplexity is within ``tolerance`` of full
    depth's and whose greedy agreement with full depth is at least ``min_agreement`` (ties: the larger q)."""
    mine = [p for p in points if p["kv_policy"] == SERVING_POLICY]
    ok = [
        p for p in mine if p["ppl"] <= full_ppl * (1.0 + tolerance) and p.get("greedy_agreement", 1.0) >= min_agreement
    ] or mine
    best = min(ok, key=lambda p: (p["mean_depth"], -p["q"]))
    keys = ("q", "mean_depth", "S", "ppl", "ppl_vs_full_depth", "greedy_agreement")
    return {
        "rule": f"the {SERVING_POLICY} point of lowest mean served depth with perplexity <= (1 + {tolerance:g}) x "
        f"full depth's (depth_indexed, q = 1.0) and greedy agreement >= {min_agreement:g}",
        "kv_policy": SERVING_POLICY,
        "tolerance": tolerance,
        "min_agreement": min_agreement,
        **{k: best.get(k) for k in keys},
    }


def table(result: dict[str, Any]) -> str:
    h = result["heldout"]
    lines = [
        f"{result['model']}: {h['tokens_scored']} held-out tokens ({h['windows']} x {h['window']}, {h['source']}), "
        f"greedy {result['greedy']['prompts']} x {result['greedy']['new_tokens']} tokens; "
        f"decisions {result['decisions']['horizon']}, lookahead gate {result['decisions_lookahead_gate']}",
        f"{'kv policy':<18} {'q':>5} {'min d':>5} {'mean depth':>10} {'S':>6} {'ppl':>9} {'vs full':>8} "
        f"{'greedy (prefix)':>15} {'greedy (pos.)':>13}",
    ]
    for p in result["points"]:
        lines.append(
            f"{p['kv_policy']:<18} {p['q']:>5.2f} {p['min_depth']:>5} {p['mean_depth']:>10.4f} {p['S']:>6.3f} "
            f"{p['ppl']:>9.4f} {p['ppl_vs_full_depth']:>+8.2%} {p['greedy_agreement']:>15.1%} "
            f"{p['greedy_agreement_positionwise']:>13.1%}"
        )
    k = result["knee"]
    lines.append(f"full depth: perplexity {result['full_depth_ppl']:.4f}; depth_indexed runs every step (S = 1)")
    lines.append(
        f"knee: q = {k['q']} ({k['kv_policy']}: mean depth {k['mean_depth']}, S {k['S']}, perplexity {k['ppl']}, "
        f"{k['ppl_vs_full_depth']:+.2%}); model default q = {result['default_threshold']}; rule: {k['rule']}"
    )
    lines.append(f"wall time {result['wall_s']} s")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path:
    """Perplexity and greedy agreement against mean served depth, one curve per KV policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    policies = dict.fromkeys(p["kv_policy"] for p in result["points"])
    for kv in policies:
        pts = sorted((p for p in result["points"] if p["kv_policy"] == kv), key=lambda p: p["mean_depth"])
        upstream = kv == "depth_indexed"
        style = {
            "marker": "o",
            "ms": 7 if upstream else 4,
            "ls": "--" if upstream else "-",
            "mfc": "none" if upstream else None,
        }
        label = f"{kv} (all steps run)" if upstream else kv
        x = [p["mean_depth"] for p in pts]
        (line,) = a1.plot(x, [100 * p["ppl_vs_full_depth"] for p in pts], label=label, **style)
        a2.plot(x, [100 * p["greedy_agreement"] for p in pts], color=line.get_color(), label=label, **style)
        for p in pts if not upstream else []:
            xy = (p["mean_depth"], 100 * p["ppl_vs_full_depth"])
            a1.annotate(f"{p['q']:g}", xy, fontsize=6, xytext=(2, 3), textcoords="offset points")
    full, k = result["full_depth_ppl"], result["knee"]
    a1.axhline(0.0, color="k", lw=0.8, ls="--", label=f"full depth (perplexity {full:.2f})")
    a1.axhline(100 * k["tolerance"], color="k", lw=0.6, ls=":", label=f"full depth + {k['tolerance']:.0%}")
    a1.plot(
        [k["mean_depth"]],
        [100 * k["ppl_vs_full_depth"]],
        marker="*",
        ms=14,
        color="k",
        ls="",
        label=f"knee: q = {k['q']}",
    )
    a1.set_yscale("symlog", linthresh=1.0, linscale=2.0)
    a1.set_xlabel("mean served depth (loop steps)")
    a1.set_ylabel("perplexity vs full depth, % (symlog)")
    a1.set_title(f"teacher-forced perplexity, {result['heldout']['tokens_scored']} held-out tokens (labels: q)")
    a2.set_xlabel("mean served depth (loop steps)")
    a2.set_ylabel("% of greedy tokens before the first divergence")
    a2.set_title("greedy agreement with full depth")
    for a, where in ((a1, "lower left"), (a2, "best")):
        a.grid(alpha=0.3)
        a.legend(fontsize=7, loc=where)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
