"""``cdb bench step``: per preset F0, Fr and the time of one decode loop step over 32 tokens; then what one stage op
costs the host (``cdb_bench.step_cost``): dispatcher calls, kernels, copies and syncs of a decode loop op of the
presets and of the released Ouro-1.4B / Huginn-0125 shapes, and the fixed share of an op's time in tokens' worth
(a least-squares fit of op time over widths 1 .. 64)."""

from __future__ import annotations

import argparse
import multiprocessing
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import torch

from cdb_bench import outputs, step_cost
from cdb_model.attention import PagedKV
from cdb_model.kv import BlockTables, PagedKVPool
from cdb_model.presets import build_preset, preset_config, preset_names
from cdb_scheduler.plan import KVUpdate, Stage


class LoopStepTimer:
    """One decode loop step of a preset over ``tokens`` requests with ``context`` positions each (float32), built
    once and timed on demand."""

    def __init__(self, name: str, tokens: int = 32, context: int = 64) -> None:
        c = preset_config(name)
        self.model = build_preset(name, stages={Stage.LOOP})
        block = 16
        per_req = -(-context // block)
        self.pool = PagedKVPool(
            c.num_loop_layers, 1, tokens * per_req, block, c.num_kv_heads, c.head_dim, dtype=torch.float32, device="cpu"
        )
        self.tables = BlockTables()
        self.tables.apply(KVUpdate(r, tuple(range(r * per_req, (r + 1) * per_req))) for r in range(tokens))
        self.tokens, self.context = tokens, context
        self.positions = torch.full((tokens,), context - 1)
        self.rows = torch.randn(tokens, c.bank_width)

    def ms(self, repeats: int = 20) -> float:
        """The fastest of ``repeats`` steps, in milliseconds."""
        n, pos = self.tokens, self.context - 1
        with torch.inference_mode():
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                kv = PagedKV(self.pool, self.tables, range(n), [pos] * n, [0] * n)
                self.model.loop_step(self.rows, self.positions, torch.zeros(n, dtype=torch.long), kv)
                best = min(best, time.perf_counter() - t0)
        return best * 1e3


def time_loop_step(name: str, tokens: int = 32, context: int = 64, repeats: int = 20) -> float:
    """Milliseconds of one decode loop step over ``tokens`` requests with ``context`` positions each (float32)."""
    return LoopStepTimer(name, tokens, context).ms(repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cdb bench step", description=__doc__)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--out", type=Path, help="write step.json and plots of the step time and the fixed cost here")
    ap.add_argument(
        "--fit-presets", nargs="*", default=["ouro-bench", "huginn-bench"], help="presets whose op time to fit"
    )
    ap.add_argument("--repeats", type=int, default=15, help="repeats per width of the fit (the fastest counts)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{'preset':14} {'F0':>10} {'Fr':>10} {'F0/Fr':>6} {'depth':>5}  ms/step(32 tok)")
    rows: list[dict[str, str | int | float]] = []
    for name in preset_names():
        c = preset_config(name)
        f0, fr = c.param_counts()
        ms = time_loop_step(name)
        rows.append({"preset": name, "F0": f0, "Fr": fr, "max_depth": c.max_depth, "ms_per_step_32_tokens": ms})
        print(f"{name:14} {f0:>10,} {fr:>10,} {f0 / fr:>6.3f} {c.max_depth:>5}  {ms:.2f}")
    costs = host_costs()
    fits = {name: fit_in_fresh_process(name, args.repeats, args.threads) for name in args.fit_presets}
    for name, f in fits.items():
        print(
            f"{name}: decode loop op = {f['fixed_us']:.0f} us fixed + {f['per_token_us']:.1f} us per token "
            f"-> fixed = {f['fixed_in_tokens']} tokens' worth"
        )
    if args.out:
        outputs.write_json(
            args.out, "step", {"threads": args.threads, "presets": rows, "op_costs": costs, "fixed_cost_fits": fits}
        )
        names, times = [str(r["preset"]) for r in rows], [float(r["ms_per_step_32_tokens"]) for r in rows]
        outputs.bars(args.out / "step.png", "one loop step, 32 tokens", names, times, "ms")
        series = {n: ([float(w) for w in f["widths"]], [t / 1e3 for t in f["us_per_op"]]) for n, f in fits.items()}
        outputs.lines(args.out / "fixed_cost.png", "decode loop op time vs width", series, "tokens in the op", "ms")
    return 0


def _fit(name: str, repeats: int, threads: int) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    return step_cost.fit_fixed_cost(name, repeats=repeats)


def fit_in_fresh_process(name: str, repeats: int, threads: int) -> dict[str, Any]:
    """``fit_fixed_cost`` in a new interpreter: what ran before in this one (other models, their allocations)
    moves the small ops' times by up to 2x on a CPU."""
    with futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_fit, name, repeats, threads).result()


def host_costs() -> dict[str, dict[str, object]]:
    """Per-op host costs of the presets (CPU) and the released shapes (meta device), printed as a table."""
    costs: dict[str, dict[str, object]] = {}
    for name in ("ouro-bench", "huginn-bench"):
        costs[name] = step_cost.preset_costs(name)
    for name in step_cost.RELEASED:
        costs[name] = step_cost.released_costs(name)
    print(f"\n{'model / op':44} {'calls':>6} {'kernels':>7} {'h2d':>4} {'syncs':>5} {'host us before 1st':>18}")
    for model, ops in costs.items():
        for op, c in ops.items():
            assert isinstance(c, dict)
            print(
                f"{model + ' ' + op:44} {c['dispatcher_calls']:>6} {c['kernels']:>7} {c['host_to_device_copies']:>4} "
                f"{c['syncs_and_copies_out']:>5} {c['host_us_before_first_kernel']:>18}"
            )
    return costs
