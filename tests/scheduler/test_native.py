"""The compiled scheduler (``cdb_scheduler._native``): used exactly when its build matches the sources and this
interpreter, never stale, and off with ``CDB_NATIVE=off``."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TypeVar

import pytest

import cdb_scheduler
from cdb_scheduler import _native
from cdb_scheduler.sampling import LogitsProcessing, SamplingParams

_T = TypeVar("_T")

_PROBE = "import cdb_scheduler, cdb_scheduler.scheduler as s; print(cdb_scheduler.NATIVE, s.__file__)"


def _copy_package(tmp_path: Path) -> Path:
    package = tmp_path / "cdb_scheduler"
    shutil.copytree(_native.PACKAGE, package, ignore=shutil.ignore_patterns("_native_build", "__pycache__"))
    return package


def _manifest(package: Path, build: Path, **override: object) -> None:
    build.mkdir(parents=True, exist_ok=True)
    manifest = {
        "cache_tag": sys.implementation.cache_tag,
        "sources": {p.name: _native._digest(p) for p in _native.sources(package)},
        **override,
    }
    (build / _native.MANIFEST).write_text(json.dumps(manifest))


def test_a_build_of_the_current_sources_is_fresh_and_an_edit_makes_it_stale(tmp_path: Path) -> None:
    package, build = _copy_package(tmp_path), tmp_path / "build"
    assert "not built" in (_native.fresh(build, package) or "")
    _manifest(package, build)
    assert _native.fresh(build, package) is None
    edited = package / "scheduler.py"
    edited.write_text(edited.read_text() + "\n# edited\n")
    assert _native.fresh(build, package) == "edited since the build: scheduler.py"
    _manifest(package, build)
    (package / "extra.py").write_text("X = 1\n")
    assert _native.fresh(build, package) == "the package's modules changed since the build"


def test_a_build_for_another_interpreter_is_not_used(tmp_path: Path) -> None:
    package, build = _copy_package(tmp_path), tmp_path / "build"
    _manifest(package, build, cache_tag="cpython-299")
    assert _native.fresh(build, package) == f"built for cpython-299, running {sys.implementation.cache_tag}"


def test_what_is_compiled_leaves_out_the_deciding_modules() -> None:
    names = {p.name for p in _native.sources()}
    assert {"scheduler.py", "ops.py", "plan.py", "exit_policy.py"} <= names
    assert not names & {"__init__.py", "_native.py"}


def _probe(**env: str) -> tuple[bool, str]:
    run = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    native, path = run.stdout.split()
    return native == "True", path


def test_the_scheduler_runs_compiled_exactly_where_its_build_is_fresh() -> None:
    """``make install`` builds it: where that build matches, every process runs it; ``CDB_NATIVE=off`` never."""
    why = _native.fresh()
    native, path = _probe()
    assert native is (why is None)
    assert cdb_scheduler.NATIVE is (why is None and os.environ.get("CDB_NATIVE", "auto").lower() not in _native.OFF)
    assert path.endswith(".py") is (why is not None)
    assert _probe(CDB_NATIVE="off") == (False, str(_native.PACKAGE / "scheduler.py"))


@pytest.mark.skipif(_native.fresh() is not None, reason="the compiled scheduler is not built here")
def test_the_compiled_scheduler_is_the_build_in_the_package() -> None:
    native, path = _probe()
    assert native and Path(path).parent == _native.BUILD / "cdb_scheduler"


def test_frozen_plan_classes_pickle_every_field() -> None:
    """``SamplingParams`` / ``LogitsProcessing`` pickle as a hand-written field list (a compiled frozen class must):
    every field, set away from its default, comes back; a field added to the class and not to its ``__reduce__``
    fails here (the values below must name every field)."""
    processing = _every_field(
        LogitsProcessing,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.5,
        logit_bias=((3, 2.0), (7, -1.0)),
        min_tokens=4,
        stop_ids=(0, 2),
    )
    params = _every_field(
        SamplingParams,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        seed=12345,
        logprobs=3,
        return_logprob=True,
        processing=processing,
    )
    for value in (processing, params):
        back = pickle.loads(pickle.dumps(value))
        assert type(back) is type(value)
        assert {f.name: getattr(back, f.name) for f in dataclasses.fields(back)} == {
            f.name: getattr(value, f.name) for f in dataclasses.fields(value)
        }


def _every_field(cls: type[_T], **values: object) -> _T:
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    assert {f.name for f in fields} == set(values), f"set every field of {cls.__name__}"
    assert all(values[f.name] != f.default for f in fields), "away from its default"
    return cls(**values)
