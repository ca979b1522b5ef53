"""``cdb demo`` (what ``make run`` shows): the shipped trained model streams readable text, depth by depth."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_streams_readable_text_with_depths_and_a_depth_summary() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cdb", "demo", "--no-colour", "--max-tokens", "24"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
        check=True,
    ).stdout
    assert "for ouro-kjv" in out and "And God said unto Moses," in out
    marks = re.findall(r"([^\[\]\n]*)\[([1-4])\]", out.split("And God said unto Moses,", 1)[1])
    assert len(marks) >= 20, out
    words = re.findall(r"[A-Za-z]{3,}", " ".join(text for text, _ in marks))
    assert len(words) >= 5, f"the shipped model should write words: {out}"
    assert re.search(r"mean depth \d\.\d\d of 4: \d+ % of the loop compute saved", out)
    assert re.search(r"served depths  1: \d+ .*4: \d+", out)
