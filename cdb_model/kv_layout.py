"""Loop-KV depth policies and their slot layout: which depth slot a loop step writes and reads (no torch: the
scheduler's process and its settings use them without loading the model's runtime)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class KVPolicy(enum.StrEnum):
    """Which loop-KV depth slot a token at step ``s`` writes and reads."""

    DEPTH_INDEXED = "depth_indexed"  # r slots, step s -> slot s (as trained)
    LAST_EXITED = "last_exited"  # r slots, step s -> slot s, exit slot copied into the deeper slots
    SINGLE = "single"  # 1 slot, the last written KV
    FIRST_THEN_SHARED = "first_then_shared"  # k slots, step s -> min(s, k - 1)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Depth-slot mapping of the loop KV for a policy and a maximum depth ``max_depth`` (steps 0-based)."""

    policy: KVPolicy
    max_depth: int
    shared_after: int = 2  # k of first_then_shared

    def __post_init__(self) -> None:
        if self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")
        if self.policy is KVPolicy.FIRST_THEN_SHARED and not 1 <= self.shared_after <= self.max_depth:
            raise ValueError(f"shared_after must be in [1, {self.max_depth}], got {self.shared_after}")

    @property
    def n_slots(self) -> int:
        if self.policy is KVPolicy.SINGLE:
            return 1
        if self.policy is KVPolicy.FIRST_THEN_SHARED:
            return self.shared_after
        return self.max_depth

    @property
    def copies_on_exit(self) -> bool:
        """True when an exit after step e must copy slot e into the deeper slots (``last_exited``)."""
        return self.policy is KVPolicy.LAST_EXITED

    def slot(self, step: int) -> int:
        """The depth slot written and read by loop step ``step`` (0-based)."""
        if not 0 <= step < self.max_depth:
            raise ValueError(f"step {step} outside [0, {self.max_depth})")
        if self.policy is KVPolicy.SINGLE:
            return 0
        if self.policy is KVPolicy.FIRST_THEN_SHARED:
            return min(step, self.shared_after - 1)
        return step
