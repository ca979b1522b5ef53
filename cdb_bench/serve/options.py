"""Option types of the benchmarks' command lines (argparse ``type`` converters), and ``--quick`` as a change of
defaults only."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from cdb_bench.serve.sweep import MODE_NAMES


def positive_floats(text: str) -> tuple[float, ...]:
    """``--rates 1,2,4``-style options: comma-separated positive numbers (argparse ``type``)."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def parse_with_quick(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    quick: Mapping[str, Any],
    converters: Mapping[str, Callable[[str], Any]],
) -> argparse.Namespace:
    """Parse ``argv``; ``--quick`` swaps in the ``quick`` defaults only, so options given explicitly still win;
    options still holding a string default are run through their ``converters`` (argparse leaves defaults as they
    are)."""
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    for name, convert in converters.items():
        value = getattr(args, name)
        if isinstance(value, str):
            setattr(args, name, convert(value))
    return args


def percentile_list(text: str) -> tuple[float, ...]:
    """``--percentiles 50,90,99``: comma-separated numbers in (0, 100] (argparse ``type``)."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"expected percentiles in (0, 100], got {text!r}")
    return values


def modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODE_NAMES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes must be among {', '.join(MODE_NAMES)}; got {text!r}")
    return modes
