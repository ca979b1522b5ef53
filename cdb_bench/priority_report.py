"""``cdb bench priority``'s figures: a run's per-class figures, medians and ratios over rounds, the table, the plot."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdb_bench.serve.metrics import RequestRecord, lag_stats, request_times
from cdb_bench.stats import median, median_range, percentile

POLICIES = ("fifo", "priority", "priority_depth")
CLASSES = ("top", "low")  # priority 0 and 1
Run = tuple[list[RequestRecord], list[tuple[float, int, int]]]  # records, (t, waiting, running) samples


@dataclass(frozen=True, slots=True)
class Round:
    labels: list[int]  # request i's class (an index into CLASSES)
    runs: dict[str, Run]  # "light" and each policy


def ttfts(records: Sequence[RequestRecord]) -> list[float]:
    return [request_times(r).ttft for r in records if r.ok]


def _pct(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def class_figures(records: Sequence[RequestRecord], window: float) -> dict[str, Any]:
    """TTFT p50/p90 (every request: the run is drained), requests completed and tokens streamed in the window per
    second, the mean served depth of the window's tokens (token 0, the prefill's, left out), requests that had no
    token by its end."""
    ttft = ttfts(records)
    depths = [d for r in records for t, d in zip(r.token_s[1:], r.depths[1:]) if t <= window]
    return {
        "requests": len(records),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "completed_per_s": sum(r.ok and (r.finished_s or 0.0) <= window for r in records) / window,
        "tokens_per_s": sum(t <= window for r in records for t in r.token_s) / window,
        "mean_depth": statistics.fmean(depths) if depths else None,
        "not_started_at_end": sum(not r.token_s or r.token_s[0] > window for r in records),
    }


def run_figures(run: Run, labels: Sequence[int], window: float) -> dict[str, Any]:
    """One overload run: per class and overall ``class_figures``; the engine's waiting and running requests at the
    window's end (the nearest counter sample); failures; the client's lag (send - scheduled)."""
    records, samples = run
    _, waiting, running = min(samples, key=lambda s: abs(s[0] - window), default=(0.0, None, None))
    out: dict[str, Any] = {
        c: class_figures([r for r in records if labels[r.index] == k], window) for k, c in enumerate(CLASSES)
    }
    return out | {
        "all": class_figures(records, window),
        "waiting_at_end": waiting,
        "running_at_end": running,
        "failed": sum(not r.ok for r in records),
        "errors": sorted({r.error for r in records if r.error})[:3],
        "client_lag": lag_stats([r.sent_s - r.scheduled_s for r in records if r.sent_s is not None]),
    }


def policy_figures(runs: list[dict[str, Any]], fifo: list[dict[str, Any]], ref: float | None) -> dict[str, Any]:
    """A policy over rounds: the top class's TTFT over the light load's p50, goodput over FIFO's (same round),
    medians of the depths and of the queue at the window's end, every round's figures."""
    each = list(zip(runs, fifo))
    return {
        "top_ttft_p50_over_light": median_range([_ratio(f["top"]["ttft_p50_s"], ref) for f in runs]),
        "top_ttft_p90_over_light": median_range([_ratio(f["top"]["ttft_p90_s"], ref) for f in runs]),
        "goodput_over_fifo": {
            c: {
                key: median_range([_ratio(f[c][field], g[c][field]) for f, g in each])
                for key, field in (("requests", "completed_per_s"), ("tokens", "tokens_per_s"))
            }
            for c in ("all", *CLASSES)
        },
        "mean_depth": {c: median([f[c]["mean_depth"] for f in runs]) for c in CLASSES},
        "waiting_at_end": median([f["waiting_at_end"] for f in runs]),
        "not_started_at_end": {c: median([f[c]["not_started_at_end"] for f in runs]) for c in CLASSES},
        "failed": sum(f["failed"] for f in runs),
        "runs": runs,
    }


def summarize(rounds: list[Round], window: float) -> dict[str, Any]:
    """The light-load reference (the top class's TTFTs of every round's light load, pooled) and each policy."""
    light_top = [t for rd in rounds for t in ttfts([r for r in rd.runs["light"][0] if rd.labels[r.index] == 0])]
    light_all = [t for rd in rounds for t in ttfts(rd.runs["light"][0])]
    ref = _pct(light_top, 50)
    figs = {p: [run_figures(rd.runs[p], rd.labels, window) for rd in rounds] for p in POLICIES}
    policies = {p: policy_figures(figs[p], figs["fifo"], ref) for p in POLICIES}
    p50 = {p: policies[p]["top_ttft_p50_over_light"]["median"] for p in POLICIES}
    return {
        "light_load": {
            "top": {"requests": len(light_top), "ttft_p50_s": ref, "ttft_p90_s": _pct(light_top, 90)},
            "all": {"requests": len(light_all), "ttft_p50_s": _pct(light_all, 50), "ttft_p90_s": _pct(light_all, 90)},
            "failed": sum(not r.ok for rd in rounds for r in rd.runs["light"][0]),
        },
        "top_ttft_p50_over_light": p50,
        "top_within_2x_of_light": {p: v is not None and v <= 2.0 for p, v in p50.items()},
        "policies": policies,
    }


def _mr(r: dict[str, float | None], fmt: str = ".2f") -> str:
    if r["median"] is None:
        return "-"
    return f"{r['median']:{fmt}} ({r['min']:{fmt}}-{r['max']:{fmt}})"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def table(s: dict[str, Any]) -> str:
    light = s["light_load"]["top"]
    lines = [
        f"{s['model']}{' (synthetic ' + s['synthetic_cost'] + ')' if s['synthetic_cost'] else ''}, width "
        f"{s['max_num_seqs']}: capacity {s['capacity_rps']:.1f} requests/s (closed loop); {s['overload']:g}x for "
        f"{s['seconds']:g} s, top share {s['top_share']:g}, floor {s['floor']:g}, {s['rounds']} rounds",
        f"light load ({s['light']:g}x): top class TTFT p50 {_num(light['ttft_p50_s'] and 1e3 * light['ttft_p50_s'])}"
        f" ms, p90 {_num(light['ttft_p90_s'] and 1e3 * light['ttft_p90_s'])} ms ({light['requests']} requests)",
        f"{'policy':<16}{'top TTFT p50 / light':>24}{'p90 / light p50':>24}{'req/s / FIFO':>20}{'tok/s / FIFO':>20}"
        f"{'top tok/s':>11}{'low tok/s':>11}{'depth top':>10}{'depth low':>10}{'waiting':>9}",
    ]
    for p, f in s["policies"].items():
        g = f["goodput_over_fifo"]
        lines.append(
            f"{p:<16}{_mr(f['top_ttft_p50_over_light']):>24}{_mr(f['top_ttft_p90_over_light']):>24}"
            f"{_mr(g['all']['requests'], '.3f'):>20}{_mr(g['all']['tokens'], '.3f'):>20}"
            f"{_num(g['top']['tokens']['median'], '.3f'):>11}{_num(g['low']['tokens']['median'], '.3f'):>11}"
            f"{_num(f['mean_depth']['top']):>10}{_num(f['mean_depth']['low']):>10}{_num(f['waiting_at_end'], 'g'):>9}"
        )
    return "\n".join(lines)


def plot(s: dict[str, Any], path: Path) -> Path:
    """Four panels: the top class's TTFT over light load, tokens/s over FIFO per class, depth per class, queue."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.container import BarContainer

    pol = s["policies"]
    names = list(pol)
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    panels = (
        (ax[0, 0], ("p50", "p90"), lambda p, k: pol[p][f"top_ttft_{k}_over_light"]["median"], "top TTFT / light p50"),
        (ax[0, 1], ("all", *CLASSES), lambda p, k: pol[p]["goodput_over_fifo"][k]["tokens"]["median"], "tok/s / FIFO"),
        (ax[1, 0], CLASSES, lambda p, k: pol[p]["mean_depth"][k], "mean served depth (window)"),
    )
    for a, keys, get, label in panels:
        step = 0.8 / len(keys)
        for j, k in enumerate(keys):
            xs = [i + step * (j - (len(keys) - 1) / 2) for i in range(len(names))]
            a.bar(xs, [get(p, k) or 0 for p in names], step, label=k)
        a.set_xticks(range(len(names)), names)
        a.set_ylabel(label)
        a.legend()
    ax[0, 0].set_yscale("log")
    ax[0, 0].axhline(2.0, color="grey", linestyle="--")
    ax[1, 1].bar(names, [pol[p]["waiting_at_end"] or 0 for p in names], color="#9467bd")
    ax[1, 1].set_ylabel("requests waiting at the window's end")
    for a in ax.flat:
        a.grid(axis="y", alpha=0.3)
        for bars in a.containers:
            if isinstance(bars, BarContainer):
                a.bar_label(bars, fmt="%.3g")
    synthetic = " synthetic" if s["synthetic_cost"] else ""
    fig.suptitle(f"priorities at {s['overload']:g}x capacity: {s['model']}{synthetic}, width {s['max_num_seqs']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
