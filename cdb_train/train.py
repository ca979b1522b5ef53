"""Training with Ouro's objective, and the checkpoint folder it writes.

Objective per target token (Ouro, stage I): ``sum_t p_t * CE_t - beta * H(p)``, where ``CE_t`` is the language-
model loss of the LM head on the normed state after loop step ``t``, ``p`` the exit distribution of the gate's
hazards (``cdb_train.model.exit_log_pdf``) and ``H`` its entropy; the mean over tokens is minimised end to end
(gate and body). Batches are ``batch`` windows of ``seq + 1`` tokens drawn uniformly from the training stream with
a seeded generator; AdamW, linear warm-up then cosine decay, gradient clipping. Single-threaded by default, so a
run is reproducible bit for bit on one machine.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from cdb_model.config import ModelConfig
from cdb_model.loader import load_model
from cdb_model.ouro import OuroLM
from cdb_train import bpe, corpus
from cdb_train.evaluate import depth_profile, score, summarise, windows
from cdb_train.model import build, exit_log_pdf, hf_config, loop_forward, save_weights, write_config_files

LOG_FILE = "training_log.json"
METRICS_FILE = "metrics.json"
SAMPLE_FILE = "heldout_sample.txt"


@dataclass
class TrainArgs:
    out: Path
    cache: Path = corpus.DEFAULT_CACHE
    vocab_size: int = 2048
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 704
    depth: int = 4
    seq: int = 256
    batch: int = 16
    steps: int = 640
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    clip: float = 1.0
    beta: float = 0.1
    gate_bias: float = -2.0
    seed: int = 0
    threshold: float = 0.5
    eval_every: int = 50
    eval_windows: int = 24
    log_every: int = 10
    sample_verses: int = 12
    threads: int = 1
    command: str = ""  # the command line, recorded in metrics.json
    train_docs: list[str] | None = None  # given: skip the corpus (tests)
    heldout_docs: list[str] | None = None


def lr_at(step: int, a: TrainArgs) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def ouro_loss(model: OuroLM, x: torch.Tensor, y: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """Ouro's objective on inputs ``x [B, T]`` and targets ``y [B, T]``; returns (loss, logged figures)."""
    out = loop_forward(model, x)
    targets = y.reshape(-1)
    ce = torch.stack([F.cross_entropy(model.logits(h), targets, reduction="none") for h in out.states])  # [R, N]
    log_pdf = exit_log_pdf(out.gate_logits)  # [R, N]
    pdf = log_pdf.exp()
    task = (pdf * ce).sum(0).mean()
    entropy = -(pdf * log_pdf).sum(0).mean()
    loss = task - beta * entropy
    logged = {
        "loss": float(loss.detach()),
        "task": float(task.detach()),
        "entropy": float(entropy.detach()),
        "ce": [round(float(c), 4) for c in ce.detach().mean(1)],
        "pdf": [round(float(p), 4) for p in pdf.detach().mean(1)],
    }
    return loss, logged


def _param_groups(model: OuroLM, weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def _docs(a: TrainArgs) -> tuple[list[str], list[str], dict[str, Any]]:
    if a.train_docs is not None and a.heldout_docs is not None:
        return a.train_docs, a.heldout_docs, {"package": "(documents given)"}
    folder = a.cache / "corpus"
    if not (folder / "source.json").is_file():
        corpus.prepare_corpus(a.cache)
    source = json.loads((folder / "source.json").read_text())
    source.pop("copyright", None)
    train = corpus.read_documents(folder / "train.txt")
    held = corpus.read_documents(folder / "heldout.txt")
    return train, held, source


def train(a: TrainArgs) -> dict[str, Any]:
    """Train, write the checkpoint folder ``a.out`` and return the metrics written to ``metrics.json``."""
    t_start, cpu_start = time.time(), time.process_time()
    torch.set_num_threads(a.threads)
    train_docs, held_docs, source = _docs(a)
    tok = bpe.train_tokenizer(train_docs, a.vocab_size)
    train_ids = torch.tensor(bpe.encode_documents(tok, train_docs), dtype=torch.long)
    held_ids = bpe.encode_documents(tok, held_docs)
    cfg_dict = hf_config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=a.hidden,
        num_layers=a.layers,
        num_heads=a.heads,
        num_kv_heads=a.kv_heads,
        intermediate_size=a.intermediate,
        max_depth=a.depth,
        early_exit_threshold=a.threshold,
    )
    config = ModelConfig.from_hf(cfg_dict, name=a.out.name)
    model = build(config, a.seed, a.gate_bias).train()
    opt = torch.optim.AdamW(_param_groups(model, a.weight_decay), lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(a.seed)
    eval_w = windows(held_ids, a.seq, a.eval_windows)
    log: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(a).items() if not k.endswith("_docs")},
        "train": [],
        "eval": [],
    }
    bar = tqdm(range(a.steps), desc="train", mininterval=2.0, dynamic_ncols=True)
    for step in bar:
        if step % a.eval_every == 0 or step == a.steps - 1:
            model.eval()
            ev = summarise(score(model, eval_w), a.threshold)
            log["eval"].append(
                {
                    "step": step,
                    **{k: ev[k] for k in ("ppl_per_depth", "ppl_mixture", "exit_pdf_mean", "mean_depth_at_threshold")},
                }
            )
            model.train()
        starts = torch.randint(0, len(train_ids) - a.seq - 1, (a.batch,), generator=gen)
        w = torch.stack([train_ids[s : s + a.seq + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        loss, logged = ouro_loss(model, w[:, :-1], w[:, 1:], a.beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip))
        opt.step()
        if step % a.log_every == 0 or step == a.steps - 1:
            log["train"].append(
                {
                    "step": step,
                    "lr": round(lr_at(step, a), 6),
                    "grad_norm": round(grad_norm, 4),
                    "elapsed_s": round(time.time() - t_start, 1),
                    **logged,
                }
            )
            bar.set_postfix(
                loss=f"{logged['loss']:.3f}", ce4=f"{logged['ce'][-1]:.3f}", H=f"{logged['entropy']:.2f}", refresh=False
            )
    bar.close()
    train_s, train_cpu_s = time.time() - t_start, time.process_time() - cpu_start

    out = a.out
    write_config_files(out, cfg_dict)
    save_weights(model, out / "model.safetensors")
    bpe.write_tokenizer_files(tok, out, cfg_dict["max_position_embeddings"])
    sample_text = "\n".join(held_docs[0].split("\n")[: a.sample_verses])
    (out / SAMPLE_FILE).write_text(sample_text + "\n")
    log["wall_s"] = round(train_s, 1)
    (out / LOG_FILE).write_text(json.dumps(log) + "\n")

    # Figures from the shipped (bf16-stored) weights, read back through the project's loader.
    shipped = load_model(str(out))
    assert isinstance(shipped, OuroLM)
    held_w = windows(held_ids, a.seq)
    held_scores = score(shipped, held_w)
    full = summarise(held_scores, a.threshold)
    full["depth_profile"] = depth_profile(
        held_scores, held_w[:, 1:].reshape(-1), lambda i: tok.decode([i]), a.threshold
    )
    sample_ids = tok.encode(sample_text, add_special_tokens=False).ids
    sample = summarise(score(shipped, torch.tensor([sample_ids])), a.threshold)
    n_params = sum(p.numel() for p in shipped.parameters())
    metrics = {
        "model": {
            "parameters": n_params,
            "config": {
                k: cfg_dict[k]
                for k in (
                    "vocab_size",
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "total_ut_steps",
                )
            },
        },
        "data": {**source, "train_tokens": len(train_ids), "heldout_tokens": len(held_ids)},
        "training": {
            "steps": a.steps,
            "batch": a.batch,
            "seq": a.seq,
            "tokens_seen": a.steps * a.batch * a.seq,
            "beta": a.beta,
            "seed": a.seed,
            "threads": a.threads,
            "wall_s": round(train_s, 1),
            "cpu_s": round(train_cpu_s, 1),
            "command": a.command,
        },
        "heldout": full,
        "heldout_sample": {"file": SAMPLE_FILE, **sample},
    }
    write_metrics(out, metrics)
    return metrics


def write_metrics(folder: Path, metrics: dict[str, Any]) -> None:
    (folder / METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n")


def read_metrics(folder: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((folder / METRICS_FILE).read_text())
    return result
