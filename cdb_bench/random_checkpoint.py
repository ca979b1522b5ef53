"""Random-weight checkpoints in the released layouts: ``python -m cdb_bench.random_checkpoint --model ouro-1.4b``.

Writes a Hugging Face folder the loader reads like a released one: ``config.json`` with the released field values
(Ouro-1.4B, Huginn-0125), the weights in shards of about ``--shard-gb`` GB with ``model.safetensors.index.json``,
every tensor under its upstream name and shape. Values follow the benchmark presets' recipe
(``cdb_model.presets.init_tensor``: exit signals spread so that depths vary), so the GPU check can run the
offline and serving benchmarks at real sizes without downloading anything. ``--set KEY=VALUE`` changes a released
field (a shrunken model for a CPU test).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from cdb_engine.setup import torch_dtype
from cdb_model.config import ModelConfig
from cdb_model.models import build_empty
from cdb_model.presets import init_tensor
from cdb_model.released import HUGINN_0125, OURO_14B

# The released configs (above, as published), what the written ones change (Ouro: early exit on, as served here),
# and the preset whose init recipe shapes the exit signals.
RELEASED = {
    "ouro-1.4b": (OURO_14B, {"early_exit_threshold": 0.5}, "ouro-bench"),
    "huginn-0125": (HUGINN_0125, {}, "huginn-bench"),
}


def write_random_checkpoint(
    model: str,
    out: Path,
    dtype: torch.dtype = torch.bfloat16,
    overrides: dict[str, Any] | None = None,
    shard_gb: float = 2.0,
) -> ModelConfig:
    """Write the folder; returns its config. ``overrides``: released ``config.json`` fields to change (shrinking
    the model for a CPU test)."""
    released, served, recipe = RELEASED[model]
    raw = {**released, **served, **(overrides or {})}
    config = ModelConfig.from_hf(raw, name=model)
    shapes = {k: tuple(t.shape) for k, t in build_empty(config).state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    limit, size = shard_gb * 2**30, 0
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files: list[dict[str, torch.Tensor]] = []
    for name, shape in shapes.items():
        shard[name] = init_tensor(recipe, name, shape, config).to(dtype)
        size += shard[name].numel() * shard[name].element_size()
        if size >= limit:
            files.append(_flush(out, shard, len(files), weight_map))
            shard, size = {}, 0
    if shard:
        files.append(_flush(out, shard, len(files), weight_map))
    index = {"metadata": {"total_size": sum(s.numel() * s.element_size() for f in files for s in f.values())}}
    (out / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}, indent=1))
    return config


def _flush(out: Path, shard: dict[str, torch.Tensor], i: int, weight_map: dict[str, str]) -> dict[str, torch.Tensor]:
    name = f"model-{i + 1:05d}.safetensors"
    save_file(shard, str(out / name))
    weight_map.update(dict.fromkeys(shard, name))
    return {k: t.to("meta") for k, t in shard.items()}  # keep sizes, drop the values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cdb_bench.random_checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(RELEASED), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change a config.json field")
    p.add_argument("--shard-gb", type=float, default=2.0)
    args = p.parse_args(argv)
    overrides = {k: json.loads(v) for k, _, v in (kv.partition("=") for kv in args.set)}
    config = write_random_checkpoint(args.model, args.out, torch_dtype(args.dtype), overrides, args.shard_gb)
    f0, fr = config.param_counts()
    print(f"{args.out}: {config.name} F0 {f0:,} Fr {fr:,} (F0/Fr {f0 / fr:.3f}), max depth {config.max_depth}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
