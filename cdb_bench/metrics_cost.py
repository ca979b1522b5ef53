"""What a scrape of ``/metrics`` costs the scheduler's process: ``python -m cdb_bench.metrics_cost``.

A gateway's endpoint picker scrapes every replica often (the Gateway API Inference Extension: every 50 ms, 20
scrapes a second). A scrape runs in the scheduler's process beside the engine thread (under the same GIL), so its
CPU is taken from the engine's. Here a ``Metrics`` of a served model is filled as after a long run (every family
observed, every label in use), then ``render()`` (what ``GET /metrics`` answers: the collectors, then the text
exposition) is timed, with and without the vLLM-named copies (``CDB_METRICS_VLLM_NAMES``), in interleaved rounds.
Printed as JSON: µs per scrape (median of the rounds), its share of one core at ``--rate`` scrapes a second, and the
exposition's size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from services.settings import Settings
from services.telemetry.metrics import Metrics


def filled(vllm_names: bool) -> Metrics:
    """A ``Metrics`` with every family observed (and the vLLM names when asked)."""
    m = Metrics.from_settings("ouro-kjv", 4, Settings(metrics_vllm_names=vllm_names))
    for i in range(2000):
        m.observe_admitted(prompt_tokens=64 + i % 50)
        m.observe_queue_time(0.001 * (i % 30))
        m.observe_ttft(0.01 * (i % 40))
        m.observe_itl(0.001 * (1 + i % 60))
        m.observe_token_depth(1 + i % 4)
        m.observe_request_end(0.1 * (i % 50), ("stop", "length", "cancelled")[i % 3])
        m.observe_loop_batch(size=1 + i % 64, capacity=64, compute_s=0.0005)
        m.observe_stage_compute(("prelude", "loop", "head")[i % 3], 0.0004)
    for code in ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "UNAVAILABLE"):
        m.observe_rejected(code)
    m.inc_refills(100)
    m.inc_speculation(drafts=50, accepted=30, rejected=20, wasted_steps=40)
    m.set_queue_sizes(waiting=12, running=64)
    m.set_kv_blocks(used=900, total=2048)
    m.set_bank_rows(used=64, total=2112)
    m.set_stages_attached(True)
    return m


def measure(rounds: int = 7, renders: int = 200, rate: float = 20.0) -> dict[str, Any]:
    kinds = {"cdb names": filled(False), "cdb and vLLM names": filled(True)}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(rounds):  # interleaved: drift hits both alike
        for kind, metrics in kinds.items():
            t0 = time.process_time()
            for _ in range(renders):
                metrics.render()
            times[kind].append((time.process_time() - t0) / renders)
    out: dict[str, Any] = {"rate_per_s": rate, "rounds": rounds, "renders_per_round": renders}
    for kind, metrics in kinds.items():
        per = statistics.median(times[kind])
        out[kind] = {
            "us_per_scrape": round(per * 1e6, 1),
            "share_of_one_core_at_rate": round(per * rate, 4),
            "exposition_bytes": len(metrics.render().encode()),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cdb_bench.metrics_cost", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--renders", type=int, default=200)
    p.add_argument("--rate", type=float, default=20.0, help="scrapes a second (a gateway's: 20)")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.rounds, args.renders, args.rate), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
