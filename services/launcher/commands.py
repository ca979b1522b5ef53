"""The command line of each child of the tree: its place in the tree (role, addresses, ready file) and the tree's
configuration document (``--resolved-config``); no setting travels in argv or the environment."""

from __future__ import annotations

from collections.abc import Mapping

from cdb_scheduler.plan import Stage

STANDBY_SUFFIX = "-standby"  # the child name of a role's warm standby stage (``CDB_STANDBY_STAGES``)
FRONTEND_PREFIX = "frontend-"  # child names of the front-end processes (``CDB_FRONTENDS``): frontend-0, ...


def stage_command(role: str, listen: str, ready_file: str, document: str) -> list[str]:
    """``python ARGV`` of a stage child: its place in the tree, and the tree's configuration ``document``."""
    place = ["--role", role, "--listen", listen, "--ready-file", ready_file]
    return ["-m", "cdb", "stage", *place, "--resolved-config", document]


def scheduler_command(
    listen: str, ready_file: str, stages: Mapping[Stage, str], standbys: Mapping[Stage, str], document: str
) -> list[str]:
    """``python ARGV`` of the scheduler child: its addresses and its stages', and the tree's ``document``."""
    place = ["--listen", listen, "--ready-file", ready_file]
    place += [f"--stage={s.role}={addr}" for s, addr in stages.items()]
    place += [f"--standby-stage={s.role}={addr}" for s, addr in standbys.items()]
    return ["-m", "cdb", "scheduler", *place, "--resolved-config", document]


def frontend_command(listen: str, ready_file: str, link: str, document: str, join: bool) -> list[str]:
    """``python ARGV`` of a front-end child (``CDB_FRONTENDS``): its public address, the scheduler's link."""
    place = ["--listen", listen, "--ready-file", ready_file, f"--link={link}", *(["--join"] if join else [])]
    return ["-m", "cdb", "frontend", *place, "--resolved-config", document]
