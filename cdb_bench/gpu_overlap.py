"""Do the stage processes' kernels overlap on one device, or serialise? ``python -m cdb_bench.gpu_overlap``.

Each of ``--procs`` processes (like the three stage servers) runs ``--iters`` matrix products of ``--size``; first
one process at a time, then all at once. ``overlap`` = (sum of the lone times) / (the concurrent wall time): 1.0
means the device ran them one after another (time-slicing between processes, the default without NVIDIA MPS),
up to ``procs`` means they ran side by side. Run it with and without MPS (``nvidia-cuda-mps-control -d``) to see
what the stage split costs on a GPU. Works on a CPU too (``--device cpu``, for tests).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from typing import Any

import torch


def _work(device: str, size: int, iters: int, dtype: str, start: Any, ready: Any, done: Any) -> None:
    dt = getattr(torch, dtype)
    a = torch.randn(size, size, device=device, dtype=dt)
    b = torch.randn(size, size, device=device, dtype=dt)
    (a @ b).sum().item()  # warm up (allocations, kernels)
    ready.put(True)
    start.wait()
    t0 = time.perf_counter()
    for _ in range(iters):
        a = (a @ b) * 1e-3
    a.sum().item()  # synchronise
    done.put(time.perf_counter() - t0)


def _run(n: int, args: argparse.Namespace) -> tuple[float, list[float]]:
    ctx = mp.get_context("spawn")  # CUDA needs spawned children
    start, ready, done = ctx.Event(), ctx.Queue(), ctx.Queue()
    work = (args.device, args.size, args.iters, args.dtype, start, ready, done)
    procs = [ctx.Process(target=_work, args=work) for _ in range(n)]
    for p in procs:
        p.start()
    for _ in procs:  # every child has allocated and warmed up before the clock starts
        ready.get(timeout=600)
    t0 = time.perf_counter()
    start.set()
    each = [done.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    return wall, each


def measure(args: argparse.Namespace) -> dict[str, Any]:
    alone = [_run(1, args)[0] for _ in range(args.procs)]
    together, each = _run(args.procs, args)
    return {
        "device": args.device,
        "procs": args.procs,
        "size": args.size,
        "iters": args.iters,
        "dtype": args.dtype,
        "alone_s": alone,
        "together_wall_s": together,
        "together_each_s": each,
        "overlap": sum(alone) / together,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cdb_bench.gpu_overlap", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--procs", type=int, default=3)
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = measure(args)
    alone = ", ".join(f"{t:.3f}" for t in out["alone_s"])
    line = f"alone {alone} s; together {out['together_wall_s']:.3f} s; overlap {out['overlap']:.2f} of {args.procs}"
    print(json.dumps(out, indent=2) if args.json else line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
