"""The Dockerfile, parsed without Docker: its default command serves the whole tree, it runs as a numeric
non-root user that owns the paths it writes, and it agrees with the compose file and the Kubernetes Pod."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from tests.deploy.compose_file import (
    LINK_DIR,
    POD_SERVICE,
    ROOT,
    SECRET_SERVICE,
    command_argv,
    flag_values,
    interpolate,
    load,
)

DOCKERFILE = ROOT / "Dockerfile"


def parse(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comment lines dropped, ``\\`` continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        pending += (" " if pending else "") + line.rstrip("\\").strip()
        if not line.endswith("\\"):
            instruction, _, rest = pending.partition(" ")
            out.append((instruction.upper(), rest.strip()))
            pending = ""
    assert not pending, "a continuation line ends the file"
    return out


def _all(instructions: list[tuple[str, str]], name: str) -> list[str]:
    return [rest for inst, rest in instructions if inst == name]


@pytest.fixture(scope="module")
def instructions() -> list[tuple[str, str]]:
    return parse(DOCKERFILE.read_text())


def test_parser() -> None:
    text = 'FROM a\n# c\nRUN x \\\n    # inside\n    && y\nCMD ["p", "q"]\n'
    assert parse(text) == [("FROM", "a"), ("RUN", "x && y"), ("CMD", '["p", "q"]')]


def test_the_entrypoint_serves_the_whole_tree_and_takes_the_run_arguments(instructions: list[tuple[str, str]]) -> None:
    (entry,) = _all(instructions, "ENTRYPOINT")
    assert _all(instructions, "CMD") == ["[]"], "docker run IMAGE MODEL --flag ...: the arguments go to cdb serve"
    argv = json.loads(entry)  # exec form: no shell in between, SIGTERM reaches `cdb serve` itself
    assert argv[:4] == ["python", "-m", "cdb", "serve"]
    assert flag_values(argv, "--listen") == ["0.0.0.0:50051"], "all interfaces inside; the host binding restricts"
    assert flag_values(argv, "--metrics-listen") == ["0.0.0.0:9464"]


def test_default_command_flags_exist() -> None:
    """Every flag of the entrypoint is one that ``cdb serve`` takes (asks the real parser, without serving)."""
    (cmd,) = _all(parse(DOCKERFILE.read_text()), "ENTRYPOINT")
    flags = [a for a in json.loads(cmd) if a.startswith("--")]
    run = subprocess.run(
        [sys.executable, "-m", "cdb", "serve", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    for flag in flags:
        assert re.search(rf"(^|\s){re.escape(flag)}\b", run.stdout), flag


def test_runs_as_a_numeric_non_root_user(instructions: list[tuple[str, str]]) -> None:
    users = _all(instructions, "USER")
    assert users, "a USER instruction"
    m = re.fullmatch(r"(\d+):(\d+)", users[-1])
    assert m, f"USER {users[-1]!r}: numeric uid:gid, so runAsNonRoot can verify it"
    uid, gid = m.groups()
    assert int(uid) > 0 and int(gid) > 0
    assert [inst for inst, _ in instructions].index("USER") > max(
        i for i, (inst, rest) in enumerate(instructions) if inst == "RUN" and "useradd" in rest
    ), "the user exists before it is used"
    script = " ".join(_all(instructions, "RUN"))
    assert f"groupadd --gid {gid}" in script and f"useradd --uid {uid} --gid {gid}" in script


def test_the_user_owns_the_paths_it_writes(instructions: list[tuple[str, str]]) -> None:
    uid_gid = _all(instructions, "USER")[-1]
    (run,) = [r for r in _all(instructions, "RUN") if "useradd" in r]
    chowned = set()
    for command in run.split("&&"):
        words = shlex.split(command)
        if words[:2] == ["chown", uid_gid]:
            chowned.update(words[2:])
    assert "/models" in chowned
    # compose mounts the stage-secret volume there; a new named volume copies this folder's owner and mode.
    init = interpolate(load(), {})["services"][SECRET_SERVICE]
    (out,) = flag_values(command_argv(init), "--out")
    assert out.rsplit("/", 1)[0] in chowned
    assert "chmod 0700 " + out.rsplit("/", 1)[0] in run
    assert LINK_DIR in chowned and LINK_DIR in run.split("chmod 0700", 1)[1], "the front-end override's link volume"


def test_ports_agree_with_compose(instructions: list[tuple[str, str]]) -> None:
    (expose,) = _all(instructions, "EXPOSE")
    exposed = {int(p) for p in expose.split()}
    pod = interpolate(load(), {})["services"][POD_SERVICE]
    assert exposed == {int(spec.rsplit(":", 1)[1]) for spec in pod["ports"]} == {50051, 8000, 9464}
    env = " ".join(_all(instructions, "ENV"))
    assert "CDB_HTTP_ADDR=0.0.0.0:8000" in env, "the HTTP API on its exposed port"


def test_build_arguments(instructions: list[tuple[str, str]]) -> None:
    assert _all(instructions, "FROM") == ["python:${PYTHON_VERSION}-slim AS base", "base AS native", "base"]
    args = set(_all(instructions, "ARG"))
    assert {"PYTHON_VERSION=3.11", "TORCH_VERSION=2.13.0"} <= args
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in args, "CPU torch by default"
    script = " ".join(_all(instructions, "RUN"))
    assert '"torch==${TORCH_VERSION}"' in script and "pip install /app" in script


def test_the_image_runs_the_compiled_scheduler(instructions: list[tuple[str, str]]) -> None:
    """Built in a stage of its own (the compiler and mypy stay out of the image), checked in use in the image."""
    stages: list[str] = [""]  # the preamble (ARGs), then each stage's instructions from its FROM
    for inst, rest in instructions:
        if inst == "FROM":
            stages.append("")
        stages[-1] += f"{inst} {rest}\n"
    native = next(stage for stage in stages if stage.startswith("FROM base AS native"))
    assert "gcc" in native and "cdb native build" in native
    mypy = re.search(r'"mypy==([\d.]+)"', native)
    assert mypy and f'"mypy=={mypy.group(1)}"' in (ROOT / "pyproject.toml").read_text(), "the dev extra's mypy"
    final = stages[-1]
    assert final.startswith("FROM base\n") and "COPY --from=native" in final and "gcc" not in final
    assert 'cdb native status | grep -q "compiled (mypyc)"' in final
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "cdb_scheduler/_native_build" in ignored, "never a build made for the host's interpreter"


def test_dockerignore_keeps_only_the_shipped_model() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests", "models/*", "!models/ouro-kjv"} <= set(ignored)


def test_the_health_check_asks_the_served_port(instructions: list[tuple[str, str]]) -> None:
    (check,) = _all(instructions, "HEALTHCHECK")
    options, _, cmd = check.partition(" CMD ")
    argv = json.loads(cmd)
    assert argv[:3] == ["python", "-m", "services.healthcheck"]
    (entry,) = _all(instructions, "ENTRYPOINT")
    port = flag_values(json.loads(entry), "--listen")[0].rsplit(":", 1)[1]
    assert argv[3] == f"127.0.0.1:{port}" and "--start-period=" in options


def test_compose_runs_its_own_commands_not_the_entrypoint() -> None:
    services = interpolate(load(), {})["services"]
    cdb = [name for name, svc in services.items() if str(svc.get("image", "")).startswith("cdb")]
    assert cdb and all(services[name].get("entrypoint") == [] for name in cdb), "entrypoint reset, command runs"
