"""``cdb bench speculative``: self-speculative decoding on one stream at a time, against none, in one invocation.

    cdb bench speculative --max-tokens 48 --out spec-out
    cdb bench speculative --synthetic-cost h200:ouro-1.4b --out spec-synthetic

Prompts are the lines of the model folder's held-out text (``heldout_sample.txt``, the shipped model's domain;
presets without one: seeded random ids), each cut to ``--prompt-tokens`` tokens. Every prompt is generated once per
variant — no speculation, then each fixed draft depth (``--speculative on``), then ``auto`` — alone on the engine
(light load), the variants interleaved prompt by prompt on engines kept alive, greedy unless ``--temperature``.
Reports per variant: the drafts' acceptance, loop ops per generated token (the latency of a lone stream's chain of
ops), tokens per second, the ratio of each to no speculation, and the closed-form expectation of the ops ratio from
the measured acceptance and mean depth (``cdb_scheduler.speculation``); and whether every variant's tokens and
depths equal those without speculation (they must). With ``--synthetic-cost`` the stages model device time (the
tokens mean nothing; drafts agree with probability ``ACCEPT ** k`` of ``--synthetic-depths``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from cdb_bench import outputs
from cdb_engine.config import EngineConfig, RequestParams, Speculative
from cdb_engine.engine import Engine
from cdb_engine.inprocess import shared_model_factory
from cdb_engine.setup import torch_dtype
from cdb_model.loader import DEFAULT_MODEL, is_preset, load_model, resolve_source
from cdb_scheduler.sampling import SamplingParams
from cdb_scheduler.speculation import break_even

QUICK = {"prompts": 2, "max_tokens": 16, "depths": "1"}


def prompts_of(eng: Engine, count: int, length: int, seed: int) -> list[list[int]]:
    """Token ids of ``count`` prompts: held-out lines of the model's folder, else seeded random ids."""
    sample = Path(resolve_source(eng.config.model)) / "heldout_sample.txt"
    if not is_preset(eng.config.model) and sample.is_file():
        lines = [ln for ln in sample.read_text().splitlines() if ln.strip()]
        ids = [eng.tokenizer.encode(ln)[:length] for ln in lines]
        ids = [p for p in ids if p]
        if ids:
            return [ids[i % len(ids)] for i in range(count)]
    rng = random.Random(seed)
    vocab = eng.model_config.vocab_size
    return [[rng.randrange(3, min(vocab, 259)) for _ in range(length)] for _ in range(count)]


def variants(depths: list[int]) -> dict[str, dict[str, Any]]:
    """The engines compared: none, each fixed draft depth, auto."""
    out: dict[str, dict[str, Any]] = {"off": {"speculative": Speculative.OFF}}
    for d in depths:
        out[f"depth {d}"] = {"speculative": Speculative.ON, "speculative_depth": d}
    out["auto"] = {"speculative": Speculative.AUTO}
    return out


def bench(base: EngineConfig, args: argparse.Namespace) -> dict[str, Any]:
    model = None
    if not base.synthetic_cost:
        model = load_model(base.model, dtype=torch_dtype(base.dtype), device=base.device)
    factory = shared_model_factory(model) if model is not None else None
    depths = [int(x) for x in str(args.depths).split(",") if x.strip()]
    engines = {name: Engine(replace(base, **extra), factory).start() for name, extra in variants(depths).items()}
    try:
        first = next(iter(engines.values()))
        prompts = prompts_of(first, args.prompts, args.prompt_tokens, args.seed)
        sampling = SamplingParams(temperature=args.temperature, seed=args.seed)
        params = RequestParams(max_tokens=args.max_tokens, ignore_eos=True, sampling=sampling)
        for eng in engines.values():  # warm-up: one short request each
            eng.generate([prompts[0]], replace(params, max_tokens=4))
        before = {name: _counters(eng) for name, eng in engines.items()}
        wall = dict.fromkeys(engines, 0.0)
        results: dict[str, list[tuple[list[int], list[int]]]] = {name: [] for name in engines}
        for prompt in outputs.progress(prompts, len(prompts), "prompts", not args.no_progress):
            for name, eng in engines.items():
                t0 = time.perf_counter()
                (out,) = eng.generate([prompt], params)
                wall[name] += time.perf_counter() - t0
                results[name].append((out.token_ids, out.depths))
        figures: dict[str, Any] = {}
        for name, eng in engines.items():
            c = {k: v - before[name][k] for k, v in _counters(eng).items()}
            tokens = sum(len(t) for t, _ in results[name])
            decode = tokens - len(prompts)  # token 0 comes from the prefill
            verified = c["accepted"] + c["rejected"]
            figures[name] = {
                "tokens": tokens,
                "wall_s": wall[name],
                "tokens_per_s": tokens / wall[name] if wall[name] else None,
                "loop_ops": c["loop_ops"],
                "loop_ops_per_token": c["loop_ops"] / decode if decode else None,
                "mean_depth": c["loop_steps"] / decode if decode else None,
                "drafts": c["drafts"],
                "acceptance": c["accepted"] / verified if verified else None,
                "wasted_loop_steps": c["wasted"],
                "same_tokens_and_depths": results[name] == results["off"],
            }
        _ratios(figures, depths)
        return {
            "bench": "speculative",
            "model": base.model,
            "synthetic_cost": base.synthetic_cost,
            "synthetic_depths": base.synthetic_depths,
            "prompts": len(prompts),
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "max_depth": first.limits.max_depth,
            "variants": figures,
        }
    finally:
        for eng in engines.values():
            eng.shutdown()


def _counters(eng: Engine) -> dict[str, int]:
    st = eng.sched_stats
    return {
        "loop_ops": st.loop_steps,
        "loop_steps": sum(d * n for d, n in st.depth_hist.items()),
        "drafts": st.spec_drafts,
        "accepted": st.spec_accepted,
        "rejected": st.spec_rejected,
        "wasted": st.spec_wasted_steps,
    }


def _ratios(figures: dict[str, Any], depths: list[int]) -> None:
    """Each variant against no speculation, and the closed form's expected ops ratio at its acceptance."""
    off = figures["off"]
    for name, f in figures.items():
        tps, ops = f["tokens_per_s"], f["loop_ops_per_token"]
        f["speedup_tokens_per_s"] = tps / off["tokens_per_s"] if tps and off["tokens_per_s"] else None
        f["loop_ops_per_token_over_off"] = (
            ops / off["loop_ops_per_token"] if ops and off["loop_ops_per_token"] else None
        )
        d = int(name.split()[1]) if name.startswith("depth") else None
        a, depth = f["acceptance"], off["mean_depth"]
        if d is not None and a is not None and depth:
            f["expected_ops_ratio"] = (a * d + (1 - a) * (depth + 1)) / depth
            f["break_even_acceptance"] = break_even(depth, d)


def _table(s: dict[str, Any]) -> str:
    def num(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    head = f"{s['model']}" + (f" on synthetic stages {s['synthetic_cost']}" if s["synthetic_cost"] else "")
    lines = [
        f"{head}: {s['prompts']} prompts of {s['prompt_tokens']} tokens, {s['max_tokens']} tokens each, one at a time, "
        f"temperature {s['temperature']:g}",
        "",
        f"{'variant':<9} {'accept':>6} {'ops/tok':>7} {'x off':>6} {'expect':>6} {'tok/s':>8} {'x off':>6} "
        f"{'drafts':>6} {'wasted':>6} {'same':>5}",
    ]
    for name, f in s["variants"].items():
        lines.append(
            f"{name:<9} {num(f['acceptance'], '.3f'):>6} {num(f['loop_ops_per_token'], '.2f'):>7} "
            f"{num(f['loop_ops_per_token_over_off'], '.3f'):>6} {num(f.get('expected_ops_ratio'), '.3f'):>6} "
            f"{num(f['tokens_per_s'], '.1f'):>8} {num(f['speedup_tokens_per_s'], '.3f'):>6} {f['drafts']:>6} "
            f"{f['wasted_loop_steps']:>6} {f['same_tokens_and_depths']!s:>5}"
        )
    return "\n".join(lines)


def write_outputs(s: dict[str, Any], out_dir: str) -> list[Path]:
    out = Path(out_dir)
    written = [outputs.write_json(out, "speculative", s)]
    names = list(s["variants"])
    title = f"{Path(s['model']).name}: one stream, self-speculative decoding"
    ops = [s["variants"][n]["loop_ops_per_token"] or 0.0 for n in names]
    written.append(outputs.bars(out / "loop_ops_per_token.png", title, names, ops, "loop ops per generated token"))
    speed = [s["variants"][n]["speedup_tokens_per_s"] or 0.0 for n in names]
    written.append(outputs.bars(out / "speedup.png", title, names, speed, "tokens/s over no speculation"))
    accepted = [n for n in names if s["variants"][n]["acceptance"] is not None]
    if accepted:
        values = [s["variants"][n]["acceptance"] for n in accepted]
        written.append(outputs.bars(out / "acceptance.png", title, accepted, values, "drafts accepted"))
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cdb bench speculative", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset, shipped model or checkpoint folder (Ouro)")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--depths", default="1,2", help="fixed draft depths compared (comma-separated)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--kv-policy", default="last_exited")
    p.add_argument("--synthetic-cost", default="", metavar="SPEC", help="synthetic stages (see cdb bench hostpath)")
    p.add_argument("--synthetic-depths", default="", metavar="MEAN:MIN[:ACCEPT]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a tiny run for CI")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="write speculative.json and PNG plots here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    base = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_policy=args.kv_policy,
        num_threads=args.threads,
        synthetic_cost=args.synthetic_cost,
        synthetic_depths=args.synthetic_depths,
        max_num_seqs=16,
    )
    summary = bench(base, args)
    print(json.dumps(summary, indent=2) if args.json else _table(summary))
    if args.out:
        for path in write_outputs(summary, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0
