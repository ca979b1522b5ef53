"""Shared memory that cleans up and fails clearly: segments named by their owner and swept once it is gone (never
a live owner's), space reserved up front so that a full ``/dev/shm`` is an error naming it, and a bank whose name
was unlinked re-created when the stages are re-attached."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from cdb_scheduler.plan import Fence, HeadOp, LoopOp, Stage, StageLoss, StageResult
from cdb_scheduler.sampling import SamplingParams
from services.transport.bank import SharedBank
from services.transport.executor import GrpcExecutor
from services.transport.segments import (
    SHM_DIR,
    SharedMemoryFull,
    new_segment_name,
    still_linked,
    sweep_stale_segments,
)
from tests.services.stage_harness import FAST, FakeWorker, fake_model, fake_setup, restart_stage, stage_servers

pytestmark = pytest.mark.timeout(60)


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_segment_name_carries_its_owner_pid_and_pid_namespace() -> None:
    kind, pid, ns, token = new_segment_name("bank").split("-")[1:]
    assert (kind, int(pid), int(ns)) == ("bank", os.getpid(), _pid_namespace()) and len(token) == 12


def test_a_sweep_removes_the_segments_of_dead_owners_only(tmp_path: Path) -> None:
    here, dead = _pid_namespace(), _dead_pid()
    files = {
        "dead owner here": f"cdb-bank-{dead}-{here}-00000000000a",
        "owner of another pid namespace, lock gone": f"cdb-fence-1-{here + 1}-00000000000b",
        "live owner here, not locked yet": f"cdb-bank-{os.getpid()}-{here}-00000000000c",
        "live owner elsewhere, holding its lock": f"cdb-bank-1-{here + 1}-00000000000d",
        "dead pid here, but a process holds its lock": f"cdb-bank-{dead}-{here}-00000000000e",
        "named before owners were": "cdb-bank-0123456789ab",
        "not ours": "psm_12345678",
    }
    for name in files.values():
        (tmp_path / name).write_bytes(b"\0" * 64)
    held = []
    for key in ("live owner elsewhere, holding its lock", "dead pid here, but a process holds its lock"):
        fd = os.open(tmp_path / files[key], os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)  # what an owner holds for its lifetime (create_segment)
        held.append(fd)
    try:
        removed = sweep_stale_segments(str(tmp_path))
    finally:
        for fd in held:
            os.close(fd)
    stale = {files["dead owner here"], files["owner of another pid namespace, lock gone"]}
    assert set(removed) == stale
    assert {p.name for p in tmp_path.iterdir()} == set(files.values()) - stale


def test_segments_of_a_tree_killed_whole_are_swept_and_a_live_bank_is_kept() -> None:
    """SIGKILL of a process group that made a bank and a fence board (its resource tracker dies with it): the
    segments stay in /dev/shm until a sweep, which leaves this process's own live bank alone."""
    code = """
        import sys
        from services.transport.bank import SharedBank
        from services.transport.fences import FenceBoard
        bank, board = SharedBank.create(4, 8), FenceBoard.create()
        print(bank.spec.name, board.name, flush=True)
        sys.stdin.read()
    """
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    live = SharedBank.create(2, 2)
    try:
        assert child.stdout is not None
        names = child.stdout.readline().split()
        assert len(names) == 2, "the child made no segments"
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        left = [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]
        assert left == names, "nothing was left behind: this test proves nothing"
        removed = sweep_stale_segments()
        assert set(names) <= set(removed)
        assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
        assert live.spec.name not in removed and os.path.exists(os.path.join(SHM_DIR, live.spec.name))
        SharedBank.attach(live.spec).close()
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        live.close()


def test_a_bank_reserves_its_space_when_it_is_created() -> None:
    bank = SharedBank.create(256, 1024)  # 1 MiB
    try:
        reserved = os.stat(os.path.join(SHM_DIR, bank.spec.name)).st_blocks * 512
        assert reserved >= 256 * 1024 * 4  # allocated now, not at the first write (ftruncate alone: 0 blocks)
    finally:
        bank.close()


def test_a_bank_larger_than_dev_shm_is_an_error_naming_it_and_the_size_not_a_sigbus() -> None:
    st = os.statvfs(SHM_DIR)
    width = 1 << 20
    rows = (st.f_blocks * st.f_frsize) // (width * 4) + 1  # more than /dev/shm holds at all: nothing is written
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(SharedMemoryFull) as err:
        SharedBank.create(rows, width)
    message = str(err.value)
    assert SHM_DIR in message and f"({rows * width * 4} bytes)" in message and "free of" in message, message
    assert f"{rows} x {width} float32 bank" in message, message
    assert not {n for n in set(os.listdir(SHM_DIR)) - before if f"-{os.getpid()}-" in n}, "a segment was left behind"


def _loop_op(seq: int, rows: tuple[int, ...]) -> LoopOp:
    n = len(rows)
    return LoopOp(seq, (), (), (), rids=rows, positions=(0,) * n, rows=rows, steps=(0,) * n)


def _head_op(seq: int, rows: tuple[int, ...], fences: tuple[Fence, ...]) -> HeadOp:
    n = len(rows)
    sampling = (SamplingParams(),) * n
    return HeadOp(
        seq, fences, (), (), rids=rows, positions=(0,) * n, rows=rows, sample=(True,) * n, sampling=sampling,
        token_index=(0,) * n,
    )  # fmt: skip


def _poll(ex: GrpcExecutor, want: type, n: int = 1, timeout: float = 20.0) -> list[StageResult | StageLoss]:
    """Poll until ``n`` items of type ``want`` came (returned, with everything else seen before them)."""
    out: list[StageResult | StageLoss] = []
    deadline = time.monotonic() + timeout
    while sum(isinstance(x, want) for x in out) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"no {want.__name__} within {timeout}s; saw {out} (executor broken: {ex.broken})"
        item = ex.poll(left)
        if item is not None:
            out.append(item)
    return out


def test_banks_and_a_doorbell_whose_names_were_unlinked_are_recreated_when_the_stages_are_reattached(
    tmp_path: Path,
) -> None:
    FakeWorker.reset()
    settings = replace(FAST, stage_down_limit_s=8.0)  # without re-creation the executor gives up after this
    with stage_servers(tmp_path, lambda s: fake_model(), worker_factory=FakeWorker, settings=settings) as running:
        ex = GrpcExecutor(fake_setup(), {s: r.address for s, r in running.items()}, settings)
        try:
            bell = ex.stages.doorbell
            assert bell is not None, "the stages reply on rings, ringing the doorbell"
            old = (ex.bank.spec.name, ex.tokens.spec.name)
            old_bell = bell.name
            for name in (*old, old_bell):
                os.unlink(os.path.join(SHM_DIR, name))  # e.g. /dev/shm cleaned by hand under a live tree
            restart_stage(running, Stage.LOOP)  # the loop stage dies and comes back: it must attach the banks
            _poll(ex, StageLoss)
            ex.submit(_loop_op(0, (3,)))
            ex.submit(_head_op(0, (3,), (Fence(Stage.LOOP, 0),)))
            results = [r for r in _poll(ex, StageResult, 2) if isinstance(r, StageResult)]
            assert [(r.stage, r.seq, r.error) for r in results] == [(Stage.LOOP, 0, None), (Stage.HEAD, 0, None)]
            assert (ex.bank.spec.name, ex.tokens.spec.name) != old and ex.outage is None and ex.recoveries == 1
            assert ex.bank._segment is not None and still_linked(ex.bank._segment)
            assert bell.name != old_bell and bell._segment is not None and still_linked(bell._segment)
            assert ex.bank.tensor is not None and float(ex.bank.tensor[3, 0]) == 1.0  # the stages use the new bank
            assert results[1].token_ids == (1,)
        finally:
            ex.close()


def test_a_scheduler_without_room_in_dev_shm_exits_1_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import services.api.server
    from cdb import processes

    message = f"{SHM_DIR} has 1024 of 4096 bytes free; the 16 x 64 float32 bank needs 4096 bytes"

    def full(*args: object, **kwargs: object) -> None:
        raise SharedMemoryFull(message)

    monkeypatch.setattr(processes, "die_with_parent", lambda: None)  # not this test process
    monkeypatch.setattr(services.api.server, "run_scheduler", full)
    assert processes.scheduler_main(["--in-process", "--model", "ouro-tiny", "--listen", "127.0.0.1:0"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"cdb scheduler: {message}"]


@pytest.mark.parametrize("forged", ["record", "reply"])
def test_an_unreadable_reply_is_that_stages_loss_and_the_executor_serves_on(tmp_path: Path, forged: str) -> None:
    """A replies-ring record that does not fit the ring, or one whose bytes are no reply: ``poll`` (the engine
    thread's) does not raise; the stage is lost and re-attached on new rings, and the next ops are answered."""
    from services.transport import ring as ring_module

    FakeWorker.reset()
    with stage_servers(tmp_path, lambda s: fake_model(), worker_factory=FakeWorker, settings=FAST) as running:
        ex = GrpcExecutor(fake_setup(), {s: r.address for s, r in running.items()}, FAST)
        try:
            replies = ex._links[Stage.HEAD]._rings[1]  # type: ignore[index]
            if forged == "record":  # a length past what was written
                q = replies._q
                ring_module._REC.pack_into(replies._data, q[ring_module._WRITTEN] % replies.capacity, 4096, 0, 0)
                q[ring_module._WRITTEN] += 32
            else:  # a record that is not a StageReply
                replies.put(b"\xff" * 40, timeout=1)
            ex.stages.doorbell.ring()  # type: ignore[union-attr]
            losses = [x for x in _poll(ex, StageLoss) if isinstance(x, StageLoss)]
            assert "head stage sent a reply that cannot be read" in losses[0].reason
            ex.submit(_loop_op(0, (3,)))
            ex.submit(_head_op(0, (3,), (Fence(Stage.LOOP, 0),)))
            results = [r for r in _poll(ex, StageResult, 2) if isinstance(r, StageResult)]
            assert [(r.stage, r.error) for r in results] == [(Stage.LOOP, None), (Stage.HEAD, None)]
            assert ex.outage is None and ex.recoveries == 1 and ex.broken is None
        finally:
            ex.close()
