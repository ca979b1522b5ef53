"""Shared hidden-state bank and fence board: cross-process visibility, ownership, waits and timeouts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from multiprocessing import shared_memory

import pytest
import torch

from cdb_scheduler.plan import Fence, Stage
from services.transport.bank import BankSpec, SharedBank
from services.transport.fences import FenceAborted, FenceBoard, FenceTimeout

pytestmark = pytest.mark.timeout(60)


def _run_child(code: str) -> str:
    """Run ``code`` in a fresh interpreter (its own resource tracker, as a stage process has)."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=50, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_shm_bank_is_shared_across_processes_and_owner_unlinks() -> None:
    bank = SharedBank.create(rows=8, width=16, dtype="float32")
    assert bank.tensor is not None
    bank.tensor[1] = 1.5
    spec = bank.spec
    out = _run_child(
        f"""
        import torch
        from services.transport.bank import BankSpec, SharedBank
        b = SharedBank.attach(BankSpec("shm", {spec.name!r}, {spec.rows}, {spec.width}, "float32"))
        print(float(b.tensor[1].sum()))
        b.tensor[3] = torch.arange(16, dtype=torch.float32)
        b.close()
        """
    )
    assert float(out) == pytest.approx(1.5 * 16)
    # the attacher's exit did not unlink the segment, and its write is visible here
    assert torch.equal(bank.tensor[3], torch.arange(16, dtype=torch.float32))
    again = SharedBank.attach(spec)
    again.close()
    bank.close()
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=spec.name)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_shm_bank_dtypes(dtype: str) -> None:
    bank = SharedBank.create(rows=3, width=4, dtype=dtype)
    other = SharedBank.attach(bank.spec)
    assert bank.tensor is not None and other.tensor is not None
    bank.tensor[2, 1] = 0.5
    assert other.tensor.dtype == bank.tensor.dtype and float(other.tensor[2, 1]) == 0.5
    other.close()
    bank.close()


def test_attach_rejects_short_segment_and_bad_kind() -> None:
    bank = SharedBank.create(rows=2, width=2)
    with pytest.raises(ValueError, match="bank needs"):
        SharedBank.attach(BankSpec("shm", bank.spec.name, 100, 100, "float32"))
    with pytest.raises(ValueError, match="unknown bank kind"):
        SharedBank.attach(BankSpec("tape", "x", 1, 1, "float32"))
    bank.close()


def test_fence_board_cross_process_complete_and_wait() -> None:
    board = FenceBoard.create()
    assert board.completed(Stage.LOOP) == -1
    code = f"""
from cdb_scheduler.plan import Fence, Stage
from services.transport.fences import FenceBoard
b = FenceBoard.attach({board.name!r})
b.complete(Stage.PRELUDE, 4)
b.wait((Fence(Stage.HEAD, 2),), timeout=20.0)
print(b.completed(Stage.HEAD))
b.close()
"""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        board.wait((Fence(Stage.PRELUDE, 4), Fence(Stage.PRELUDE, 0)), timeout=30.0)
        board.complete(Stage.HEAD, 2)
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 0 and int(out) == 2
    board.close()


def test_fence_wait_wakes_on_completion_from_another_thread() -> None:
    board = FenceBoard.create()
    other = FenceBoard.attach(board.name)
    started = threading.Event()

    def complete_later() -> None:
        started.wait()
        other.complete(Stage.HEAD, 0)

    t = threading.Thread(target=complete_later)
    t.start()
    started.set()
    waited = board.wait((Fence(Stage.HEAD, 0),), timeout=10.0)
    t.join()
    assert 0.0 <= waited < 10.0
    other.close()
    board.close()


def test_fence_timeout_and_abort() -> None:
    board = FenceBoard.create()
    board.complete(Stage.LOOP, 1)
    with pytest.raises(FenceTimeout, match="not satisfied"):
        board.wait((Fence(Stage.LOOP, 2),), timeout=0.05)
    board.abort()
    assert board.aborted
    with pytest.raises(FenceAborted):
        board.wait((Fence(Stage.LOOP, 2),), timeout=10.0)
    board.close()
    board.close()  # idempotent


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_bank_shared_with_child_process() -> None:
    bank = SharedBank.create(rows=4, width=8, dtype="float32", device="cuda")
    assert bank.tensor is not None and bank.spec.cuda is not None
    bank.tensor[0] = 2.0
    torch.cuda.synchronize()
    h = bank.spec.cuda
    out = _run_child(
        f"""
        from services.transport.bank import BankSpec, CudaIpcHandle, SharedBank
        h = CudaIpcHandle({h.device}, {h.handle!r}, {h.size_bytes}, {h.offset_bytes}, {h.ref_counter_handle!r},
                          {h.ref_counter_offset}, {h.event_handle!r}, {h.event_sync_required})
        b = SharedBank.attach(BankSpec("cuda_ipc", "", 4, 8, "float32", h))
        print(float(b.tensor[0].sum()))
        b.tensor[2] = 3.0
        import torch; torch.cuda.synchronize()
        b.close()
        """
    )
    assert float(out) == pytest.approx(16.0)
    assert float(bank.tensor[2].sum()) == pytest.approx(24.0)
    bank.close()


def test_the_schedulers_process_owns_a_cpu_bank_without_importing_torch() -> None:
    """The scheduler's process plans and owns the CPU bank's segment; it never computes on it, so neither its
    modules nor the bank load torch (≈ 2 s and ≈ 200 MB per start); a view of the bank still reads as a tensor."""
    out = _run_child(
        """
        import sys
        import services.api.server
        from services.transport.bank import SharedBank
        bank = SharedBank.create(4, 8)
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        assert bank.tensor is not None and tuple(bank.tensor.shape) == (4, 8)
        bank.close()
        """
    )
    assert out.strip() == "[]"
