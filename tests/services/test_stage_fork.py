"""Stage processes forked from the tree's zygote (``CDB_STAGE_FORK``, ``services.launcher.zygote``): each is the
launcher's own child (reaped, signalled and restarted as any child), named ``cdb-ROLE``; a zygote that has died
is started again at the next stage (re)start; with the knob off every stage is a fresh interpreter."""

from __future__ import annotations

import os
import resource
import signal
import time
from pathlib import Path

import pytest

from cdb_engine.config import EngineConfig
from cdb_scheduler.plan import Stage
from clients.sync_client import Client
from services.launcher.supervisor import ServeHandle
from tests.services.tree import SharedTree, process_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CONFIG = EngineConfig(model="ouro-tiny", dtype="float64", max_num_seqs=4, num_kv_blocks=256)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")


def test_the_stages_are_the_launchers_children_forked_by_the_zygote(ouro_tiny_tree: SharedTree) -> None:
    for stage, proc in ouro_tiny_tree.handle.stages.items():
        assert _parent(proc.pid) == os.getpid(), "re-parented to the launcher (this process)"
        assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == f"cdb-{stage.role}"
        assert b"cdb.zygote" in _cmdline(proc.pid) and proc.poll() is None


def _replaced(tree: ServeHandle, stage: Stage, pid: int) -> int:
    deadline = time.monotonic() + 60
    while (new := tree.stages[stage]).pid in (pid, -1) or new.poll() is not None:
        assert time.monotonic() < deadline, f"the {stage.role} stage was not restarted"
        time.sleep(0.05)  # the poll interval
    return new.pid


def test_a_stage_killed_after_its_zygote_died_is_restarted_by_a_new_zygote() -> None:
    with process_tree(CONFIG) as tree, Client(tree.address, timeout=60) as client:
        before = client.generate("And God said", max_tokens=6, ignore_eos=True).token_ids
        zygote = tree._zygote
        assert zygote is not None and zygote.alive
        zygote.proc.kill()
        zygote.proc.wait()
        loop = tree.stages[Stage.LOOP].pid
        os.kill(loop, signal.SIGKILL)
        new = _replaced(tree, Stage.LOOP, loop)
        assert _parent(new) == os.getpid() and tree._zygote is not zygote and tree._zygote.alive
        assert [r.code for r in tree.restarts] == [-signal.SIGKILL]
        client.wait_for_status("SERVING", timeout=60)
        assert client.generate("And God said", max_tokens=6, ignore_eos=True).token_ids == before


def test_without_forking_each_stage_is_a_fresh_interpreter() -> None:
    with process_tree(CONFIG, CDB_STAGE_FORK="false") as tree, Client(tree.address, timeout=60) as client:
        assert tree._zygote is None
        for stage, proc in tree.stages.items():
            argv = _cmdline(proc.pid)
            assert argv[argv.index(b"--role") + 1] == stage.role.encode() and b"stage" in argv
        assert len(client.generate("And God said", max_tokens=4, ignore_eos=True).token_ids) == 4


def _open_files(pid: int) -> tuple[str, str]:
    line = next(x for x in Path(f"/proc/{pid}/limits").read_text().splitlines() if x.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return soft, hard


def test_every_process_of_a_tree_raises_its_open_files_limit_to_the_hard_one() -> None:
    """Started under a soft limit of 1,024 (a common default; a server's connections outgrow it long before the
    host's limit), each process of the tree raises its own to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        with process_tree(CONFIG) as tree:
            procs = tree.processes()
            assert len(procs) == 4
            for proc in procs:
                got = _open_files(proc.pid)
                assert got[0] == got[1] or (got[1] == "unlimited" and int(got[0]) >= 1 << 20), (proc.pid, got)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
