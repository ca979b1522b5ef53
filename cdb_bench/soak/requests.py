"""The soak's requests: each drawn once from the seed (prompt, output length, sampling, fate), what happened to it
in the run, and its fault-free tokens from an in-process engine."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from cdb_engine.config import DType, EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_scheduler.sampling import SamplingParams
from clients.messages import GenerateOptions

WORDS = tuple(
    [
        "the",
        "loop",
        "runs",
        "a",
        "shared",
        "block",
        "again",
        "and",
        "again",
        "until",
        "the",
        "token",
        "is",
        "easy",
        "enough",
        "to",
        "leave",
    ]
)
SERVED_DTYPE = DType.FLOAT32  # what ``cdb serve`` computes in on a CPU (EngineConfig's auto dtype)


@dataclass(frozen=True, slots=True)
class Planned:
    """One request as drawn: what is sent, and how its client behaves."""

    index: int
    prompt: str
    max_tokens: int
    temperature: float
    seed: int
    fate: str  # "complete" | "cancel" | "deadline"
    cancel_after: int = 0  # tokens before the client cancels
    deadline_s: float = 0.0

    def options(self) -> GenerateOptions:
        opts = GenerateOptions(max_tokens=self.max_tokens, ignore_eos=True, request_id=f"soak-{self.index}")
        if self.temperature > 0:
            opts["temperature"], opts["top_p"], opts["seed"] = self.temperature, 0.95, self.seed
        return opts

    def params(self) -> RequestParams:
        sampling = SamplingParams(temperature=self.temperature, top_p=0.95 if self.temperature else 1.0, seed=self.seed)
        return RequestParams(max_tokens=self.max_tokens, sampling=sampling, ignore_eos=True)


@dataclass(slots=True)
class Outcome:
    """What one request got in the run: its tokens, when each came, and how it ended."""

    tokens: list[tuple[int, int]] = field(default_factory=list)  # (id, depth)
    times: list[float] = field(default_factory=list)  # time.monotonic() of each token
    start: float = 0.0
    end: float = 0.0
    status: str = ""  # "complete" | "cancel" | "deadline" | an error name


def plan(n: int, seed: int, cancel: float, deadline: float, max_tokens: int) -> list[Planned]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = rng.randint(2, 12)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        length = rng.randint(max(2, max_tokens // 6), max_tokens)
        temperature = 0.8 if rng.random() < 0.5 else 0.0
        draw = rng.random()
        if draw < cancel:
            out.append(Planned(i, prompt, length, temperature, i, "cancel", cancel_after=rng.randint(1, length)))
        elif draw < cancel + deadline:
            out.append(Planned(i, prompt, length, temperature, i, "deadline", deadline_s=rng.uniform(0.05, 1.0)))
        else:
            out.append(Planned(i, prompt, length, temperature, i, "complete"))
    return out


def reference(config: EngineConfig, planned: list[Planned]) -> list[list[tuple[int, int]]]:
    """The fault-free tokens of every request, from an in-process engine."""
    with Engine(config) as engine:
        done = engine.generate([p.prompt for p in planned], [p.params() for p in planned])
    return [list(zip(c.token_ids, c.depths)) for c in done]
