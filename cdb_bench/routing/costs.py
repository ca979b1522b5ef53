"""Per-op costs of one replica, measured on this machine and fitted to straight lines, for the routing simulation.

The cost model (seconds), with b the tokens in a loop op, e the tokens exiting to the head after it, p a prompt's
tokens and r the model's max depth:

    decode step   loop(b) + head(e)          loop(b) = a_loop + c_loop · b,  head(e) = a_head + c_head · e (e > 0)
    prefill       r · loop(p) + head(1)      the prompt's chunk runs all r loop steps, then the head samples token 0

``loop`` is ``cdb_bench.step_time.time_loop_step`` (one decode loop step of the preset over b requests with
``context`` positions each, float32, best of ``repeats``) at b = 1, 2, 4, ..., fitted by least squares; ``head``
is the LM head over e hidden states plus the greedy pick, measured the same way. On a CPU a step's cost grows with
its tokens, so the fit is close (the residual is reported). What it leaves out: the scheduler's planning and the
stage hops (a few % of a loop op, ``cdb bench services``), and the overlap of the head with the next loop op in
the stage processes. Prefill of a prompt counts as one chunk (prompts here are short).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from cdb_bench.step_time import time_loop_step
from cdb_model.presets import build_preset, preset_config
from cdb_scheduler.plan import Stage


@dataclass(frozen=True, slots=True)
class StepCosts:
    """The fitted lines, in seconds; ``source`` says where they came from."""

    loop_base_s: float
    loop_per_token_s: float
    head_base_s: float
    head_per_token_s: float
    max_depth: int
    source: str = "given"

    def __post_init__(self) -> None:
        if min(self.loop_base_s, self.loop_per_token_s, self.head_base_s, self.head_per_token_s) < 0:
            raise ValueError(f"costs must be >= 0, got {self}")
        if self.loop_base_s + self.loop_per_token_s <= 0:
            raise ValueError("a loop step must cost something: loop_base_s + loop_per_token_s > 0")
        if self.max_depth < 1:
            raise ValueError(f"max_depth: >= 1, got {self.max_depth}")

    def loop_s(self, tokens: int) -> float:
        return self.loop_base_s + self.loop_per_token_s * tokens

    def head_s(self, tokens: int) -> float:
        return self.head_base_s + self.head_per_token_s * tokens if tokens > 0 else 0.0

    def decode_step_s(self, tokens: int, exiting: int) -> float:
        """One loop op over ``tokens`` tokens, then the head for the ``exiting`` ones."""
        return self.loop_s(tokens) + self.head_s(exiting)

    def prefill_s(self, prompt_tokens: int) -> float:
        """A prompt at full depth, then its first token sampled."""
        return self.max_depth * self.loop_s(prompt_tokens) + self.head_s(1)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``y = a + c·x``: (a, c, the largest relative residual); a and c clipped at 0."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("fit_line needs two or more (x, y) points")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    c = max(0.0, c)
    a = max(0.0, my - c * mx)
    worst = max(abs(a + c * x - y) / y for x, y in zip(xs, ys) if y > 0)
    return a, c, worst


def time_head(name: str, tokens: int, repeats: int = 20) -> float:
    """Seconds of the LM head over ``tokens`` hidden states and the greedy pick (float32, best of ``repeats``)."""
    c = preset_config(name)
    model = build_preset(name, stages={Stage.HEAD})
    hidden = torch.randn(tokens, c.bank_width)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.logits(model.coda(hidden, torch.zeros(tokens, dtype=torch.long), None)).argmax(-1)
            best = min(best, time.perf_counter() - t0)
    return best


def measure_costs(name: str, *, width: int, context: int = 48, repeats: int = 10) -> tuple[StepCosts, dict[str, Any]]:
    """Measure ``name``'s loop step and head at batch sizes 1, 2, 4, ... up to ``width`` and fit the lines;
    returns the costs and the raw points (milliseconds) with the fits' worst residuals."""
    sizes = sorted({1, *(2**i for i in range(1, 12) if 2**i < width), width})
    loop = [time_loop_step(name, tokens=b, context=context, repeats=repeats) / 1e3 for b in sizes]
    head = [time_head(name, b, repeats=repeats) for b in sizes]
    la, lc, lres = fit_line(sizes, loop)
    ha, hc, hres = fit_line(sizes, head)
    costs = StepCosts(la, lc, ha, hc, preset_config(name).max_depth, f"measured: {name}, context {context}")
    raw = {
        "batch_sizes": sizes,
        "loop_ms": [round(1e3 * t, 4) for t in loop],
        "head_ms": [round(1e3 * t, 4) for t in head],
        "loop_fit_worst_residual": round(lres, 4),
        "head_fit_worst_residual": round(hres, 4),
        "threads": torch.get_num_threads(),
    }
    return costs, raw
