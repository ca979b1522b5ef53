"""What every benchmark leaves behind with ``--out DIR``: its JSON and the PNG plots a person would look at.

``write_json`` writes ``DIR/NAME.json``; ``bars`` and ``histogram`` draw one matplotlib figure each (Agg backend,
no display needed). ``progress`` is the one progress bar of the benchmarks (tqdm on stderr; off with
``--no-progress``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress(items: Iterable[T], total: int | None, desc: str, enabled: bool = True) -> Iterable[T]:
    """``items`` with a progress bar on stderr (plain iteration when disabled)."""
    return tqdm(items, total=total, desc=desc, file=sys.stderr, disable=not enabled, leave=False)


def write_json(out: Path, name: str, data: Mapping[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def deliver(
    summary: dict[str, Any],
    args: Any,
    table: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], Path],
) -> int:
    """A benchmark's summary: the JSON (``args.json``) or its table on stdout, and the files ``args.out`` (JSON) and
    ``args.plot`` (PNG) where asked. Returns the exit status (0)."""
    print(json.dumps(summary, indent=2) if args.json else table(summary))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    if args.plot:
        print(f"wrote {plot(summary, args.plot)}", file=sys.stderr)
    return 0


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bars(
    path: Path,
    title: str,
    labels: Sequence[str],
    values: Sequence[float],
    ylabel: str,
    *,
    line: tuple[float, str] | None = None,
    errors: Sequence[tuple[float, float]] | None = None,
) -> Path:
    """One bar per label; ``line``: a horizontal reference (value, label), e.g. a FLOP bound; ``errors``: the
    (low, high) range of each bar's repeats."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    yerr = None
    if errors is not None:
        yerr = [[v - lo for v, (lo, _) in zip(values, errors)], [hi - v for v, (_, hi) in zip(values, errors)]]
    ax.bar(labels, values, yerr=yerr, capsize=4, color=["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"][: len(labels)])
    for i, v in enumerate(values):
        ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=9)
    if line is not None:
        ax.axhline(line[0], color="grey", linestyle="--", label=line[1])
        ax.legend()
    ax.set_ylabel(ylabel)
    return _save(plt, fig, ax, path, title)


def histogram(path: Path, title: str, counts: Mapping[int, int], xlabel: str) -> Path:
    """Shares of each integer value (e.g. tokens per served depth)."""
    plt = _pyplot()
    keys = sorted(int(k) for k in counts)
    total = sum(counts.values()) or 1
    shares = [100 * counts.get(k, counts.get(str(k), 0)) / total for k in keys]  # type: ignore[call-overload]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar([str(k) for k in keys], shares, color="#1f77b4")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("% of tokens")
    return _save(plt, fig, ax, path, title)


def lines(
    path: Path, title: str, series: Mapping[str, tuple[Sequence[float], Sequence[float]]], xlabel: str, ylabel: str
) -> Path:
    """One line with markers per named series of (xs, ys)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    return _save(plt, fig, ax, path, title)


def _save(plt: Any, fig: Any, ax: Any, path: Path, title: str) -> Path:
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
