"""What ``cdb bench serve`` shows: a table on stdout, and with ``--out DIR`` ``serve.json`` and three PNG plots.

- ``nl_vs_rate.png``: mean normalized latency vs request rate, one curve per mode, the bound dashed;
- ``ttft_p99_vs_rate.png``: p99 TTFT vs request rate, one curve per mode;
- ``nl_cdf_at_knee.png``: the CDF of per-request normalized latency at full depth's knee rate, one curve per mode;
- ``summary.json``: ``serve.json`` without the per-request lists and queue samples.

The ``--json`` object (``serve.json``: the same plus every request's inter-token latencies, ``per_request.itl_s``):

- ``config``: every option; ``model``: name, arch, max_depth, vocab_size, token limits, F0_over_Fr;
  ``workload``: dataset, its fit (mu, sigma, clip, target means, source), scale, requests, mean lengths, arrival
  process and CV, seed, replayed depth distribution (None: live);
- ``modes.<mode>.runs[]`` (by rate): rate, source (sweep | bisect | reference-knee), requests, completed, failed,
  errors, duration_s, output_tokens, output_throughput, request_throughput, goodput, slo_attainment, mean_depth,
  the vLLM-named figures (``vllm_fields``: duration, total_input_tokens, mean_ttft_ms, p99_itl_ms, ...),
  ``ttft_s`` / ``tpot_s`` / ``itl_s`` / ``e2e_s`` / ``normalized_latency_s`` each {mean, p50, p90, p99},
  client_lag {mean_s, p99_s, max_s}, queue {interval_s, samples [[t, waiting, running]], mean/max waiting and
  running}, ops {wall_s, stages.<prelude|loop|head> {ops, compute_s, mean_op_ms, busy}, loop_decode_ops,
  tokens_per_loop_op, loop_decode_op_ms, loop_prefill_ops, loop_prefill_op_ms, tokens_per_head_op},
  per_request {arrival_s, client_lag_s, prompt_tokens, output_tokens,
  ttft_s, tpot_s, e2e_s, normalized_latency_s};
- ``modes.<mode>.knee``: {rate, failing, censored, bisect_steps, bound}; ``knees``: mode -> knee rate;
- ``knee_ratio_cdb_over_full_depth``; ``cut_at_full_depth_knee``: {rate, normalized_latency_s per mode, cut per
  mode (1 - NL_mode / NL_full-depth), cdb} or None; ``client_lag`` over every run; ``spec_nl_over_cdb``: per rate
  both ran, mean normalized latency of ``cdb-spec`` (self-speculative decoding) over ``cdb``'s, or None;
- with ``--repeats`` N > 1: ``repeats[]`` (every repeat's figures in the form above, the first repeat's being the
  top-level ones) and ``across_repeats``: ``mean_normalized_latency_s.<mode>.<rate>`` {per_repeat, median, min,
  max} at every swept rate; ``cdb_nl_over.<mode>.<rate>`` {per_repeat, median} (NL_cdb / NL_mode); ``knees.<mode>``,
  ``knee_ratio_cdb_over_full_depth`` and ``cut_at_full_depth_knee`` each {per_repeat, median}. The plots then show
  the median over repeats at the swept rates, with bars from the lowest to the highest repeat.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from cdb_bench.serve.sweep import ItlLists
from cdb_bench.stats import median_min_max


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
        (w.get("dataset_path") or f"{w['dataset']}-like lengths x{w['scale']:g}")
        + f" (mean prompt {w['mean_prompt_tokens']:.1f}, output "
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
    spec = s.get("spec_nl_over_cdb")
    if spec:
        parts = ", ".join(f"{float(r):.4g} req/s {'-' if v is None else f'{v:.3f}'}" for r, v in spec.items())
        lines.append(f"normalized latency cdb-spec / cdb: {parts}")
    lag = s["client_lag"]
    lines.append(f"client lag: mean {_ms(lag['mean_s'])} ms, p99 {_ms(lag['p99_s'])} ms, max {_ms(lag['max_s'])} ms")
    lines += ["", *_op_lines(s)]
    if "across_repeats" in s:
        lines += ["", *_repeat_lines(s["across_repeats"])]
    return "\n".join(lines)


def _op_lines(s: dict[str, Any]) -> list[str]:
    """Per mode and rate, what the run cost op by op (the first repeat)."""
    lines = [
        "op costs (first repeat): ops, mean compute per op (ms), busy fraction of the run's wall time; loop decode "
        "and prefill ops apart",
        f"{'mode':<10} {'req/s':>8} {'dec ops':>7} {'tok/op':>6} {'ms/op':>6} {'pf ops':>6} {'ms/op':>6} "
        f"{'busy':>5} {'head ops':>8} {'tok/op':>6} {'ms/op':>6} {'busy':>5} {'pre ops':>7} {'ms/op':>6} {'busy':>5}",
    ]

    def num(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for mode, m in s["modes"].items():
        for run in m["runs"]:
            o = run["ops"]
            lp, hd, pr = (o["stages"][k] for k in ("loop", "head", "prelude"))
            lines.append(
                f"{mode:<10} {run['rate']:>8.4g} {o['loop_decode_ops']:>7d} {num(o['tokens_per_loop_op'], '.1f'):>6} "
                f"{num(o['loop_decode_op_ms'], '.2f'):>6} {o['loop_prefill_ops']:>6d} "
                f"{num(o['loop_prefill_op_ms'], '.2f'):>6} {num(lp['busy'], '.2f'):>5} {hd['ops']:>8d} "
                f"{num(o['tokens_per_head_op'], '.1f'):>6} {num(hd['mean_op_ms'], '.2f'):>6} "
                f"{num(hd['busy'], '.2f'):>5} {pr['ops']:>7d} {num(pr['mean_op_ms'], '.2f'):>6} "
                f"{num(pr['busy'], '.2f'):>5}"
            )
    return lines


def _spread(x: dict[str, Any]) -> str:
    if x["median"] is None:
        return "-"
    return f"{_ms(x['median'])} [{_ms(x['min'])}-{_ms(x['max'])}]"


def _repeat_lines(a: dict[str, Any]) -> list[str]:
    """Medians over repeats: NL per mode and swept rate (with the range), cdb's ratio to each mode, knees, cut."""
    nl = a["mean_normalized_latency_s"]
    rates = list(next(iter(nl.values())))
    lines = [
        f"across {a['repeats']} repeats: mean normalized latency (ms/token), median [min-max] at each swept rate",
        f"{'mode':<10} " + " ".join(f"{float(r):>19.4g}" for r in rates),
    ]
    lines += [f"{m:<10} " + " ".join(f"{_spread(v[r]):>19}" for r in rates) for m, v in nl.items()]
    for other, per in a["cdb_nl_over"].items():
        cells = " ".join(f"{'-' if per[r]['median'] is None else format(per[r]['median'], '.3f'):>19}" for r in rates)
        lines.append(f"{'cdb / ' + other:<10} {cells}   (median of the per-repeat ratios)")
    for m, k in a["knees"].items():
        lines.append(f"knee {m:<10} median {_f(k['median'], '.4g')} req/s  ({_fs(k['per_repeat'], '.4g')})")
    r = a["knee_ratio_cdb_over_full_depth"]
    c = a["cut_at_full_depth_knee"]
    lines.append(f"knee ratio cdb / full-depth: median {_f(r['median'], '.3f')}  ({_fs(r['per_repeat'], '.3f')})")
    lines.append(
        f"cut of cdb at full-depth's knee: median {_pct(c['median'])}  "
        f"({', '.join(_pct(x) for x in c['per_repeat'])} at {_fs(c['rates'], '.4g')} req/s)"
    )
    return lines


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _fs(xs: list[float | None], spec: str) -> str:
    return ", ".join(_f(x, spec) for x in xs)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def with_itls(summary: dict[str, Any], itls: ItlLists) -> dict[str, Any]:
    """A copy of ``summary`` whose runs also hold each request's ITL list (``per_request.itl_s``)."""
    out = copy.deepcopy(summary)
    for mode, m in out["modes"].items():
        for run in m["runs"]:
            run["per_request"]["itl_s"] = itls[mode][run["rate"]]
    return out


def slim(summary: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``summary`` without the per-request lists and queue samples of its runs (``summary.json``: every
    figure, small enough to keep beside the plots)."""
    out = copy.deepcopy(summary)
    for figures in [out, *out.get("repeats", [])]:
        for m in figures["modes"].values():
            for run in m["runs"]:
                run.pop("per_request", None)
                run.get("queue", {}).pop("samples", None)
    return out


def write_outputs(summary: dict[str, Any], itls: ItlLists, out_dir: str) -> list[Path]:
    """``serve.json``, ``summary.json`` (``slim``) and the three plots under ``out_dir``; returns the paths."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "serve.json"
    path.write_text(json.dumps(with_itls(summary, itls), indent=1))
    small = d / "summary.json"
    small.write_text(json.dumps(slim(summary), indent=1))
    return [path, small, *plot(summary, d)]


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
        for mode in s["modes"]:
            pts = _series(s, mode, key, stat)
            xs, ys = [p[0] for p in pts], [1e3 * p[1] for p in pts]
            if "repeats" in s:
                err = [[y - 1e3 * p[2] for p, y in zip(pts, ys)], [1e3 * p[3] - y for p, y in zip(pts, ys)]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"{mode} (median, range)")
            else:
                ax.plot(xs, ys, marker="o", label=mode)
        if key == "normalized_latency_s":
            ax.axhline(bound_ms, linestyle="--", color="grey", label="bound")
        ax.set(xlabel="request rate (req/s)", ylabel=label, title=f"{s['config']['model']}: {label.split(' (')[0]}")
        ax.legend()
        ax.grid(alpha=0.3)
        paths.append(_save(fig, d / name))
    paths.append(_cdf(s, d / "nl_cdf_at_knee.png"))
    return paths


def _series(s: dict[str, Any], mode: str, key: str, stat: str) -> list[tuple[float, float, float, float]]:
    """(rate, value, low, high) of ``run[key][stat]`` for a mode: every run of a single sweep; with repeats the
    median, min and max over the repeats at each swept rate (the rates every repeat measured)."""
    if "repeats" not in s:
        runs = s["modes"][mode]["runs"]
        return [(r["rate"], r[key][stat], r[key][stat], r[key][stat]) for r in runs if r[key][stat] is not None]
    out = []
    for rate in s["config"]["rates"]:
        xs = [
            r[key][stat]
            for f in s["repeats"]
            for r in f["modes"][mode]["runs"]
            if r["rate"] == rate and r[key][stat] is not None
        ]
        if xs:
            out.append((rate, *median_min_max(xs)))
    return out


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
