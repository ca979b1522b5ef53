"""What ``cdb bench serve`` shows: a table on stdout, and with ``--out DIR`` ``serve.json`` and three PNG plots.

- ``nl_vs_rate.png``: mean normalized latency vs request rate, one curve per mode, the bound dashed;
- ``ttft_p99_vs_rate.png``: p99 TTFT vs request rate, one curve per mode;
- ``nl_cdf_at_knee.png``: the CDF of per-request normalized latency at full depth's knee rate, one curve per mode.

The ``--json`` object (``serve.json``: the same plus every request's inter-token latencies, ``per_request.itl_s``):

- ``config``: every option; ``model``: name, arch, max_depth, vocab_size, token limits, F0_over_Fr;
  ``workload``: dataset, its fit (mu, sigma, clip, target means, source), scale, requests, mean lengths, arrival
  process and CV, seed, replayed depth distribution (None: live);
- ``modes.<mode>.runs[]`` (by rate): rate, source (sweep | bisect | reference-knee), requests, completed, failed,
  errors, duration_s, output_tokens, output_throughput, request_throughput, goodput, slo_attainment, mean_depth,
  ``ttft_s`` / ``tpot_s`` / ``itl_s`` / ``e2e_s`` / ``normalized_latency_s`` each {mean, p50, p90, p99},
  client_lag {mean_s, p99_s, max_s}, queue {interval_s, samples [[t, waiting, running]], mean/max waiting and
  running}, per_request {arrival_s, client_lag_s, prompt_tokens, output_tokens, ttft_s, tpot_s, e2e_s,
  normalized_latency_s};
- ``modes.<mode>.knee``: {rate, failing, censored, bisect_steps, bound}; ``knees``: mode -> knee rate;
- ``knee_ratio_cdb_over_full_depth``; ``cut_at_full_depth_knee``: {rate, normalized_latency_s per mode, cut per
  mode (1 - NL_mode / NL_full-depth), cdb} or None; ``client_lag`` over every run.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from cdb_bench.serve.sweep import ItlLists


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _row(mode: str, run: dict[str, Any]) -> str:
    t, p, i, e, n = (run[k] for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "normalized_latency_s"))
    lag = run["client_lag"]["p99_s"]
    wait = run["queue"]["max_waiting"]
    return (
        f"{mode:<10} {run['rate']:>8.4g} {run['completed']:>4d}/{run['requests']:<4d} {run['output_throughput']:>8.1f} "
        f"{run['request_throughput']:>6.2f} {run['goodput']:>6.2f} {_ms(t['mean']):>7} {_ms(t['p99']):>7} "
        f"{_ms(p['mean']):>6} {_ms(p['p99']):>6} {_ms(i['p99']):>6} {_ms(e['p50']):>7} {_ms(e['p99']):>7} "
        f"{_ms(n['mean']):>6} {_ms(n['p99']):>6} {wait if wait is not None else '-':>5} {_ms(lag):>6}"
    )


def table(s: dict[str, Any]) -> str:
    """The readable summary: one row per mode and rate, then knees, knee ratio, cut and client lag."""
    c, w = s["config"], s["workload"]
    depth = w["depth"]
    depths = f"replayed depths mean {depth['mean']:g} in [{depth['min']}, {depth['max']}]" if depth else "live depths"
    lines = [
        f"model {c['model']} ({s['model']['arch']}, max depth {s['model']['max_depth']})  target {c['target']}  "
        f"width {c['max_num_seqs']}",
        f"{w['dataset']}-like lengths x{w['scale']:g} (mean prompt {w['mean_prompt_tokens']:.1f}, output "
        f"{w['mean_output_tokens']:.1f})  {w['requests']} requests per rate  {w['arrival']} arrivals"
        + (f" (CV {w['cv']:g})" if w["arrival"] == "gamma" else "")
        + f"  {depths}",
        f"SLO TTFT <= {c['slo_ttft_s']:g} s, TPOT <= {c['slo_tpot_s']:g} s;  knee bound: mean NL < "
        f"{1e3 * c['latency_bound_s']:g} ms/token",
        "",
        f"{'mode':<10} {'req/s':>8} {'done':>9} {'tok/s':>8} {'req/s':>6} {'good/s':>6} {'TTFT':>7} {'p99':>7} "
        f"{'TPOT':>6} {'p99':>6} {'ITLp99':>6} {'E2Ep50':>7} {'p99':>7} {'NL':>6} {'p99':>6} {'wait':>5} "
        f"{'lagp99':>6}",
        f"{'':<10} {'offered':>8} {'':>9} {'':>8} {'':>6} {'':>6} {'(ms)':>7}",
    ]
    for mode, m in s["modes"].items():
        lines += [_row(mode, run) for run in m["runs"]]
    lines.append("")
    for mode, m in s["modes"].items():
        k = m["knee"]
        shown = "below the lowest rate" if k["rate"] is None else f"{'>= ' if k['censored'] else ''}{k['rate']:.4g}"
        lines.append(f"knee {mode:<10} {shown} req/s  ({k['bisect_steps']} bisection steps)")
    ratio = s["knee_ratio_cdb_over_full_depth"]
    lines.append(f"knee ratio cdb / full-depth: {'-' if ratio is None else f'{ratio:.3f}'}")
    cut = s["cut_at_full_depth_knee"]
    if cut is not None:
        parts = ", ".join(f"{m} {'-' if v is None else f'{100 * v:.1f} %'}" for m, v in cut["cut"].items())
        lines.append(f"normalized-latency cut at full-depth's knee ({cut['rate']:.4g} req/s): {parts or '-'}")
    lag = s["client_lag"]
    lines.append(f"client lag: mean {_ms(lag['mean_s'])} ms, p99 {_ms(lag['p99_s'])} ms, max {_ms(lag['max_s'])} ms")
    return "\n".join(lines)


def with_itls(summary: dict[str, Any], itls: ItlLists) -> dict[str, Any]:
    """A copy of ``summary`` whose runs also hold each request's ITL list (``per_request.itl_s``)."""
    out = copy.deepcopy(summary)
    for mode, m in out["modes"].items():
        for run in m["runs"]:
            run["per_request"]["itl_s"] = itls[mode][run["rate"]]
    return out


def write_outputs(summary: dict[str, Any], itls: ItlLists, out_dir: str) -> list[Path]:
    """``serve.json`` and the three plots under ``out_dir``; returns the paths written."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "serve.json"
    path.write_text(json.dumps(with_itls(summary, itls), indent=1))
    return [path, *plot(summary, d)]


def plot(s: dict[str, Any], d: Path) -> list[Path]:
    """The three PNG plots (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    bound_ms = 1e3 * s["config"]["latency_bound_s"]
    for name, key, stat, label in (
        ("nl_vs_rate.png", "normalized_latency_s", "mean", "mean normalized latency (ms / output token)"),
        ("ttft_p99_vs_rate.png", "ttft_s", "p99", "p99 TTFT (ms)"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode, m in s["modes"].items():
            pts = [(r["rate"], r[key][stat]) for r in m["runs"] if r[key][stat] is not None]
            ax.plot([p[0] for p in pts], [1e3 * p[1] for p in pts], marker="o", label=mode)
        if key == "normalized_latency_s":
            ax.axhline(bound_ms, linestyle="--", color="grey", label="bound")
        ax.set(xlabel="request rate (req/s)", ylabel=label, title=f"{s['config']['model']}: {label.split(' (')[0]}")
        ax.legend()
        ax.grid(alpha=0.3)
        paths.append(_save(fig, d / name))
    paths.append(_cdf(s, d / "nl_cdf_at_knee.png"))
    return paths


def _cdf(s: dict[str, Any], path: Path) -> Path:
    import matplotlib.pyplot as plt

    cut = s["cut_at_full_depth_knee"]
    fig, ax = plt.subplots(figsize=(6, 4))
    if cut is None:
        ax.text(0.5, 0.5, "no full-depth knee measured", ha="center", va="center", transform=ax.transAxes)
    else:
        for mode, m in s["modes"].items():
            run = next((r for r in m["runs"] if r["rate"] == cut["rate"]), None)
            if run is None:
                continue
            xs = sorted(1e3 * x for x in run["per_request"]["normalized_latency_s"] if x is not None)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs[:1] + xs, [0.0, *ys], where="post", label=mode)
        ax.set(
            xlabel="normalized latency (ms / output token)",
            ylabel="fraction of requests",
            title=f"CDF at full-depth's knee rate ({cut['rate']:.4g} req/s)",
        )
        ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
