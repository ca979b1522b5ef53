"""``cdb bench routing``: which replica should a client send each request to? Simulated, then measured.

    cdb bench routing --quick                                   # the simulation only, small (CI)
    cdb bench routing --out docs/figures/routing --live          # + the best two policies on 3 real replicas

1. Measure the model's loop-step and head cost against batch size on this machine (``cdb_bench.routing.costs``;
   ``--costs`` gives them instead).
2. Draw the workload once (``cdb_bench.routing.workload``: the serving benchmark's ShareGPT-like lengths, scaled,
   replayed depths, Poisson arrivals, a deep fraction) and size segregation to it (``policies.balanced_split``).
3. Simulate K replicas of continuous depth batching (``cdb_bench.routing.sim``) under every policy at every load
   (a fraction of the estimated capacity), the same requests each time; rank the policies by mean normalized
   latency.
4. With ``--live``: start K local replicas and run the best two through the real clients, open loop, at
   ``--live-rates``, ``--live-repeats`` times interleaved (``cdb_bench.routing.live``); simulate those rates too.
5. Decide the client default: the best policy only if it beats round-robin by ``--margin`` at every load from
   ``--min-load`` on and at every live rate (``report.decide``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from cdb_bench.routing.costs import StepCosts, measure_costs
from cdb_bench.routing.live import local_replicas, run_policy, warm_up
from cdb_bench.routing.policies import POLICIES, Policy, Segregation, balanced_split, make_policy
from cdb_bench.routing.report import decide, rank, table, write_outputs
from cdb_bench.routing.sim import simulate, summarize
from cdb_bench.routing.workload import Workload, make_workload
from cdb_bench.serve.lengths import DATASETS
from cdb_bench.serve.options import parse_with_quick, positive_floats
from cdb_engine.config import EngineConfig, Speculative
from cdb_model.presets import preset_config, preset_names

QUICK: dict[str, Any] = {"requests": 400, "loads": "0.5,0.9", "model": "ouro-tiny"}


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if not names or any(p not in POLICIES for p in names) or "round-robin" not in names:
        raise argparse.ArgumentTypeError(f"policies among {', '.join(POLICIES)}, round-robin included; got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cdb bench routing", description=__doc__.split("\n\n")[0] if __doc__ else "")
    p.add_argument("--model", choices=preset_names(), default="ouro-bench", help="preset whose costs are measured")
    p.add_argument(
        "--costs",
        metavar="LOOP_BASE,LOOP_PER_TOKEN,HEAD_BASE,HEAD_PER_TOKEN",
        type=positive_floats,
        help="milliseconds, instead of measuring",
    )
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--width", type=int, default=8, help="slots per replica (max_num_seqs)")
    p.add_argument("--policies", type=_policies, default="round-robin,least-outstanding,segregation")
    p.add_argument("--loads", type=positive_floats, default="0.3,0.5,0.7,0.85,0.95", help="fractions of the capacity")
    p.add_argument("--requests", type=int, default=3000, help="simulated requests per run")
    p.add_argument("--dataset", choices=sorted(DATASETS), default="sharegpt")
    p.add_argument("--scale", type=float, default=0.1)
    p.add_argument("--depth-mean", type=float, default=2.5)
    p.add_argument("--depth-min", type=int, default=2)
    p.add_argument("--deep-fraction", type=float, default=0.2, help="requests served at full depth (q = 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--live", action="store_true", help="also run the best two policies on real local replicas")
    p.add_argument("--live-rates", type=positive_floats, default="8,16", help="real run: request rates (req/s)")
    p.add_argument("--live-requests", type=int, default=100, help="real run: requests per run")
    p.add_argument("--live-repeats", type=int, default=2)
    p.add_argument("--margin", type=float, default=0.10, help="the cut in mean NL that makes a new default")
    p.add_argument("--min-load", type=float, default=0.5, help="the margin must hold from this load on")
    p.add_argument(
        "--quick", action="store_true", help="a small run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
    )
    p.add_argument("--json", action="store_true", help="print the JSON instead of the tables")
    p.add_argument("--out", help="write routing.json and routing.png here")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    converters = {"loads": positive_floats, "policies": _policies, "live_rates": positive_floats}
    args = parse_with_quick(parser, argv, QUICK, converters)
    if args.costs is not None and len(args.costs) != 4:
        parser.error("--costs: four numbers (ms): loop base, loop per token, head base, head per token")
    if args.replicas < 2 or args.width < 1 or args.requests < 10 or args.live_requests < 1 or args.live_repeats < 1:
        parser.error("--replicas >= 2, --width >= 1, --requests >= 10, --live-requests and --live-repeats >= 1")
    if not 0 < args.margin < 1 or args.scale <= 0:
        parser.error("--margin in (0, 1) and --scale > 0 are required")
    return args


def _costs(args: argparse.Namespace) -> tuple[StepCosts, dict[str, Any] | None]:
    depth = preset_config(args.model).max_depth
    if args.costs is not None:
        a, b, c, d = (x / 1e3 for x in args.costs)
        return StepCosts(a, b, c, d, depth, "given (--costs)"), None
    return measure_costs(args.model, width=args.width)


def _policy(name: str, replicas: int, seg: Segregation) -> Policy:
    return make_policy(name, replicas, heavy_replicas=len(seg.heavy), long_tokens=seg.long_tokens)


def simulate_all(
    wl: Workload, costs: StepCosts, policies: Sequence[str], rates: Sequence[float], *, width: int, seg: Segregation
) -> dict[str, list[dict[str, Any]]]:
    """Every policy at every rate, on ``seg``'s replicas: the ``summarize`` of each run."""
    k = len(seg.heavy) + len(seg.light)
    out: dict[str, list[dict[str, Any]]] = {}
    for name in policies:
        out[name] = []
        for rate in rates:
            done = simulate(wl.at(rate), _policy(name, k, seg), costs, replicas=k, width=width)
            out[name].append(summarize(done, replicas=k, heavy=seg.is_heavy) | {"rate": rate})
    return out


def run_live(args: argparse.Namespace, wl: Workload, costs: StepCosts, seg: Segregation, best: list[str]) -> dict:
    """The real run of ``best`` (round-robin added as the baseline if missing) and the simulation at its rates."""
    policies = best if "round-robin" in best else [*best, "round-robin"]
    n = args.live_requests
    small = replace(wl, requests=wl.requests[:n], unit_gaps=wl.unit_gaps[:n])
    cfg = EngineConfig(
        model=args.model,
        max_num_seqs=args.width,
        allow_replay_depths=True,
        max_waiting=n,
        num_kv_blocks=1024,
        speculative=Speculative.OFF,  # the routing's figures: each replica's method alone
    )
    runs: dict[str, list[list[dict[str, Any]]]] = {p: [[] for _ in args.live_rates] for p in policies}
    with local_replicas(cfg, args.replicas, n) as addresses:
        warm_up(addresses, small.requests)
        for repeat in range(args.live_repeats):
            for i, rate in enumerate(args.live_rates):
                for name in policies if repeat % 2 == 0 else policies[::-1]:
                    policy = None if name == "round-robin" else _policy(name, args.replicas, seg)
                    run = run_policy(addresses, name, policy, small.at(rate))
                    runs[name][i].append(run | {"rate": rate, "repeat": repeat})
                    nl = run["normalized_latency_s"]["mean"]
                    shown = "-" if nl is None else f"{1e3 * nl:.1f} ms"
                    print(
                        f"live {name:<18} {rate:>6g} req/s  repeat {repeat}  mean NL {shown}  failed {run['failed']}",
                        file=sys.stderr,
                    )
    sim_at = simulate_all(small, costs, policies, args.live_rates, width=args.width, seg=seg)
    return {
        "rates": list(args.live_rates),
        "repeats": args.live_repeats,
        "requests": n,
        "runs": runs,
        "sim_at_live_rates": sim_at,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    costs, points = _costs(args)
    depth = (args.depth_mean, args.depth_min, costs.max_depth)
    vocab = preset_config(args.model).vocab_size
    wl = make_workload(
        args.requests,
        dataset=args.dataset,
        scale=args.scale,
        depth=depth,
        deep_fraction=args.deep_fraction,
        vocab=vocab,
        seed=args.seed,
    )
    all_depths = [d for r in wl.requests for d in r.depths]
    mean_depth = sum(all_depths) / len(all_depths)
    work = [r.work_s(costs, args.width, mean_depth) for r in wl.requests]
    heavy, cut_tokens, share = balanced_split([r.view for r in wl.requests], work, args.replicas)
    seg = Segregation(args.replicas, heavy, cut_tokens)
    capacity = wl.capacity(costs, args.replicas, args.width)
    rates = [load * capacity for load in args.loads]
    result: dict[str, Any] = {
        "config": {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k not in {"json", "out"}
        },
        "costs": costs.to_json(),
        "cost_points": points,
        "workload": wl.description
        | {"long_tokens": cut_tokens, "heavy_replicas": heavy, "heavy_share": share, "capacity_rps": capacity},
        "sim": {
            "loads": list(args.loads),
            "rates": rates,
            "policies": simulate_all(wl, costs, args.policies, rates, width=args.width, seg=seg),
        },
    }
    result["ranking"] = rank(result["sim"])
    result["live"] = run_live(args, wl, costs, seg, result["ranking"][:2]) if args.live else None
    result["decision"] = decide(result, args.margin, args.min_load)
    if args.out:
        for path in write_outputs(result, args.out):
            print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
