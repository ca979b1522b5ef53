"""Fixtures of the model tests: the golden checkpoints (``/work/shared/golden`` next to the checkout)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cdb_model.base import LoopedLM
from cdb_model.loader import load_model

GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden"


def golden_dir(name: str) -> Path:
    path = GOLDEN / name
    if not (path / "model.safetensors").is_file():
        message = f"golden test vectors not found at {path} (expected the shared folder next to the checkout)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI always has them: a missing folder must not pass as a skip
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def ouro_golden() -> tuple[LoopedLM, dict[str, torch.Tensor]]:
    path = golden_dir("ouro-tiny")
    return load_model(str(path)), load_file(str(path / "expected.safetensors"))


@pytest.fixture(scope="session")
def huginn_golden() -> tuple[LoopedLM, dict[str, torch.Tensor]]:
    path = golden_dir("huginn-tiny")
    return load_model(str(path)), load_file(str(path / "expected.safetensors"))
