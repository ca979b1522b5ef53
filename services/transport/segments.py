"""The POSIX shared-memory segments of a tree (the banks and the fence board): named by their owner, their space
reserved up front, and swept once their owner is gone.

- ``create_segment(kind, size, what)``: a new segment owned by this process, named ``cdb-KIND-PID-NS-RANDOM``
  (the owner's pid and pid namespace: whose it is can be read off its name). Its pages are reserved at once
  (``posix_fallocate``), so a full ``/dev/shm`` is a :class:`SharedMemoryFull` naming it and the size needed,
  never a SIGBUS at the first write into a page that tmpfs cannot supply. The owner holds a shared ``flock`` on
  it for as long as it lives: the kernel drops the lock when the process ends, however it ends.
- ``attach_segment(name)`` / ``close_segment(seg, unlink)``: attachers never unlink.
- ``sweep_stale_segments()``: unlink the segments whose owner is gone, e.g. those of a tree that was SIGKILLed
  whole (its resource tracker with it). A segment is stale when no process holds its lock and the pid in its
  name is not a live process of this pid namespace (for an owner here, the pid check also covers the instant
  between a segment's creation and its lock). A live tree's segments are never touched, in this pid namespace or
  another (containers of one pod share ``/dev/shm`` but not pids: the lock is what tells). Run at start by the
  launcher and by ``cdb scheduler``, the process that creates the banks.
- ``still_linked(seg)``: whether the segment's name still names it (someone may have unlinked it by hand; the
  executor then re-creates its banks when it re-attaches the stages).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import os
import re
import secrets
from multiprocessing import resource_tracker, shared_memory

log = logging.getLogger("cdb.shm")

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory (shm_open)
_NAME = re.compile(r"cdb-(?P<kind>[a-z]+)-(?P<pid>\d+)-(?P<ns>\d+)-[0-9a-f]+")
_CREATED_HERE: set[str] = set()  # segments this process created (and its resource tracker owns)


class SharedMemoryFull(MemoryError):
    """``/dev/shm`` cannot hold a new segment; the message names it, the size needed and the space left."""


@functools.cache
def _pid_namespace() -> int:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``; 0 where that cannot be read)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def new_segment_name(kind: str) -> str:
    """``cdb-KIND-PID-NS-RANDOM``: the creating process, its pid namespace and 48 random bits."""
    name = f"cdb-{kind}-{os.getpid()}-{_pid_namespace()}-{secrets.token_hex(6)}"
    _CREATED_HERE.add(name)
    return name


def _size_text(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def create_segment(kind: str, size: int, what: str) -> shared_memory.SharedMemory:
    """A new zero-filled segment of ``size`` bytes owned by this process, its space reserved and its owner's lock
    held; ``what`` names it in errors. Raises :class:`SharedMemoryFull` when ``/dev/shm`` cannot hold it."""
    seg = shared_memory.SharedMemory(name=new_segment_name(kind), create=True, size=size)
    fd: int = seg._fd  # type: ignore[attr-defined]
    fcntl.flock(fd, fcntl.LOCK_SH)  # held until this process closes it or ends: the sweep's sign of life
    try:
        # ftruncate only sets the size: tmpfs supplies pages at the first touch, and a SIGBUS when it has none.
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        close_segment(seg, unlink=True)
        if exc.errno not in (errno.ENOSPC, errno.EFBIG):
            raise
        st = os.statvfs(SHM_DIR)
        raise SharedMemoryFull(
            f"cannot reserve {_size_text(size)} ({size} bytes) in {SHM_DIR} for the {what}: "
            f"{_size_text(st.f_bavail * st.f_frsize)} free of {_size_text(st.f_blocks * st.f_frsize)}; "
            f"enlarge {SHM_DIR} (docker run --shm-size, compose CDB_SHM_SIZE, the Kubernetes shm volume's sizeLimit)"
        ) from None
    return seg


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Open an existing segment without adopting it.

    Python 3.11 registers every attached segment with the resource tracker, which would unlink it when THIS
    process exits; attachers must never unlink, so the registration is undone at once.
    """
    seg = shared_memory.SharedMemory(name=name)
    if name not in _CREATED_HERE:  # creator and attacher in one process (tests): the creator's entry stays
        resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    return seg


def close_segment(seg: shared_memory.SharedMemory, unlink: bool) -> None:
    with contextlib.suppress(BufferError):  # a tensor view is still alive: the mapping goes with the process
        seg.close()
    if unlink:
        with contextlib.suppress(FileNotFoundError):
            seg.unlink()


def forget_segment(seg: shared_memory.SharedMemory) -> None:
    """An owned segment whose name someone else unlinked: drop this process's view, and stop its resource
    tracker from unlinking the name at exit (a later segment might carry it)."""
    close_segment(seg, unlink=False)
    _CREATED_HERE.discard(seg.name)
    resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]


def still_linked(seg: shared_memory.SharedMemory) -> bool:
    """Whether ``seg``'s name still names this very segment (and so can be attached)."""
    try:
        named = os.stat(os.path.join(SHM_DIR, seg.name))
        own = os.fstat(seg._fd)  # type: ignore[attr-defined]
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (own.st_dev, own.st_ino)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _locked(path: str) -> bool:
    """Whether some process holds a lock on the file (its owner lives). Unreadable: treated as locked (kept)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the lock just taken
    return False


def sweep_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the ``cdb-`` segments in ``shm_dir`` whose owner is gone; return their names (logged)."""
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return []
    removed, freed = [], 0
    for entry in entries:
        m = _NAME.fullmatch(entry.name)
        if m is None:
            continue  # not ours, or named before owners were (its owner cannot be told)
        if int(m["ns"]) == _pid_namespace() and _pid_alive(int(m["pid"])):
            continue  # its owner is alive here (it may be creating it: not locked yet)
        if _locked(entry.path):
            continue  # its owner is alive, in another pid namespace
        with contextlib.suppress(OSError):
            size = entry.stat().st_blocks * 512
            os.unlink(entry.path)
            removed.append(entry.name)
            freed += size
    if removed:
        log.warning(
            "removed %d stale shared-memory segments of dead processes from %s (%s): %s",
            len(removed),
            shm_dir,
            _size_text(freed),
            " ".join(sorted(removed)),
        )
    return removed


class MappedSegment:
    """A shared-memory segment this process maps, with its first byte's address pinned (the futex words of a ring,
    a doorbell or the fence board live in it). A subclass calls :meth:`_map` first, casts its views of the buffer
    it returns, and passes them to :meth:`_unmap` in its ``close``."""

    name: str
    owner: bool
    _segment: shared_memory.SharedMemory | None
    _base: int

    def _map(self, segment: shared_memory.SharedMemory, owner: bool) -> memoryview:
        """Hold ``segment`` (``owner``: this process made it and unlinks it at close); its buffer."""
        self.name = segment.name
        self.owner = owner
        self._segment = segment
        buf = segment.buf
        assert buf is not None
        self._anchor = ctypes.c_char.from_buffer(buf)  # pins the mapping: the futex addresses stay valid
        self._base = ctypes.addressof(self._anchor)
        return buf

    def _unmap(self, *views: memoryview) -> None:
        """Release ``views``, unmap the segment; the owner also unlinks it. Idempotent."""
        segment, self._segment = self._segment, None
        if segment is None:
            return
        for view in views:
            view.release()
        del self._anchor
        close_segment(segment, unlink=self.owner)
