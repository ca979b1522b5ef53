"""What this machine has to compute on: its CUDA devices and their memory, and its RAM (no torch, no CUDA context).

The probes are the seams the tests fake: ``cuda_memory`` asks the CUDA driver (``libcuda``) directly, which reads
device properties without creating a context, so a launcher or a scheduler can ask before any stage starts and
without holding device memory; ``host_memory`` reads ``/proc/meminfo``. ``default_device`` is what ``--device
auto`` becomes: ``cuda`` where a CUDA device is visible (``CUDA_VISIBLE_DEVICES`` honoured), else ``cpu``.
"""

from __future__ import annotations

import ctypes
import functools
import os


@functools.cache
def cuda_memory() -> tuple[int, ...]:
    """Total memory (bytes) of each visible CUDA device; () without a driver or a device."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return ()
    count, total, handle = ctypes.c_int(0), ctypes.c_size_t(0), ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return ()
    sizes = []
    for index in range(count.value):
        if cuda.cuDeviceGet(ctypes.byref(handle), index) != 0:
            return ()
        if cuda.cuDeviceTotalMem_v2(ctypes.byref(total), handle) != 0:
            return ()
        sizes.append(total.value)
    return tuple(sizes)


def host_memory() -> tuple[int, int]:
    """This machine's RAM: (total, available now) in bytes."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    total = fields.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, fields.get("MemAvailable", total)


def default_device() -> str:
    """``--device auto``: ``cuda`` where a CUDA device is visible, else ``cpu``."""
    return "cuda" if cuda_memory() else "cpu"


def device_index(device: str) -> int:
    """N of ``cuda:N`` (0 for ``cuda``)."""
    return int(device.partition(":")[2] or 0)
