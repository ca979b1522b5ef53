"""What ``cdb bench routing`` shows: tables on stdout; with ``--out DIR``, ``routing.json`` and ``routing.png``.

``routing.json``: ``config`` (every option), ``costs`` (the fitted lines, ``cdb_bench.routing.costs``) and
``cost_points`` (the measured points), ``workload`` (lengths, depths, deep fraction, the long-token cut, the
segregation split, the capacity estimate), ``sim`` (``loads``, ``rates``, per policy one summary per load:
``cdb_bench.routing.sim.summarize``), ``ranking`` (policies by their mean normalized latency over the loads),
``live`` (None, or ``rates``, ``repeats``, per policy per rate the repeats' ``summarize_run`` figures, and the
simulation at the same rates) and ``decision`` (the client default and why).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from cdb_bench.routing.policies import POLICIES
from cdb_bench.stats import error_bars

DEFAULT = "round-robin"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def cut(best: float | None, base: float | None) -> float | None:
    """1 - best / base: the fraction of ``base`` that ``best`` saves."""
    return None if best is None or not base else 1.0 - best / base


def decide(result: dict[str, Any], margin: float, min_load: float) -> dict[str, Any]:
    """Ship the best-ranked policy as the client default only if it cuts the mean normalized latency of
    round-robin by ``margin`` or more at every simulated load >= ``min_load`` and, when there was a live run, at
    every live rate in each repeat."""
    best = result["ranking"][0]
    why = {"margin": margin, "min_load": min_load, "best": best, "sim_cuts": {}, "live_cuts": {}}
    if best == DEFAULT:
        return why | {"ship": False, "default": DEFAULT, "why": "round-robin ranks first"}
    sim = result["sim"]
    for load, b, r in zip(sim["loads"], sim["policies"][best], sim["policies"][DEFAULT]):
        why["sim_cuts"][f"{load:g}"] = cut(b["normalized_latency_s"]["mean"], r["normalized_latency_s"]["mean"])
    live = result.get("live")
    if live is not None and best in live["runs"] and DEFAULT in live["runs"]:
        for rate, bs, rs in zip(live["rates"], live["runs"][best], live["runs"][DEFAULT]):
            why["live_cuts"][f"{rate:g}"] = [
                cut(b["normalized_latency_s"]["mean"], r["normalized_latency_s"]["mean"]) for b, r in zip(bs, rs)
            ]
    sim_ok = all(c is not None and c >= margin for k, c in why["sim_cuts"].items() if float(k) >= min_load)
    live_ok = all(c is not None and c >= margin for cs in why["live_cuts"].values() for c in cs)
    ship = sim_ok and live_ok
    text = (
        f"{best} cuts round-robin's mean normalized latency by >= {100 * margin:g} % at every load >= {min_load:g}"
        + (" and every live rate" if why["live_cuts"] else "")
        if ship
        else f"{best} does not cut round-robin's mean normalized latency by {100 * margin:g} % at every load >= "
        f"{min_load:g}" + (" and every live rate" if why["live_cuts"] else "")
    )
    return why | {"ship": ship, "default": best if ship else DEFAULT, "why": text}


def rank(sim: dict[str, Any]) -> list[str]:
    """Policies by the mean over the loads of their mean normalized latency, best first."""
    score = {
        p: statistics.fmean(s["normalized_latency_s"]["mean"] for s in runs) for p, runs in sim["policies"].items()
    }
    return sorted(score, key=score.__getitem__)


def table(result: dict[str, Any]) -> str:
    c, w, sim = result["config"], result["workload"], result["sim"]
    lines = [
        f"{c['replicas']} replicas x {c['width']} slots, {c['model']} costs ({result['costs']['source']}): loop "
        f"{1e3 * result['costs']['loop_base_s']:.3f} + {1e3 * result['costs']['loop_per_token_s']:.4f}·b ms, head "
        f"{1e3 * result['costs']['head_base_s']:.4f} + {1e3 * result['costs']['head_per_token_s']:.4f}·e ms",
        f"{w['dataset']}-like lengths x{w['scale']:g} (mean prompt {w['mean_prompt_tokens']:.1f}, output "
        f"{w['mean_output_tokens']:.1f}), depths mean {w['depth']['mean']:g} in [{w['depth']['min']}, "
        f"{w['depth']['max']}], {100 * w['deep_fraction']:g} % deep (q = {w['deep_exit_threshold']:g}), "
        f"{w['requests']} Poisson requests per run",
        f"segregation: heavy = max_tokens >= {w['long_tokens']} or deep, on {w['heavy_replicas']} of "
        f"{c['replicas']} replicas ({100 * w['heavy_share']:.0f} % of the work); capacity ~ {w['capacity_rps']:.1f} "
        "req/s",
        "",
        "simulation: mean normalized latency (ms / output token) | p99 TTFT (ms), by load (fraction of capacity)",
        f"{'policy':<18} "
        + " ".join(f"{f'{load:g} ({rate:.0f}/s)':>17}" for load, rate in zip(sim["loads"], sim["rates"])),
    ]
    for policy, runs in sim["policies"].items():
        cells = [f"{_ms(s['normalized_latency_s']['mean'])} | {_ms(s['ttft_s']['p99'])}" for s in runs]
        lines.append(f"{policy:<18} " + " ".join(f"{x:>17}" for x in cells))
    lines.append(f"ranking: {', '.join(result['ranking'])}")
    live = result.get("live")
    if live is not None:
        lines += ["", f"real replicas ({live['repeats']} interleaved repeats): mean NL | p99 TTFT (ms) per repeat"]
        lines.append(f"{'policy':<18} " + " ".join(f"{f'{r:g} req/s':>28}" for r in live["rates"]))
        for policy, per_rate in live["runs"].items():
            cells = [
                ", ".join(f"{_ms(s['normalized_latency_s']['mean'])}|{_ms(s['ttft_s']['p99'])}" for s in reps)
                for reps in per_rate
            ]
            lines.append(f"{policy:<18} " + " ".join(f"{x:>28}" for x in cells))
        for policy, runs in live["sim_at_live_rates"].items():
            cells = [f"{_ms(s['normalized_latency_s']['mean'])}|{_ms(s['ttft_s']['p99'])}" for s in runs]
            lines.append(f"{'sim ' + policy:<18} " + " ".join(f"{x:>28}" for x in cells))
        failed = sum(s["failed"] for per_rate in live["runs"].values() for reps in per_rate for s in reps)
        lags = [
            s["client_lag"]["p99_s"] or 0.0 for per_rate in live["runs"].values() for reps in per_rate for s in reps
        ]
        lines.append(f"failed requests: {failed}; client lag p99 up to {_ms(max(lags, default=None))} ms")
    d = result["decision"]
    lines += ["", f"client default: {d['default']} ({d['why']})"]
    return "\n".join(lines)


def write_outputs(result: dict[str, Any], out_dir: str) -> list[Path]:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "routing.json"
    path.write_text(json.dumps(result, indent=1))
    return [path, plot(result, d / "routing.png")]


def plot(result: dict[str, Any], path: Path) -> Path:
    """Mean normalized latency and p99 TTFT against load per policy (simulation); the live run beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    live = result.get("live")
    fig, axes = plt.subplots(1, 3 if live else 2, figsize=(15 if live else 10, 4))
    sim = result["sim"]
    for ax, key, stat, label in (
        (axes[0], "normalized_latency_s", "mean", "mean normalized latency (ms / token)"),
        (axes[1], "ttft_s", "p99", "p99 TTFT (ms)"),
    ):
        for policy, runs in sim["policies"].items():
            ys = [1e3 * s[key][stat] for s in runs]
            ax.plot(sim["loads"], ys, marker="o", label=policy, color=_color(policy))
        ax.set(xlabel="load (fraction of capacity)", ylabel=label, yscale="log", title=f"simulation: {label}")
        ax.grid(alpha=0.3)
        ax.legend()
    if live:
        ax = axes[2]
        for policy, per_rate in live["runs"].items():
            means = [[1e3 * s["normalized_latency_s"]["mean"] for s in reps] for reps in per_rate]
            ax.errorbar(
                live["rates"],
                [statistics.median(m) for m in means],
                yerr=error_bars(means),
                marker="o",
                capsize=3,
                label=f"{policy} (real)",
                color=_color(policy),
            )
        ax.set(xlabel="request rate (req/s)", ylabel="mean normalized latency (ms / token)", title="real replicas")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _color(policy: str) -> str:
    return f"C{POLICIES.index(policy)}" if policy in POLICIES else "k"
