"""The memory plans of the released Ouro-1.4B and Huginn-0125 shapes on this machine's device (``--device auto``),
at two shares of its memory: what ``cdb serve`` prints before any stage starts.

    python scripts/memory_plans.py [--max-num-seqs 64] [--max-model-len 8192]
"""

from __future__ import annotations

import argparse

from cdb_engine.config import EngineConfig
from cdb_engine.memory import MemoryPlanError, plan_memory
from cdb_model.config import ModelConfig
from cdb_model.released import HUGINN_0125, OURO_14B

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--max-num-seqs", type=int, default=64)
p.add_argument("--max-model-len", type=int, default=8192)
p.add_argument("--shares", type=float, nargs="+", default=[0.9, 0.5])
args = p.parse_args()
for name, shape in (("ouro-1.4b", OURO_14B), ("huginn-0125", HUGINN_0125)):
    for share in args.shares:
        cfg = EngineConfig(
            gpu_memory_utilization=share, max_num_seqs=args.max_num_seqs, max_total_tokens=args.max_model_len
        )
        try:
            print(f"{name}: {plan_memory(cfg, ModelConfig.from_hf(shape, name=name)).describe()}")
        except MemoryPlanError as exc:
            print(f"{name}: refused: {exc}")
