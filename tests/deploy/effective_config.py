"""The engine configuration each cdb process of a deployment runs with: its command line AND its environment
(``CDB_*`` variables, a ``CDB_CONFIG`` file), resolved by the processes' own parsers (``cdb.processes``) without
starting anything; and the same for the commands ``services.launcher`` gives its children for a config.

A deployment is consistent when the four processes agree on what a stage loads (model, dtype, device) and the
scheduler runs exactly the config whose launcher children would run it.
"""

from __future__ import annotations

from collections.abc import Mapping

from cdb.processes import STAGE_ENGINE_FIELDS, process_config
from cdb_engine.config import EngineConfig
from cdb_engine.options import engine_config_to_argv

STAGES = ("prelude", "loop", "head")


def effective(argv: list[str], environ: Mapping[str, str]) -> EngineConfig:
    """``python -m cdb stage|scheduler ...`` (``argv`` as the deployment runs it) in ``environ``."""
    assert argv[:3] == ["python", "-m", "cdb"] and argv[3] in ("stage", "scheduler"), argv
    return process_config(argv[3], argv[4:], {k: str(v) for k, v in environ.items()})


def stage_view(config: EngineConfig) -> dict[str, str]:
    """What a stage loads and ``Configure`` checks: model, dtype, device."""
    return {name: str(getattr(config, name)) for name in STAGE_ENGINE_FIELDS}


def launcher_argv(config: EngineConfig, environ: Mapping[str, str]) -> dict[str, list[str]]:
    """The commands ``services.launcher.serve_all(config)`` runs, by child name (its ``_start_tree``: the stages
    get ``--model/--dtype/--device``, the scheduler ``engine_config_to_argv``; addresses are placeholders)."""
    engine = ["--model", config.model, "--dtype", config.dtype, "--device", config.device]
    stage = ["python", "-m", "cdb", "stage"]
    out = {role: [*stage, "--role", role, "--listen", f"unix:///{role}", *engine] for role in STAGES}
    sched = ["python", "-m", "cdb", "scheduler", "--listen", "127.0.0.1:0"]
    out["scheduler"] = sched + [f"--stage={r}=unix:///{r}" for r in STAGES] + engine_config_to_argv(config, environ)
    return out


def check_consistent(processes: Mapping[str, tuple[list[str], Mapping[str, str]]]) -> EngineConfig:
    """Assert that the four processes (name -> (argv, environment)) agree and that the scheduler's config is what
    the launcher's children would run in the same environments; return the scheduler's config."""
    configs = {name: effective(argv, env) for name, (argv, env) in processes.items()}
    sched = configs["scheduler"]
    for role in STAGES:
        assert stage_view(configs[role]) == stage_view(sched), f"{role} disagrees with the scheduler"
    for name, argv in launcher_argv(sched, processes["scheduler"][1]).items():
        got = effective(argv, processes[name][1])
        if name == "scheduler":
            assert got == sched, "the launcher's scheduler would run another config"
        else:
            assert stage_view(got) == stage_view(sched), f"the launcher's {name} stage would load another model"
    return sched
