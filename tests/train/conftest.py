"""Fixtures of the training tests: the shipped checkpoint, loaded once."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdb_model.loader import load_model
from cdb_model.ouro import OuroLM

FOLDER = Path(__file__).resolve().parents[2] / "models" / "ouro-kjv"


@pytest.fixture(scope="session")
def model() -> OuroLM:
    m = load_model(str(FOLDER))
    assert isinstance(m, OuroLM)
    return m
