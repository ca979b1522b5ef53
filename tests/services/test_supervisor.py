"""The supervisor of a process tree cannot fail quietly: children live until the tree stops whichever thread
started or restarted them, so a drain after restarts completes; restarts back off and give up after consecutive
failures however slow each one is; a child that cannot be started again stops the tree with one line and status
1; SIGHUP stops it as SIGTERM does.

Most tests run small stand-in children (``python -c``, no model) under a real ``ServeHandle``: a "stage" that
answers on a Unix socket and a "scheduler" whose SIGTERM handler drains by asking that stage for 0.3 s. Like the
real ones, each sets ``PR_SET_PDEATHSIG`` itself (``die_with_parent``'s call). The last test drains a real tree."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cdb_engine.config import EngineConfig
from cdb_scheduler.plan import Stage
from clients.messages import GenerateOptions
from clients.sync_client import Client
from services.launcher.foreground import wait_for_end
from services.launcher.restarts import RestartPolicy
from services.launcher.supervisor import ServeHandle
from services.net import wait_ready_file
from services.settings.knobs import Settings
from services.transport.segments import SHM_DIR
from tests.services.tree import StreamRun, process_tree

pytestmark = pytest.mark.timeout(60)

# argv: MODE READY EVENTS SOCKET GENERATIONS. Modes: stage (serves SOCKET), scheduler (drains against SOCKET),
# flaky (first run: ready, then waits to be killed; later runs: exit 3 after 0.4 s, never ready),
# brief (ready, then exit 3 after 0.1 s, every run).
CHILD = r"""
import ctypes, os, signal, socket, sys, time
mode, ready, events, sock, gens = sys.argv[1:6]
ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG, as die_with_parent
if os.getppid() != int(os.environ["CDB_PARENT_PID"]):
    os.kill(os.getpid(), signal.SIGTERM)

def note(text):
    with open(events, "a") as f:
        f.write(f"{text} {os.getpid()}\n")

def announce():
    with open(ready + ".tmp", "w") as f:
        f.write("ready")
    os.replace(ready + ".tmp", ready)

with open(gens, "a+") as f:
    f.seek(0)
    gen = len(f.read())
    f.write("x")
if mode == "stage":
    signal.signal(signal.SIGTERM, lambda *_: (note("stage-stopped"), os._exit(0)))
    if os.path.exists(sock):
        os.unlink(sock)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(sock)
    srv.listen(16)
    announce()
    while True:
        conn, _ = srv.accept()
        conn.sendall(b"ok")
        conn.close()
elif mode == "scheduler":
    def drain(*_):
        ok, end = True, time.monotonic() + 0.3
        while time.monotonic() < end:
            try:
                with socket.socket(socket.AF_UNIX) as c:
                    c.connect(sock)
                    ok = ok and c.recv(2) == b"ok"
            except OSError:
                ok = False
            time.sleep(0.02)
        note("drained" if ok else "drain-cut")
        os._exit(0)
    signal.signal(signal.SIGTERM, drain)
    announce()
    while True:
        signal.pause()
elif mode == "flaky" and gen == 0:
    announce()
    while True:
        signal.pause()
elif mode == "flaky":
    time.sleep(0.4)
    sys.exit(3)
elif mode == "brief":
    announce()
    time.sleep(0.1)
    sys.exit(3)
"""


class FakeTree:
    """A ServeHandle over stand-in children in ``tmp_path``."""

    def __init__(self, tmp_path: Path, settings: Settings | None = None) -> None:
        self.dir = tmp_path
        (tmp_path / "tree").mkdir()
        self.events = tmp_path / "events"
        self.events.touch()
        self.handle = ServeHandle(str(tmp_path / "tree"), settings or Settings())

    def ready_file(self, name: str) -> str:
        return str(self.dir / f"{name}.ready")

    def start(self, name: str, mode: str) -> subprocess.Popen[bytes]:
        ready = self.ready_file(name)
        argv = ["-c", CHILD, mode, ready, str(self.events), str(self.dir / "stage.sock"), str(self.dir / f"{name}.gen")]
        proc = self.handle.start_child(name, argv, None, ready)
        wait_ready_file(ready, proc, 20, name)
        return proc

    def lines(self) -> list[str]:
        return self.events.read_text().splitlines()


def wait_until(condition: object, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.02)  # the poll interval


def test_children_live_until_the_tree_stops_whichever_thread_started_or_restarted_them(tmp_path: Path) -> None:
    tree = FakeTree(tmp_path)
    starter = threading.Thread(target=lambda: (tree.start("loop", "stage"), tree.start("scheduler", "scheduler")))
    starter.start()
    starter.join()  # the thread that asked for the children is gone; they must not follow it
    tree.handle.supervise()
    old = tree.handle.stages[Stage.LOOP].pid
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: tree.handle.restarts and os.path.exists(tree.ready_file("loop")), "the loop restarted")
    new = tree.handle.stages[Stage.LOOP].pid
    scheduler = tree.handle.scheduler
    assert scheduler is not None and new != old and tree.lines() == []
    tree.handle.stop(drain_timeout=5.0)
    # The scheduler drained against the restarted stage, which was stopped only after it.
    assert tree.lines() == [f"drained {scheduler.pid}", f"stage-stopped {new}"]
    assert all(p.poll() is not None for p in tree.handle.processes())


def test_restart_delays_double_up_to_the_cap() -> None:
    policy = RestartPolicy(backoff_s=0.5, backoff_max_s=3.0, limit=6)
    assert [policy.delay(n) for n in range(1, 7)] == [0.0, 0.5, 1.0, 2.0, 3.0, None]


def test_restarts_back_off_and_give_up_after_consecutive_failures_however_slow(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(restart_limit=4, restart_backoff_s=0.2, restart_backoff_max_s=0.3)
    tree = FakeTree(tmp_path, settings)
    tree.start("loop", "flaky")  # runs 2..4 each fail after 0.4 s without serving: slower than the backoff
    tree.handle.supervise()
    with caplog.at_level(logging.WARNING, logger="cdb.launcher"):
        os.kill(tree.handle.stages[Stage.LOOP].pid, signal.SIGKILL)
        assert tree.handle.ended.wait(20), "the supervisor never gave up"
    restarts = tree.handle.restarts
    assert [(r.name, r.code, r.streak) for r in restarts] == [("loop", -9, 1), ("loop", 3, 2), ("loop", 3, 3)]
    waits = [r.started_at - r.exited_at for r in restarts]
    assert waits[0] < 0.2 and waits[1] >= 0.2 and waits[2] >= 0.3, waits  # at once, then backoff (capped)
    assert tree.handle.failed == "the loop stage exited with code 3, 4 times in a row without serving"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [f"cdb: {tree.handle.failed}; stopping the tree"]
    assert wait_for_end(tree.handle, threading.Event()) == 1


def test_a_child_that_serves_again_starts_a_new_streak(tmp_path: Path) -> None:
    tree = FakeTree(tmp_path, Settings(restart_limit=2, restart_backoff_s=5.0))
    tree.start("loop", "brief")  # each run serves, then exits 3
    tree.handle.supervise()
    try:
        wait_until(lambda: len(tree.handle.restarts) >= 3, "three restarts")
        assert not tree.handle.given_up and [r.streak for r in tree.handle.restarts[:3]] == [1, 1, 1]
    finally:
        tree.handle.stop(drain_timeout=1.0)


@pytest.mark.parametrize("bad", ["missing", "not executable"])
def test_a_child_that_cannot_be_started_again_stops_the_tree_with_one_line_and_status_1(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: str
) -> None:
    tree = FakeTree(tmp_path)
    tree.start("loop", "stage")
    scheduler = tree.start("scheduler", "scheduler")
    tree.handle.supervise()
    binary = tmp_path / "python"
    if bad == "not executable":
        binary.write_text("#!/bin/sh\n")
    tree.handle.python = str(binary)  # from now on the interpreter cannot be run
    with caplog.at_level(logging.WARNING, logger="cdb.launcher"):
        os.kill(tree.handle.stages[Stage.LOOP].pid, signal.SIGKILL)
        assert tree.handle.ended.wait(20), "the supervisor did not stop the tree"
    failed = tree.handle.failed
    assert failed is not None and failed.startswith("cannot start the loop stage (") and str(binary) in failed
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [f"cdb: {failed}; stopping the tree"]
    assert scheduler.poll() == 0 and tree.lines() == [f"drain-cut {scheduler.pid}"]  # stopped, in order
    assert wait_for_end(tree.handle, threading.Event()) == 1


def test_sighup_stops_the_tree_gracefully_with_status_0(tmp_path: Path) -> None:
    script = f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from services.launcher.foreground import stop_signals, wait_for_end
        from tests.services.test_supervisor import FakeTree
        stop = stop_signals()
        tree = FakeTree(Path({str(tmp_path)!r}))
        tree.start("loop", "stage")
        tree.start("scheduler", "scheduler")
        tree.handle.supervise()
        print(*(p.pid for p in tree.handle.processes()), flush=True)  # the scheduler, then the stage
        sys.exit(wait_for_end(tree.handle, stop))
    """
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        scheduler, stage = launcher.stdout.readline().split()
        launcher.send_signal(signal.SIGHUP)
        assert launcher.wait(timeout=30) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert (tmp_path / "events").read_text().splitlines() == [f"drained {scheduler}", f"stage-stopped {stage}"]


CONFIG = EngineConfig(model="ouro-tiny", max_num_seqs=4, num_kv_blocks=256, max_waiting=16)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_tree_start_sweeps_stale_segments_and_a_drain_after_a_stage_restart_completes_its_streams() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = Path(SHM_DIR) / f"cdb-bank-{dead.pid}-{os.stat('/proc/self/ns/pid').st_ino}-0123456789ab"
    stale.write_bytes(b"\0" * 4096)  # a segment of a tree that was SIGKILLed whole
    try:
        with process_tree(CONFIG) as tree, Client(tree.address, timeout=60) as client:
            assert not stale.exists(), "the tree's start did not sweep a dead owner's segment"
            old = tree.stages[Stage.HEAD].pid
            os.kill(old, signal.SIGKILL)
            wait_until(lambda: tree.stages[Stage.HEAD].pid != old, "the head stage restarted", 30)
            client.wait_for_status("SERVING", timeout=60)
            run = StreamRun(client, "a drain", GenerateOptions(max_tokens=48, ignore_eos=True)).start()
            assert run.first.wait(30) and run.error is None
            tree.stop(drain_timeout=60.0)  # SIGTERM to the scheduler: it drains over the restarted stage
            assert run.done.wait(5) and run.error is None, run.error
            assert run.finish is not None and run.finish.finish_reason == "length" and len(run.tokens) == 48
    finally:
        stale.unlink(missing_ok=True)
