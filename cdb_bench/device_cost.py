"""The synthetic GPU-cost profiles against a real device: ``python -m cdb_bench.device_cost``.

Decode loop ops of the released Ouro-1.4B and Huginn-0125 shapes (random weights, bf16) run through
``StageWorker.execute`` as a loop stage runs them (captured decode graphs on CUDA), over ``width`` tokens with
``context`` KV positions each, one KV depth slot (``single``: what the profile charges). Each op is timed from the
call to the device's idle again (host preparation, launch and kernels: what a stage's op costs the schedule), the
median of ``--repeats`` after a warm-up. Beside it the modelled time of the profile that stands for that device
(``h200:ouro-1.4b``, ``h200:huginn-3.5b``: ``cdb_engine.synthetic_cost``), and the ratio measured / modelled per
point: where it is near 1 the synthetic stages judge the serving path at this device's op speeds; a fixed cost the
roofline leaves out shows as a ratio that falls with the width.

``--eager`` adds the same points without the captured graphs (one launch per kernel), and ``--profile-width W``
writes torch's profiler table of a few ops at width W (graphs and eager): where an op's time goes on this device.

Runs on a CPU too (``--device cpu --dtype float32``, for tests); the figures mean something on the device the
profile names.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from cdb_bench.step_cost import DecodeBench
from cdb_engine.synthetic_cost import MODELS, SyntheticCost, profile_cost
from cdb_model.config import ModelConfig
from cdb_model.kv_layout import KVPolicy
from cdb_model.models import build_model
from cdb_scheduler.plan import Stage

WIDTHS = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (64, 1024)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loop_model(config: ModelConfig, device: str, dtype: torch.dtype) -> Any:
    """The loop stage of ``config`` with torch's random initialisation, on ``device`` in ``dtype``."""
    with torch.device(torch.device(device)):
        return build_model(config, stages={Stage.LOOP}).to(dtype).eval()


def _timed_ops(bench: DecodeBench, width: int, repeats: int) -> list[float]:
    dev, times = bench.worker.device, []
    for i in range(repeats + 2):  # the first two: capture and warm-up
        op = bench.op(width)
        _sync(dev)
        t0 = time.perf_counter()
        bench.worker.execute(op)
        _sync(dev)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


def measure(
    model: Any,
    cost: SyntheticCost,
    *,
    widths: tuple[int, ...] = WIDTHS,
    contexts: tuple[int, ...] = CONTEXTS,
    repeats: int = 20,
    graphs: bool | None = None,
) -> list[dict[str, Any]]:
    """One row per (context, width): measured µs per op (median and fastest), modelled µs, measured / modelled.
    ``graphs``: ``StageWorker``'s ``decode_graphs`` (None: captured on CUDA)."""
    rows = []
    for context in contexts:
        bench = DecodeBench(model, model.config, max(widths), context, policy=KVPolicy.SINGLE, decode_graphs=graphs)
        with torch.inference_mode():
            for width in widths:
                times = _timed_ops(bench, width, repeats)
                modelled = cost.loop.seconds(width, width * context)
                median = statistics.median(times)
                rows.append(
                    {
                        "context": context,
                        "width": width,
                        "measured_us": round(median * 1e6, 1),
                        "fastest_us": round(min(times) * 1e6, 1),
                        "modelled_us": round(modelled * 1e6, 1),
                        "measured_over_modelled": round(median / modelled, 3) if modelled > 0 else None,
                    }
                )
        del bench
        _sync(next(model.parameters()).device)
    return rows


def profile_table(model: Any, width: int, context: int, graphs: bool | None, ops: int = 10) -> str:
    """torch's profiler over ``ops`` decode loop ops at ``width`` (after a warm-up): its table by device time (by host
    time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    bench = DecodeBench(model, model.config, width, context, policy=KVPolicy.SINGLE, decode_graphs=graphs)
    on_cuda = bench.worker.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with torch.inference_mode():
        _timed_ops(bench, width, 1)
        with profile(activities=activities) as prof:
            _timed_ops(bench, width, ops)
    sort = "cuda_time_total" if on_cuda else "cpu_time_total"
    return str(prof.key_averages().table(sort_by=sort, row_limit=25))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cdb_bench.device_cost", description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--profile-device", default="h200", help="the device of the profile compared against")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--eager", action="store_true", help="also measure without captured graphs")
    p.add_argument("--profile-width", type=int, default=0, help="write profiler tables of ops at this width")
    p.add_argument("--out", type=Path, help="also write the JSON here (and the profiler tables beside it)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    report: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "models": {}}
    if args.device.startswith("cuda"):
        report["device_name"] = torch.cuda.get_device_name(torch.device(args.device))
    models = {}
    for name in args.models:
        model = loop_model(ModelConfig.from_hf(MODELS[name], name=name), args.device, getattr(torch, args.dtype))
        cost = profile_cost(args.profile_device, name)
        points = dict(widths=tuple(args.widths), contexts=tuple(args.contexts), repeats=args.repeats)
        entry: dict[str, Any] = {"profile": cost.describe(), "points": measure(model, cost, **points)}
        if args.eager:
            entry["eager_points"] = measure(model, cost, graphs=False, **points)
        report["models"][name], models[name] = entry, model
    # (the profiler last: a graph captured after it ran was seen to fail its capture on CUDA)
    for name, model in models.items() if args.profile_width else ():
        tables = [
            f"== {name}, width {args.profile_width}, context {args.contexts[0]}, graphs {graphs}\n"
            + profile_table(model, args.profile_width, args.contexts[0], graphs)
            for graphs in (None, False)
        ]
        path = args.out.with_name(f"profile_{name}.txt") if args.out else Path(f"profile_{name}.txt")
        path.write_text("\n\n".join(tables))
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
