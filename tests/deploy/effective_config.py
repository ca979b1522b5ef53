"""The configuration each cdb process of a deployment runs with: its command line AND its environment (``CDB_*``
variables, a ``CDB_CONFIG`` file), resolved by the processes' own resolution (``cdb.processes``) without starting
anything; and what the children of ``services.launcher`` resolve from the one document it hands them.

A deployment is consistent when its four processes run one engine config, and that configuration, handed over as
the launcher hands it (``--resolved-config FILE``), is exactly what each of a launcher's children would run.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

from cdb.processes import process_resolution
from cdb_engine.config import EngineConfig
from cdb_scheduler.plan import Stage
from services.launcher.commands import scheduler_command, stage_command
from services.settings.resolved import Resolved

STAGES = ("prelude", "loop", "head")


def effective(argv: list[str], environ: Mapping[str, str]) -> Resolved:
    """``python -m cdb stage|scheduler ...`` (``argv`` as the deployment runs it) in ``environ``."""
    assert argv[:3] == ["python", "-m", "cdb"] and argv[3] in ("stage", "scheduler", "frontend"), argv
    return process_resolution(argv[3], argv[4:], {k: str(v) for k, v in environ.items()})


def launcher_commands(document: str) -> dict[str, list[str]]:
    """The commands ``services.launcher`` runs for a tree whose configuration document is ``document``, by child
    name (addresses are placeholders)."""
    socks = {stage: f"unix:///{stage.role}" for stage in Stage}
    out = {s.role: ["python", *stage_command(s.role, addr, "/ready", document)] for s, addr in socks.items()}
    out["scheduler"] = ["python", *scheduler_command("127.0.0.1:0", "/ready", socks, {}, document)]
    return out


def check_consistent(processes: Mapping[str, tuple[list[str], Mapping[str, str]]]) -> EngineConfig:
    """Assert that the four processes (name -> (argv, environment)) run one engine config, and that a launcher's
    children, handed the scheduler's configuration, run exactly it whatever their environment; return the engine
    config."""
    resolved = {name: effective(argv, env) for name, (argv, env) in processes.items()}
    sched = resolved["scheduler"]
    for role in STAGES:
        assert resolved[role].engine == sched.engine, f"{role} disagrees with the scheduler"
    with tempfile.TemporaryDirectory() as folder:
        document = os.path.join(folder, "config.json")
        sched.write(document)
        for name, argv in launcher_commands(document).items():
            assert effective(argv, processes[name][1]) == sched, f"the launcher's {name} would run another config"
    return sched.engine
