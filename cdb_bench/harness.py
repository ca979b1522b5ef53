"""``cdb eval --harness``: the evaluation harness (``lm_eval``: the optional extra ``cdb[eval]``) against the
OpenAI-compatible API, over the exit threshold q: each task's score (accuracy, chrF) and the mean served depth
against q (JSON and a plot).

- The server: a running one (``--base-url http://HOST:PORT``, its API root), or a ``cdb serve`` tree of
  ``--model`` started here on loopback ports and stopped at the end.
- The harness speaks to it as to vLLM: ``local-completions`` with the server's remote tokenizer (``/tokenize``,
  ``/detokenize``, ``/tokenizer_info``), and with ``--chat`` the generate-until tasks again through
  ``local-chat-completions`` (the server's chat template). Nothing is downloaded: the tasks are local YAML configs
  and JSONL files (``--tasks-dir``; default: ``tests/harness/tasks`` of this checkout, made from the shipped
  model's held-out verses), their ``data_files`` relative to their folder.
- q reaches the server as the request's ``exit_threshold`` (an extra body field the harness passes on from the
  task's ``generation_kwargs``). Log-likelihood tasks do not depend on q: their scores are prompt logprobs, which
  the server computes at full depth in the prefill (the exit threshold applies to generated tokens only), so their
  curves are flat by construction; they run at every q all the same (a check of that).
- Mean depth: the mean served depth of the tokens a run generated (the first of each request, sampled from the
  full-depth prefill, included), from the server's ``cdb_served_depth`` histogram before and after the run: the
  server must be serving nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
TASKS_DIR = ROOT / "tests" / "harness" / "tasks"
THRESHOLDS = (0.2, 0.35, 0.5, 0.7, 1.0)
LOGLIKELIHOOD = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")


def load_tasks(folder: Path, names: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The task configs (``*.yaml``) of ``folder`` (only ``names`` when given), their ``data_files`` made absolute."""
    import yaml

    configs = []
    for path in sorted(folder.glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        if names and config["task"] not in names:
            continue
        files = config.get("dataset_kwargs", {}).get("data_files", {})
        for split, name in files.items():
            files[split] = str((path.parent / name).resolve())
        configs.append(config)
    missing = set(names) - {c["task"] for c in configs}
    if missing:
        raise ValueError(f"no task {', '.join(sorted(missing))} in {folder}")
    return configs


def at_threshold(config: dict[str, Any], q: float) -> dict[str, Any]:
    """The task config whose generations are served at exit threshold ``q`` (a log-likelihood task unchanged)."""
    if config.get("output_type") in LOGLIKELIHOOD:
        return config
    out = copy.deepcopy(config)
    out.setdefault("generation_kwargs", {})["exit_threshold"] = q
    return out


def served_depth(root: str) -> tuple[float, float]:
    """(sum, count) of the server's ``cdb_served_depth`` histogram (``GET /metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{root}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "cdb_served_depth_sum":
                total += sample.value
            elif sample.name == "cdb_served_depth_count":
                count += sample.value
    return total, count


def model_card(root: str) -> dict[str, Any]:
    """The served model (``GET /v1/models``): its ``id`` and context length ``max_model_len``."""
    with urllib.request.urlopen(f"{root}/v1/models", timeout=30) as resp:
        card: dict[str, Any] = json.loads(resp.read())["data"][0]
    return card


PERCENT_METRICS = ("chrf", "chrf++", "bleu")  # sacrebleu's corpus scores, 0-100


def headline(metrics: dict[str, Any]) -> tuple[str, float]:
    """The task's first metric (``acc``, ``exact_match``, ``chrf``, ...) and its value on a 0-1 scale (sacrebleu's
    0-100 scores divided by 100)."""
    for key, value in metrics.items():
        if "," in key and "_stderr" not in key and isinstance(value, int | float):
            name = key.split(",")[0]
            return name, float(value) / 100 if name in PERCENT_METRICS else float(value)
    raise ValueError(f"no metric in {metrics}")


def run_task(
    root: str,
    config: dict[str, Any],
    *,
    chat: bool = False,
    limit: int | None = None,
    batch_size: int = 8,
    log_samples: bool = False,
) -> dict[str, Any]:
    """One harness run of one task (``local-completions``, or ``local-chat-completions`` with ``chat``) against the
    API at ``root``: the harness's metrics, the mean served depth of the tokens it generated, and with
    ``log_samples`` the harness's samples."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    card = model_card(root)
    endpoint = "chat/completions" if chat else "completions"
    model_args = {
        "model": card["id"],
        "base_url": f"{root}/v1/{endpoint}",
        "max_length": card["max_model_len"],
        "batch_size": 1 if chat else batch_size,
        "max_retries": 1,
    }
    before = served_depth(root)
    t0 = time.monotonic()
    out = lm_eval.simple_evaluate(
        model="local-chat-completions" if chat else "local-completions",
        model_args=model_args,
        tasks=[config],
        task_manager=TaskManager(include_defaults=False),
        limit=limit,
        apply_chat_template=chat,
        log_samples=log_samples,
    )
    wall = time.monotonic() - t0
    after = served_depth(root)
    assert out is not None
    tokens = after[1] - before[1]
    metrics = out["results"][config["task"]]
    name, value = headline(metrics)
    result = {
        "task": config["task"],
        "api": "chat" if chat else "completions",
        "output_type": config.get("output_type"),
        "metric": name,
        "score": value,
        "metrics": {k: v for k, v in metrics.items() if "," in k},
        "samples": metrics.get("sample_len"),
        "generated_tokens": int(tokens),
        "mean_depth": (after[0] - before[0]) / tokens if tokens else None,
        "wall_s": round(wall, 2),
    }
    if log_samples:
        result["logged"] = out["samples"][config["task"]]
    return result


def sweep(
    root: str,
    tasks: Sequence[dict[str, Any]],
    thresholds: Sequence[float],
    *,
    chat: bool = False,
    limit: int | None = None,
    batch_size: int = 8,
    log: TextIO | None = None,
) -> dict[str, Any]:
    """Every task at every q (with ``chat``, the generate-until tasks through chat completions too)."""
    import lm_eval

    t0 = time.monotonic()
    points = []
    for q in thresholds:
        for config in tasks:
            runs = [False, True] if chat and config.get("output_type") == "generate_until" else [False]
            for as_chat in runs:
                point = {
                    "q": q,
                    **run_task(root, at_threshold(config, q), chat=as_chat, limit=limit, batch_size=batch_size),
                }
                points.append(point)
                if log is not None:
                    depth = "-" if point["mean_depth"] is None else f"{point['mean_depth']:.2f}"
                    line = f"q={q:g} {point['task']} ({point['api']}): {point['metric']} {point['score']:.3f}"
                    print(f"{line}, mean depth {depth}", file=log, flush=True)
    card = model_card(root)
    return {
        "model": card["id"],
        "root": card.get("root"),
        "lm_eval": getattr(lm_eval, "__version__", "unknown"),
        "thresholds": list(thresholds),
        "limit": limit,
        "note": "score: the task's metric on a 0-1 scale (chrF / 100); log-likelihood scores come from full-depth "
        "prompt logprobs (q applies to generated tokens only); mean depth: the tokens each run generated, each "
        "request's first (full depth, from the prefill) included",
        "points": points,
        "wall_s": round(time.monotonic() - t0, 1),
    }


def plot(result: dict[str, Any], path: Path) -> Path:
    """Score and mean served depth against q, one curve per task (and API)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    curves = dict.fromkeys((p["task"], p["api"], p["metric"]) for p in result["points"])
    for task, api, metric in curves:
        pts = sorted((p for p in result["points"] if (p["task"], p["api"]) == (task, api)), key=lambda p: p["q"])
        label = f"{task} ({api}, {metric})"
        (line,) = a1.plot([p["q"] for p in pts], [p["score"] for p in pts], marker="o", label=label)
        depth = [(p["q"], p["mean_depth"]) for p in pts if p["mean_depth"] is not None]
        a2.plot([q for q, _ in depth], [d for _, d in depth], marker="o", color=line.get_color(), label=label)
    a1.set_xlabel("exit threshold q")
    a1.set_ylabel("score (acc; chrF / 100)")
    a1.set_ylim(-0.02, 1.02)
    a1.set_title(f"{result['model']}: lm_eval {result['lm_eval']} through the API")
    a2.set_xlabel("exit threshold q")
    a2.set_ylabel("mean served depth of generated tokens")
    a2.set_title("log-likelihood: full-depth prefill, flat in q")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def table(result: dict[str, Any]) -> str:
    lines = [f"{'q':>5}  {'task':<16} {'api':<11} {'metric':<12} {'value':>6} {'depth':>6} {'tokens':>6}"]
    for p in result["points"]:
        depth = "-" if p["mean_depth"] is None else f"{p['mean_depth']:.2f}"
        lines.append(
            f"{p['q']:>5g}  {p['task']:<16} {p['api']:<11} {p['metric']:<12} {p['score']:>6.3f} {depth:>6} "
            f"{p['generated_tokens']:>6}"
        )
    return "\n".join(lines)


@contextmanager
def served_tree(model: str, *, dtype: str = "auto", device: str = "cpu") -> Iterator[str]:
    """A ``cdb serve`` tree of ``model`` on loopback ports: yields its HTTP API root once ``/health`` is 200."""
    from cdb_bench.processes import free_port
    from cdb_engine.config import EngineConfig
    from services.launcher import serve_all

    port = free_port()
    env = {**os.environ, "CDB_HTTP_ADDR": f"127.0.0.1:{port}"}
    handle = serve_all(EngineConfig(model=model, dtype=dtype, device=device), "127.0.0.1:0", env=env)  # type: ignore[arg-type]
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{root}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the HTTP API at {root} did not become healthy")
            time.sleep(0.1)
        yield root
    finally:
        handle.stop(drain_timeout=5.0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cdb eval --harness", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--base-url", default=None, help="a running server's API root, http://HOST:PORT (default: start one)"
    )
    p.add_argument("--model", default="ouro-kjv", help="the model of the server started here (default ouro-kjv)")
    p.add_argument("--device", default="cpu", help="its device (default cpu)")
    p.add_argument("--tasks-dir", type=Path, default=TASKS_DIR, help="folder of task YAMLs (default: %(default)s)")
    p.add_argument("--tasks", default="", help="comma-separated task names (default: every task of --tasks-dir)")
    p.add_argument("--thresholds", default=",".join(map(str, THRESHOLDS)), help="exit thresholds q (comma-separated)")
    p.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per completions request (log-likelihood)")
    p.add_argument("--chat", action="store_true", help="also run the generate-until tasks through chat completions")
    p.add_argument("--out", type=Path, default=None, help="write harness.json and harness.png here")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("cdb eval --harness needs the evaluation harness: pip install -e '.[eval]'", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: local tasks, the server's tokenizer
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    tasks = load_tasks(args.tasks_dir, [t for t in args.tasks.split(",") if t])
    qs = [float(q) for q in args.thresholds.split(",")]

    def run(root: str) -> dict[str, Any]:
        return sweep(root, tasks, qs, chat=args.chat, limit=args.limit, batch_size=args.batch_size, log=sys.stderr)

    if args.base_url:
        result = run(args.base_url.rstrip("/"))
    else:
        with served_tree(args.model, device=args.device) as root:
            result = run(root)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "harness.json").write_text(json.dumps(result, indent=2) + "\n")
        plot(result, args.out / "harness.png")
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0
