"""Cross-process sleep and wake on a 32-bit word in shared memory: Linux futexes through ``syscall(2)``.

A futex on a shared mapping (not ``FUTEX_PRIVATE_FLAG``) works across processes, and a sleeper is woken in tens
of microseconds without burning a core another process needs. ``ctypes`` releases the interpreter lock for the
duration of the call. Where there is no futex (not Linux, an unknown architecture) ``wait`` sleeps for a short
slice instead and ``wake`` does nothing: waiters then poll, correct and slower.
"""

from __future__ import annotations

import ctypes
import platform
import sys
import time

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine()) if sys.platform == "linux" else None
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE_FLAG): the word lives in shared memory
_ALL = 0x7FFFFFFF

AVAILABLE = _SYS_FUTEX is not None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall = None
if AVAILABLE:
    _syscall = ctypes.CDLL(None, use_errno=True).syscall
    _syscall.restype = ctypes.c_long
    # number, uaddr, op, val, timeout, uaddr2, val3: typed once, so a call converts plain ints (a wake is ~2 µs)
    _syscall.argtypes = [
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    ]


def wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at ``addr`` equals ``expected``, at most ``timeout_s``; may return early (spuriously,
    or when woken). Without futexes: sleep ``min(timeout_s, 1 ms)``."""
    if _syscall is None:
        time.sleep(min(timeout_s, 1e-3))
        return
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, expected, ctypes.addressof(ts), None, 0)


def wake(addr: int) -> None:
    """Wake every sleeper on the word at ``addr`` (the caller has changed the word first)."""
    if _syscall is not None:
        _syscall(_SYS_FUTEX, addr, _FUTEX_WAKE, _ALL, None, None, 0)
