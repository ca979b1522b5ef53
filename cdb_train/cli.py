"""``python -m cdb_train {prepare,train,lookahead,card}``: the commands that build ``models/ouro-kjv``.

OMP_NUM_THREADS=1 python -m cdb_train prepare
OMP_NUM_THREADS=1 python -m cdb_train train --out models/ouro-kjv
OMP_NUM_THREADS=1 python -m cdb_train lookahead --model models/ouro-kjv
python -m cdb_train card --model models/ouro-kjv
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import fields
from pathlib import Path

from cdb_train import corpus

_TRAIN_FLAGS = {
    "vocab_size": "BPE vocabulary size (special tokens included)",
    "hidden": "hidden size",
    "layers": "physical layers in the looped block",
    "heads": "attention heads",
    "kv_heads": "key/value heads",
    "intermediate": "SwiGLU intermediate size",
    "depth": "loop steps (total_ut_steps)",
    "seq": "tokens per training window",
    "batch": "windows per step",
    "steps": "optimizer steps",
    "lr": "peak learning rate",
    "warmup": "warm-up steps",
    "beta": "entropy coefficient of the exit distribution",
    "gate_bias": "initial exit-gate bias",
    "seed": "random seed",
    "threshold": "early_exit_threshold written to config.json",
    "eval_every": "held-out evaluation interval (steps)",
    "threads": "torch intra-op threads",
}


def _add_dataclass_flags(p: argparse.ArgumentParser, cls: type, names: dict[str, str]) -> None:
    defaults = {f.name: f.default for f in fields(cls)}
    for name, text in names.items():
        default = defaults[name]
        p.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=type(default),
            default=default,
            help=f"{text} (default {default})",
        )


def build_parser() -> argparse.ArgumentParser:
    from cdb_train.lookahead import LookaheadArgs
    from cdb_train.train import TrainArgs

    p = argparse.ArgumentParser(prog="python -m cdb_train", description="train the shipped Ouro-style looped LM")
    sub = p.add_subparsers(dest="command", required=True)
    cache_help = f"download / corpus cache (default {corpus.DEFAULT_CACHE})"
    pr = sub.add_parser("prepare", help="fetch the Debian package, decode and split the corpus")
    pr.add_argument("--cache", type=Path, default=corpus.DEFAULT_CACHE, help=cache_help)
    tr = sub.add_parser("train", help="train the tokenizer and the looped LM; write the checkpoint folder")
    tr.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    tr.add_argument("--cache", type=Path, default=corpus.DEFAULT_CACHE, help=cache_help)
    _add_dataclass_flags(tr, TrainArgs, _TRAIN_FLAGS)
    la = sub.add_parser("lookahead", help="distil the lookahead gate into a checkpoint and measure it")
    la.add_argument("--model", type=Path, required=True, help="checkpoint folder (read and updated)")
    la.add_argument("--cache", type=Path, default=corpus.DEFAULT_CACHE, help=cache_help)
    _add_dataclass_flags(
        la,
        LookaheadArgs,
        {
            "batches": "training batches",
            "batch": "windows per batch",
            "updates_per_batch": "gate updates per batch",
            "lr": "learning rate",
            "seed": "random seed",
            "threads": "torch intra-op threads",
        },
    )
    cd = sub.add_parser("card", help="write loss.png and README.md from the logs and metrics.json")
    cd.add_argument("--model", type=Path, required=True, help="checkpoint folder")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = "python -m cdb_train " + " ".join(shlex.quote(w) for w in (sys.argv[1:] if argv is None else argv))
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizer trainer's thread pool
    t0 = time.time()
    if args.command == "prepare":
        info = corpus.prepare_corpus(args.cache)
        info.pop("copyright")
        print(json.dumps(info, indent=2))
    elif args.command == "train":
        from cdb_train.train import TrainArgs, train

        kw = {k: getattr(args, k) for k in _TRAIN_FLAGS}
        metrics = train(TrainArgs(out=args.out, cache=args.cache, command=command, **kw))
        print(json.dumps(metrics["heldout"], indent=2))
    elif args.command == "lookahead":
        from cdb_train.lookahead import LookaheadArgs, run

        kw = {k: getattr(args, k) for k in ("batches", "batch", "updates_per_batch", "lr", "seed", "threads")}
        metrics = run(LookaheadArgs(model=args.model, cache=args.cache, command=command, **kw))
        print(json.dumps(metrics["lookahead"], indent=2))
    else:
        from cdb_train.card import write_card

        write_card(args.model)
        print(f"wrote {args.model / 'README.md'} and {args.model / 'loss.png'}")
    print(f"{args.command}: {time.time() - t0:.1f} s")
    return 0
