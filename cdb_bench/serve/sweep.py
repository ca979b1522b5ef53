"""The rate sweep of every mode, its capacity knee, and the comparisons between modes.

Per mode: one target (a fresh engine or process tree), warmed up with a few short requests; then every swept
rate, then ``bisect`` midpoints between the highest passing and the lowest failing rate (``knee``). Full depth
runs first, so that every other mode is also measured at full depth's knee rate: the normalized-latency cut
there is 1 - NL_mode / NL_full-depth. A run with a failed request counts as over the bound.

Every run also carries its figures under vLLM's names (``vllm_fields``) and reports its op costs (``ops``: per
stage ops, compute and busy fraction; tokens per loop and per head op), read from the target's counters before and
after it. ``repeats`` > 1 runs the whole sweep again (every
mode, a fresh target each) and adds ``repeats`` (each repeat's figures) and ``across_repeats``: per mode and swept
rate the median, min and max of the mean normalized latency; the per-repeat ratios of cdb's to every other mode's
at each swept rate and their median; the knees, knee ratios and cuts of every repeat and their medians.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tqdm import tqdm

from cdb_bench.serve.driver import drive
from cdb_bench.serve.knee import Knee, find_knee, knee_ratio, latency_cut, passes
from cdb_bench.serve.metrics import (
    RequestRecord,
    Slo,
    itl_lists,
    lag_stats,
    op_summary,
)
from cdb_bench.serve.requests import RequestSet, ServeRequest, warmup_requests
from cdb_bench.serve.targets import Target, open_target
from cdb_bench.serve.vllm_fields import run_figures
from cdb_bench.stats import median, median_range
from cdb_engine.config import EngineConfig, Speculative
from cdb_engine.setup import torch_dtype
from cdb_model.loader import load_model
from cdb_scheduler.config import Mode

REFERENCE = "full-depth"
SPECULATIVE = "cdb-spec"  # cdb with self-speculative decoding (auto); every other mode runs without it
MODE_NAMES = (*(m.value for m in Mode), SPECULATIVE)


def mode_config(base: EngineConfig, mode: str) -> EngineConfig:
    """The engine of one benchmarked mode: a scheduling mode without speculation, or ``cdb-spec``."""
    if mode == SPECULATIVE:
        return replace(base, mode=Mode.CDB, speculative=Speculative.AUTO)
    return replace(base, mode=Mode(mode), speculative=Speculative.OFF)


@dataclass(frozen=True, slots=True)
class SweepConfig:
    target: str
    modes: tuple[str, ...]
    rates: tuple[float, ...]
    slo: Slo
    latency_bound: float  # seconds per output token
    bisect: int = 0
    warmup: int = 4
    sample_interval: float = 0.1
    request_timeout: float = 600.0
    progress: bool = True
    repeats: int = 1
    max_concurrency: int | None = None  # requests in flight at most (None: no cap)
    percentiles: tuple[float, ...] = (50, 90, 99)  # of the vLLM-named figures
    burstiness: float = 1.0  # the gamma shape of the arrivals (1: Poisson), reported with them


def mean_nl(run: dict[str, Any]) -> float | None:
    """A run's mean normalized latency; None (over any bound) if a request failed."""
    return None if run["failed"] else run["normalized_latency_s"]["mean"]


async def _session(
    target: Target, requests: Sequence[ServeRequest], sc: SweepConfig, on_done: Callable[[], None] | None
) -> tuple[list[RequestRecord], list[tuple[float, int, int]]]:
    conn = await target.connect()
    try:
        return await drive(
            conn, requests, sample_interval=sc.sample_interval, on_done=on_done, max_concurrency=sc.max_concurrency
        )
    finally:
        await target.disconnect(conn)


def measure(
    target: Target, requests: Sequence[ServeRequest], rate: float, sc: SweepConfig, label: str
) -> tuple[dict[str, Any], list[list[float]]]:
    """One open-loop run: its summary (``metrics.summarize_run`` + ``queue``) and every request's ITLs."""
    bar = tqdm(total=len(requests), desc=label, unit="req", leave=False, disable=not sc.progress, file=sys.stderr)
    before = target.counters()
    try:
        records, samples = asyncio.run(_session(target, requests, sc, lambda: bar.update(1)))
    finally:
        bar.close()
    cost = target.counters().delta(before)
    summary = run_figures(records, samples, rate, sc)
    summary["ops"] = op_summary(cost, summary["output_tokens"], summary["duration_s"])
    return summary, itl_lists(records)


@dataclass(slots=True)
class ModeRuns:
    """Every run of one mode, by rate."""

    mode: str
    runs: dict[float, dict[str, Any]]
    itls: dict[float, list[list[float]]]
    knee: Knee | None = None


def sweep_mode(
    target: Target, mode: str, reqs: RequestSet, sc: SweepConfig, extra_rate: float | None, tag: str = ""
) -> ModeRuns:
    """Warm-up, the swept rates, the knee's bisection, and ``extra_rate`` (the reference's knee) if new."""
    out = ModeRuns(mode, {}, {})
    asyncio.run(_session(target, warmup_requests(reqs, sc.warmup), sc, None))

    def at(rate: float, source: str) -> float | None:
        if rate not in out.runs:
            run, itl = measure(target, reqs.at(rate), rate, sc, f"{tag}{mode} @ {rate:.4g} req/s")
            run["source"] = source
            out.runs[rate], out.itls[rate] = run, itl
            nl = mean_nl(run)
            verdict = "under" if passes(nl, sc.latency_bound) else "over"
            shown = f"{1e3 * nl:.2f} ms/token" if nl is not None else f"{run['failed']} failed"
            if sc.progress:
                tqdm.write(
                    f"{tag}{mode:<10} {rate:>8.4g} req/s  mean NL {shown}  ({verdict} the bound)", file=sys.stderr
                )
        return mean_nl(out.runs[rate])

    for rate in sc.rates:
        at(rate, "sweep")
    swept = {r: mean_nl(out.runs[r]) for r in sc.rates}
    out.knee = find_knee(swept, sc.latency_bound, sc.bisect, lambda r: at(r, "bisect"))
    if extra_rate is not None:
        at(extra_rate, "reference-knee")
    return out


ItlLists = dict[str, dict[float, list[list[float]]]]  # mode -> rate -> each request's inter-token latencies


def run_sweep(base: EngineConfig, reqs: RequestSet, sc: SweepConfig) -> tuple[dict[str, Any], ItlLists]:
    """Every mode of ``sc`` on ``reqs``, ``sc.repeats`` times: the first repeat's figures (per-mode runs and knees,
    the knee ratio, the cut, the client's lag), with ``repeats`` and ``across_repeats`` when there are more, and
    the first repeat's per-request ITL lists."""
    model = None
    if sc.target == "in-process" and not base.synthetic_cost:  # synthetic stages model time: no weights
        model = load_model(base.model, dtype=torch_dtype(base.dtype), device=base.device)
    order = sorted(sc.modes, key=lambda m: m != REFERENCE)
    every: list[dict[str, Any]] = []
    first_itls: ItlLists = {}
    for rep in range(sc.repeats):
        tag = f"[{rep + 1}/{sc.repeats}] " if sc.repeats > 1 else ""
        results: dict[str, ModeRuns] = {}
        for mode in order:
            ref = results.get(REFERENCE)
            extra = ref.knee.rate if ref is not None and ref.knee is not None else None
            cfg = mode_config(base, mode)
            with open_target(sc.target, cfg, model=model, max_live=len(reqs.requests), timeout=sc.request_timeout) as t:
                results[mode] = sweep_mode(t, mode, reqs, sc, extra, tag)
        every.append(assemble(results, [m for m in sc.modes if m in results]))
        if rep == 0:
            first_itls = {m: r.itls for m, r in results.items()}
    out = dict(every[0])
    if sc.repeats > 1:
        out["repeats"] = every
        out["across_repeats"] = across_repeats(every, sc.rates)
    return out, first_itls


def _nl_at(figures: dict[str, Any], mode: str, rate: float) -> float | None:
    run = next((r for r in figures["modes"][mode]["runs"] if r["rate"] == rate), None)
    return None if run is None else mean_nl(run)


def across_repeats(every: Sequence[dict[str, Any]], rates: Sequence[float]) -> dict[str, Any]:
    """The spread over repeats (see the module docstring); ``None`` marks a repeat where a figure is unknown."""
    modes = list(every[0]["modes"])
    nl: dict[str, Any] = {}
    for m in modes:
        nl[m] = {}
        for rate in rates:
            xs = [_nl_at(f, m, rate) for f in every]
            nl[m][str(rate)] = {"per_repeat": xs, **median_range(xs)}
    ratios: dict[str, Any] = {}
    if "cdb" in modes:
        for other in (m for m in modes if m != "cdb"):
            ratios[other] = {}
            for rate in rates:
                per = []
                for f in every:
                    a, b = _nl_at(f, "cdb", rate), _nl_at(f, other, rate)
                    per.append(a / b if a is not None and b else None)
                ratios[other][str(rate)] = {"per_repeat": per, "median": median(per)}
    knees = {m: [f["knees"].get(m) for f in every] for m in modes}
    ratio = [f["knee_ratio_cdb_over_full_depth"] for f in every]
    cuts = [None if f["cut_at_full_depth_knee"] is None else f["cut_at_full_depth_knee"]["cdb"] for f in every]
    cut_rates = [None if f["cut_at_full_depth_knee"] is None else f["cut_at_full_depth_knee"]["rate"] for f in every]
    return {
        "repeats": len(every),
        "mean_normalized_latency_s": nl,
        "cdb_nl_over": ratios,  # per swept rate: NL_cdb / NL_other per repeat, and the median
        "knees": {m: {"per_repeat": ks, "median": median(ks)} for m, ks in knees.items()},
        "knee_ratio_cdb_over_full_depth": {"per_repeat": ratio, "median": median(ratio)},
        "cut_at_full_depth_knee": {"per_repeat": cuts, "rates": cut_rates, "median": median(cuts)},
    }


def assemble(results: dict[str, ModeRuns], modes: Sequence[str]) -> dict[str, Any]:
    """The figures of every mode and the comparisons (knee ratio cdb / full-depth, NL cut at its knee)."""
    knees = {m: r.knee for m, r in results.items() if r.knee is not None}
    out_modes = {
        m: {"runs": [results[m].runs[r] for r in sorted(results[m].runs)], "knee": knees[m].as_dict()} for m in modes
    }
    lags = [
        x
        for r in results.values()
        for run in r.runs.values()
        for x in run["per_request"]["client_lag_s"]
        if x is not None
    ]
    return {
        "modes": out_modes,
        "knees": {m: k.rate for m, k in knees.items()},
        "knee_ratio_cdb_over_full_depth": knee_ratio(knees),
        "cut_at_full_depth_knee": _cut(results),
        "client_lag": lag_stats(lags),
        "spec_nl_over_cdb": _spec_ratios(results),
    }


def _spec_ratios(results: dict[str, ModeRuns]) -> dict[str, float | None] | None:
    """Per rate both ran: mean normalized latency of ``cdb-spec`` over ``cdb``'s (None without both modes)."""
    spec, cdb = results.get(SPECULATIVE), results.get(Mode.CDB.value)
    if spec is None or cdb is None:
        return None
    out: dict[str, float | None] = {}
    for rate in sorted(set(spec.runs) & set(cdb.runs)):
        a, b = mean_nl(spec.runs[rate]), mean_nl(cdb.runs[rate])
        out[str(rate)] = a / b if a is not None and b else None
    return out


def _cut(results: dict[str, ModeRuns]) -> dict[str, Any] | None:
    ref = results.get(REFERENCE)
    if ref is None or ref.knee is None or ref.knee.rate is None:
        return None
    rate = ref.knee.rate
    nl = {m: mean_nl(r.runs[rate]) if rate in r.runs else None for m, r in results.items()}
    cuts = {m: latency_cut(v, nl[REFERENCE]) for m, v in nl.items() if m != REFERENCE}
    return {"rate": rate, "normalized_latency_s": nl, "cut": cuts, "cdb": cuts.get("cdb")}
