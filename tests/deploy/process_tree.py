"""A deployment's cdb processes started directly as child processes on loopback (no Docker, no Kubernetes here).

The commands come from a deployment file (docker-compose.yml or the rendered Kubernetes Pod); ``Remap`` moves
them onto this machine consistently across commands, environments and probes: ``0.0.0.0`` listeners onto
127.0.0.1, the fixed ports onto free loopback ports, and container paths (volume mounts) onto local folders.
Each process is then probed with the same ``python -m services.healthcheck`` the deployment's checks run.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cdb_bench.processes import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Remap:
    """Container addresses and paths -> this machine's: ``ports`` (fixed -> free), ``paths`` (mount -> folder)."""

    ports: dict[int, int]
    paths: dict[str, str] = field(default_factory=dict)

    @classmethod
    def free(cls, ports: Iterable[int], paths: Mapping[str, str | Path] | None = None) -> Remap:
        return cls({p: free_port() for p in ports}, {k: str(v) for k, v in (paths or {}).items()})

    def __call__(self, text: str) -> str:
        scheme = "unix:" if text.startswith("unix:/") else ""  # a Unix socket address: its path moves
        text = text[len(scheme) :]
        for mount, local in self.paths.items():
            if text == mount or text.startswith(mount + "/"):
                text = local + text[len(mount) :]
        text = scheme + text
        text = text.replace("0.0.0.0:", "127.0.0.1:")
        return re.sub(r"(?<=:)(\d{4,5})\b", lambda m: str(self.ports.get(int(m[1]), m[1])), text)


@dataclass
class ProcessSpec:
    """One process: ``argv`` as the deployment runs it (``python -m ...``), its environment and health address."""

    name: str
    argv: list[str]
    env: dict[str, str]
    probe: str


def run_once(argv: list[str], env: Mapping[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """A one-shot command of the deployment (``python -m ...``), run to completion here."""
    assert argv[0] == "python", argv
    cmd, env = [sys.executable, *argv[1:]], {**env, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


class ProcessTree:
    """The processes of ``specs`` running here; ``probe(name)`` runs the deployment's health probe on each."""

    def __init__(self, specs: Iterable[ProcessSpec], workdir: Path) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.addr: dict[str, str] = {}
        self.logs: dict[str, Path] = {}
        for spec in specs:
            assert spec.argv[0] == "python", spec.argv
            self.addr[spec.name] = spec.probe
            self.logs[spec.name] = workdir / f"{spec.name}.log"
            env = {**spec.env, "OTEL_TRACES_EXPORTER": "none", "PYTHONPATH": str(ROOT)}
            with open(self.logs[spec.name], "wb") as log:
                self.procs[spec.name] = subprocess.Popen(
                    [sys.executable, *spec.argv[1:]], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
                )

    def probe(self, name: str, wait: float) -> subprocess.CompletedProcess[str]:
        """The health probe of ``name``, repeated (``--wait 5`` each) until SERVING, the process exits, or
        ``wait`` seconds pass."""
        cmd = [sys.executable, "-m", "services.healthcheck", self.addr[name], "--wait", "5"]
        deadline = time.monotonic() + wait
        while True:
            run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
            if run.returncode == 0 or self.procs[name].poll() is not None or time.monotonic() > deadline:
                return run

    def tail(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
