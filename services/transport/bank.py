"""The shared hidden-state bank: the memory the stage processes share.

Bank: one ``[rows, width]`` tensor that every stage reads and writes by row index; hidden states never travel over
gRPC. The token bank (sampled ids, ``[rows, 1]`` int64, head -> prelude) is a second bank of the same kind.
Two storages behind one interface (:class:`SharedBank`):

- CPU: a POSIX shared-memory segment (``multiprocessing.shared_memory``) viewed by ``torch.frombuffer``.
- GPU: a CUDA tensor of the creating process, opened in the others through its CUDA IPC handle
  (``cudaIpcOpenMemHandle`` via torch's ``_share_cuda_`` / ``_new_shared_cuda``). Same host only; the creator
  must keep its tensor alive while others use it, and a process cannot open its own handle.

The fence board that orders the stages' use of the bank is in ``services.transport.fences``; how segments are
named, reserved and swept, in ``services.transport.segments``.

Ownership: the creator owns a segment and unlinks it on ``close``; attachers only unmap. Everything that crosses
a process boundary is a name, a shape, a dtype string or the raw bytes of a CUDA IPC handle: nothing is pickled.
A bank whose name was unlinked behind its owner's back is re-created by the owner (``renew_if_unlinked``) when
the stages are configured again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import TYPE_CHECKING

from services.transport.segments import attach_segment, close_segment, create_segment, forget_segment, still_linked

if TYPE_CHECKING:  # (a CPU bank's owner, the scheduler's process, maps its segment without torch: ``tensor`` is lazy)
    import torch

log = logging.getLogger("cdb.bank")

ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8}  # int64: token bank


def _dtype(name: str) -> torch.dtype:
    import torch

    if name not in ITEMSIZE:
        raise KeyError(name)
    return getattr(torch, name)


@dataclass(frozen=True, slots=True)
class CudaIpcHandle:
    """The fields of ``UntypedStorage._share_cuda_()``, in its order (interpreted by the CUDA driver)."""

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True, slots=True)
class BankSpec:
    """Everything an attacher needs: ``kind`` is ``"shm"`` (``name``) or ``"cuda_ipc"`` (``cuda``)."""

    kind: str
    name: str
    rows: int
    width: int
    dtype: str
    cuda: CudaIpcHandle | None = None


class SharedBank:
    """A ``[rows, width]`` tensor shared by the stage processes. Use :meth:`create` or :meth:`attach`."""

    def __init__(
        self,
        spec: BankSpec,
        tensor: torch.Tensor | None,
        segment: shared_memory.SharedMemory | None,
        owner: bool,
    ) -> None:
        """``tensor`` None: a shared-memory bank, viewed when ``tensor`` is first read."""
        self.spec = spec
        self._tensor = tensor  # (rows, width)
        self._segment = segment
        self.owner = owner

    @property
    def tensor(self) -> torch.Tensor | None:
        """The ``[rows, width]`` view (None once closed)."""
        if self._tensor is None and self._segment is not None:
            import torch

            rows, width = self.spec.rows, self.spec.width
            flat = torch.frombuffer(self._segment.buf, dtype=_dtype(self.spec.dtype), count=rows * width)
            self._tensor = flat.view(rows, width)
        return self._tensor

    @classmethod
    def create(cls, rows: int, width: int, dtype: str = "float32", device: str = "cpu") -> SharedBank:
        """Allocate a zeroed bank owned by this process: shared memory on CPU, CUDA IPC on a CUDA device."""
        if rows <= 0 or width <= 0:
            raise ValueError(f"bank shape must be positive, got ({rows}, {width})")
        if dtype not in ITEMSIZE:
            raise KeyError(dtype)
        if device.startswith("cuda"):
            import torch

            dev = torch.device(device)
            tensor = torch.zeros((rows, width), dtype=_dtype(dtype), device=dev)
            fields = tensor.untyped_storage()._share_cuda_()
            cuda = CudaIpcHandle(*fields)
            spec = BankSpec("cuda_ipc", "", rows, width, dtype, cuda)
            return cls(spec, tensor, None, owner=True)
        if device != "cpu":
            raise ValueError(f"unsupported bank device {device!r} (cpu or cuda)")
        # A new segment reads as zeros: no write here (touching every page of a large bank costs time).
        seg = create_segment("bank", rows * width * ITEMSIZE[dtype], f"{rows} x {width} {dtype} bank")
        return cls(BankSpec("shm", seg.name, rows, width, dtype), None, seg, owner=True)

    @classmethod
    def attach(cls, spec: BankSpec) -> SharedBank:
        """Open a bank created by another process; closing it never frees the memory."""
        import torch

        tdtype = _dtype(spec.dtype)
        if spec.kind == "cuda_ipc":
            if spec.cuda is None:
                raise ValueError("cuda_ipc bank spec without a CUDA IPC handle")
            h = spec.cuda
            torch.cuda._lazy_init()  # as torch.multiprocessing does before opening a handle
            storage = torch.UntypedStorage._new_shared_cuda(
                h.device,
                h.handle,
                h.size_bytes,
                h.offset_bytes,
                h.ref_counter_handle,
                h.ref_counter_offset,
                h.event_handle,
                h.event_sync_required,
            )
            tensor = torch.empty((0,), dtype=tdtype, device=torch.device("cuda", h.device))
            tensor.set_(storage, 0, (spec.rows, spec.width), (spec.width, 1))
            return cls(spec, tensor, None, owner=False)
        if spec.kind != "shm":
            raise ValueError(f"unknown bank kind {spec.kind!r}")
        seg = attach_segment(spec.name)
        count = spec.rows * spec.width
        if seg.size < count * tdtype.itemsize:
            close_segment(seg, unlink=False)
            raise ValueError(f"segment {spec.name} holds {seg.size} bytes, bank needs {count * tdtype.itemsize}")
        tensor = torch.frombuffer(seg.buf, dtype=tdtype, count=count).view(spec.rows, spec.width)
        return cls(spec, tensor, seg, owner=False)

    def renew_if_unlinked(self) -> bool:
        """The owner of a shared-memory bank whose name was unlinked (no process can attach it any more): replace
        it with a new zeroed bank of the same shape under a new name (``spec`` and ``tensor`` change) and return
        True; otherwise change nothing and return False. For the moment the stages are (re-)configured: the old
        contents are void then."""
        seg = self._segment
        if not self.owner or seg is None or still_linked(seg):
            return False
        fresh = SharedBank.create(self.spec.rows, self.spec.width, self.spec.dtype)
        old = self.spec.name
        self._tensor = None  # drop the old view before unmapping
        forget_segment(seg)
        self.spec, self._tensor, self._segment = fresh.spec, None, fresh._segment
        log.warning("bank %s was unlinked by someone else; re-created it as %s", old, self.spec.name)
        return True

    def close(self) -> None:
        """Drop this process's view; the owner also frees the memory. Idempotent."""
        self._tensor = None
        if self._segment is not None:
            close_segment(self._segment, unlink=self.owner)
            self._segment = None
