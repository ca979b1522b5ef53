"""A message ring in shared memory: the data plane between the scheduler and a stage on one host.

Each stage has two rings, made by the scheduler's executor with the fence board and named in ``Configure``:
its ops (scheduler -> stage, serialized ``StageBatch`` messages) and its replies (stage -> scheduler,
serialized ``StageReply`` messages). The gRPC ``Run`` stream of the session stays open beside them and carries
no data: it is the session's lifeline (a dead process on either side ends it) and keeps health and keepalive.
A record goes from the producing thread straight into the consuming thread, with no gRPC thread, HTTP/2
framing or completion queue in between; the producer wakes a sleeping consumer through a futex on the ring's
wake word (``services.transport.futex``).

One producer and one consumer per ring (the executor holds its lock around ``put``; a stage writes its replies
from its executor thread only). Layout of the segment: a 64-byte header, then ``capacity`` bytes of records::

    header: int64 written, int64 consumed (running byte totals), int64 closed, int32 data word, int32 space word,
            int32 space waiting (the producer is about to sleep for space: the consumer wakes it only then)
    record: uint32 length, uint32 kind (0 data, 1 wrap: the rest of the lap is skipped), int64 stamp, payload

Records start on 16-byte boundaries, so a record header always fits before the end of a lap. ``stamp`` is the
producer's ``time.perf_counter_ns()`` at ``put`` (``CLOCK_MONOTONIC``: comparable across the processes of a
host): a stage's op log reads an op's arrival from it.

Replies rings share a doorbell (:class:`Doorbell`, a futex word in a segment of its own that the executor makes
and names in ``Configure``): a stage rings it after each reply it writes, so the scheduler's engine thread waits
for the replies of all three stages on one word and reads them itself, with no reader thread between a reply and
the planner (a hand-over through another thread costs the interpreter lock twice and a queue).

Ordering: the producer writes the payload, then the ``written`` total (one aligned 8-byte store), then bumps the
data word and wakes; the consumer reads the data word, then ``written``, then the payload. That relies on stores
becoming visible in program order, which x86-64 guarantees (``SUPPORTED``); elsewhere the stages use the gRPC
stream for data, as before.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import struct
import sys
import time
from multiprocessing import shared_memory

from services.transport import futex
from services.transport.segments import (
    MappedSegment,
    attach_segment,
    close_segment,
    create_segment,
    forget_segment,
    still_linked,
)

log = logging.getLogger(__name__)

SUPPORTED = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64") and futex.AVAILABLE

_HEADER = 64
_WRITTEN, _CONSUMED, _CLOSED = 0, 1, 2  # int64 slots of the header
_DATA_WORD, _SPACE_WORD, _SPACE_WAITING = 6, 7, 8  # int32 slots (byte offsets 24, 28 and 32)
_REC = struct.Struct("<IIq")  # length, kind, stamp
_DATA, _WRAP = 0, 1
_ALIGN = 16
_SLICE_S = 5e-3  # longest sleep for space: the space flag's handshake can miss a wake (no fence), this bounds it
# Longest sleep for data: a wake is not missed there (the word is read before looking, and every put, ``shut`` and
# ``interrupt`` changes it), so this only bounds an idle thread's wake-ups: ten a second, not two hundred (an
# idle tree's threads spent ~2 % of a core each polling at 5 ms).
_DATA_SLICE_S = 0.1


class RingClosed(ConnectionError):
    """The ring was closed (its session is over): nothing more will be read from or written to it."""


class RingFull(TimeoutError):
    """The consumer took nothing for the whole timeout and the record does not fit."""


class RingCorrupt(RuntimeError):
    """The next record does not fit the ring (its length, kind or the totals are not what a producer writes): the
    other side is broken or hostile. Nothing more is read from the ring; its session should end."""


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


class MessageRing(MappedSegment):
    """A single-producer single-consumer ring of byte records in shared memory. Use :meth:`create` /
    :meth:`attach`."""

    def __init__(self, segment: shared_memory.SharedMemory, owner: bool) -> None:
        capacity = segment.size - _HEADER
        if capacity <= 0 or capacity % _ALIGN:
            raise ValueError(f"shared-memory segment {segment.name} is not a message ring ({segment.size} bytes)")
        buf = self._map(segment, owner)
        self.capacity = capacity
        self._buf = buf
        self._data = buf[_HEADER:]
        self._q = buf[:24].cast("q")
        self._words = buf[:36].cast("i")
        self._data_addr = self._base + 4 * _DATA_WORD
        self._space_addr = self._base + 4 * _SPACE_WORD
        self._interrupted = False  # this process's consumer was told to stop waiting (``interrupt``)

    @classmethod
    def create(cls, capacity: int, what: str) -> MessageRing:
        """A new empty ring of ``capacity`` bytes (rounded up to 16) owned by this process."""
        size = _HEADER + _aligned(max(capacity, 4 * _ALIGN))
        return cls(create_segment("ring", size, what), owner=True)

    @classmethod
    def attach(cls, name: str) -> MessageRing:
        return cls(attach_segment(name), owner=False)

    @property
    def max_record(self) -> int:
        """The largest payload one record can carry."""
        return self.capacity - _REC.size

    # --- producer --------------------------------------------------------------------------------------------

    def put(self, payload: bytes | bytearray, timeout: float, wake: bool = True) -> None:
        """Append one record (stamped now) and wake the consumer (``wake=False``: the caller rings the consumer's
        :class:`Doorbell` instead). Waits up to ``timeout`` seconds for space.

        Raises :class:`RingClosed`, :class:`RingFull`, or ValueError for a payload larger than ``max_record``."""
        n = len(payload)
        if n > self.max_record:
            raise ValueError(f"a {n}-byte message does not fit a {self.capacity}-byte stage ring")
        try:
            self._put(payload, n, timeout, wake)
        except ValueError:  # the views were released under this call: the ring was closed here
            raise RingClosed("stage ring closed") from None

    def _put(self, payload: bytes | bytearray, n: int, timeout: float, wake: bool = True) -> None:
        if self._segment is None:
            raise RingClosed("stage ring closed")
        q, cap = self._q, self.capacity
        need = _aligned(_REC.size + n)
        deadline = 0.0
        while True:
            if q[_CLOSED]:
                raise RingClosed("stage ring closed")
            written = q[_WRITTEN]
            offset = written % cap
            skip = cap - offset if offset + need > cap else 0
            if written + skip + need - q[_CONSUMED] <= cap:
                break
            now = time.perf_counter()
            if not deadline:
                deadline = now + timeout
            elif now >= deadline:
                raise RingFull(f"stage ring full for {timeout:g}s: its consumer takes nothing")
            word = self._words[_SPACE_WORD]
            # Said before re-checking: a consumer that frees space after this wakes it. (Without a fence both sides
            # may read the other's old value; the sleep then lasts one slice, on a ring already full.)
            self._words[_SPACE_WAITING] = 1
            if written + skip + need - q[_CONSUMED] > cap and not q[_CLOSED]:
                futex.wait(self._space_addr, word, min(_SLICE_S, deadline - now))
        if deadline:
            self._words[_SPACE_WAITING] = 0
        data = self._data
        if skip:
            _REC.pack_into(data, offset, 0, _WRAP, 0)
            written += skip
            offset = 0
        _REC.pack_into(data, offset, n, _DATA, time.perf_counter_ns())
        start = offset + _REC.size
        data[start : start + n] = payload
        q[_WRITTEN] = written + need  # publishes the record (x86-64: stores are seen in program order)
        if wake:
            self._bump(_DATA_WORD, self._data_addr)

    def _bump(self, slot: int, addr: int) -> None:
        words = self._words
        word = words[slot]
        words[slot] = word + 1 if word < 0x7FFFFFFF else 0
        futex.wake(addr)

    # --- consumer --------------------------------------------------------------------------------------------

    def get(self, timeout: float | None = None, spin_s: float = 0.0) -> tuple[bytes, int] | None:
        """The next record's payload and stamp; waits up to ``timeout`` seconds (None: until one comes), spinning
        ``spin_s`` first. None on timeout or after :meth:`interrupt`. Raises :class:`RingClosed` once the ring
        is closed and drained, :class:`RingCorrupt` for a record no producer of this ring writes."""
        try:
            return self._get(timeout, spin_s)
        except ValueError:  # the views were released under this call: the ring was closed here
            raise RingClosed("stage ring closed") from None

    def _get(self, timeout: float | None, spin_s: float) -> tuple[bytes, int] | None:
        if self._segment is None:
            raise RingClosed("stage ring closed")
        q, cap, data = self._q, self.capacity, self._data
        deadline = spin_until = 0.0
        while True:
            consumed = q[_CONSUMED]
            written = q[_WRITTEN]
            if written != consumed:
                offset = consumed % cap
                if consumed % _ALIGN or consumed < 0:  # (records start on 16-byte boundaries: a header fits)
                    raise RingCorrupt(f"stage ring position {consumed} is not a record's")
                n, kind, stamp = _REC.unpack_from(data, offset)
                # (checked before anything is taken: a record must lie within the lap and the written bytes)
                end = consumed + (cap - offset if kind == _WRAP else _aligned(_REC.size + n))
                if (
                    kind not in (_DATA, _WRAP)
                    or end > written
                    or written - consumed > cap
                    or offset + _REC.size + n > cap
                ):
                    raise RingCorrupt(
                        f"stage ring record at byte {consumed} (kind {kind}, {n} bytes) does not fit the ring "
                        f"({written - consumed} bytes written, {cap}-byte lap)"
                    )
                if kind == _WRAP:
                    q[_CONSUMED] = end
                    continue
                start = offset + _REC.size
                payload = bytes(data[start : start + n])
                q[_CONSUMED] = end
                if self._words[_SPACE_WAITING]:  # (no system call while the producer has room: nearly always)
                    self._bump(_SPACE_WORD, self._space_addr)
                return payload, stamp
            if q[_CLOSED]:
                raise RingClosed("stage ring closed")
            if self._interrupted:
                self._interrupted = False
                return None
            now = time.perf_counter()
            if not deadline:
                deadline = now + (timeout if timeout is not None else float("inf"))
                spin_until = now + spin_s
            if now >= deadline:
                return None
            if now < spin_until:
                continue
            word = self._words[_DATA_WORD]  # read BEFORE re-checking: a put after this read changes it
            if q[_WRITTEN] == q[_CONSUMED] and not q[_CLOSED] and not self._interrupted:
                futex.wait(self._data_addr, word, min(_DATA_SLICE_S, deadline - now))

    def interrupt(self) -> None:
        """Make this process's waiting (or next) ``get`` return None at once."""
        self._interrupted = True
        with contextlib.suppress(ValueError):  # closed meanwhile: nobody waits any more
            self._bump(_DATA_WORD, self._data_addr)

    # --- both ------------------------------------------------------------------------------------------------

    def shut(self) -> None:
        """Close the ring for both sides: a waiting ``get`` or ``put`` raises :class:`RingClosed` (records already
        written are still read first)."""
        if self._segment is None:
            return
        with contextlib.suppress(ValueError):  # closed meanwhile by another thread of this process
            self._q[_CLOSED] = 1
            self._bump(_DATA_WORD, self._data_addr)
            self._bump(_SPACE_WORD, self._space_addr)

    @property
    def closed(self) -> bool:
        return self._segment is None or bool(self._q[_CLOSED])

    def close(self) -> None:
        """Unmap; the owner also unlinks. Idempotent. Call once no thread of this process uses the ring."""
        self._unmap(self._q, self._words, self._data)


class Doorbell(MappedSegment):
    """One futex word in a segment of its own: any number of producers ring it, one consumer waits on it for all
    of them (the engine thread, for the replies of the three stages). Use :meth:`create` / :meth:`attach`.

    The consumer reads :meth:`word`, then looks at what the producers write (the replies rings), and sleeps in
    :meth:`wait` only if it found nothing: a producer that wrote meanwhile changed the word, so the sleep returns
    at once. Sleeps are capped at ``_DATA_SLICE_S``."""

    SIZE = 64

    def __init__(self, segment: shared_memory.SharedMemory, owner: bool) -> None:
        self._words = self._map(segment, owner)[:4].cast("i")
        self._addr = self._base
        # renewed-away mappings (segment, words view, pinning anchor), kept: a thread may still be asleep on one
        self._retired: list[tuple[shared_memory.SharedMemory, memoryview, object]] = []

    @classmethod
    def create(cls, what: str) -> Doorbell:
        return cls(create_segment("bell", cls.SIZE, what), owner=True)

    @classmethod
    def attach(cls, name: str) -> Doorbell:
        return cls(attach_segment(name), owner=False)

    def renew_if_unlinked(self) -> bool:
        """The owner's doorbell whose name was unlinked (a ``/dev/shm`` cleaner, systemd's ``RemoveIPC``): no stage
        could attach it again. Use a new one under a new name from now on (``name``: the caller names it to the
        stages it re-configures) and return True; else change nothing and return False. The old mapping stays
        until the process ends: a thread asleep on it wakes within ``_DATA_SLICE_S`` and sleeps on the new one."""
        segment = self._segment
        if not self.owner or segment is None or still_linked(segment):
            return False
        old = self.name
        self._retired.append((segment, self._words, self._anchor))
        forget_segment(segment)
        self._words = self._map(create_segment("bell", self.SIZE, "stages' replies doorbell"), owner=True)[:4].cast("i")
        self._addr = self._base
        log.warning("the replies doorbell %s was unlinked by someone else; re-created it as %s", old, self.name)
        return True

    def word(self) -> int:
        """The word now (read before looking for work; 0 once closed)."""
        try:
            return self._words[0]
        except ValueError:  # closed under the caller
            return 0

    def ring(self) -> None:
        """Change the word and wake the sleeper (no-op once closed)."""
        try:
            word = self._words[0]
            self._words[0] = word + 1 if word < 0x7FFFFFFF else 0
        except ValueError:
            return
        futex.wake(self._addr)

    def wait(self, word: int, timeout_s: float) -> None:
        """Sleep while the word is still ``word``, at most ``timeout_s`` (and ``_DATA_SLICE_S``); may return early."""
        if timeout_s <= 0:
            return
        if self._segment is None:  # closed: nothing will ring it
            time.sleep(min(_SLICE_S, timeout_s))
        else:
            futex.wait(self._addr, word, min(_DATA_SLICE_S, timeout_s))

    def close(self) -> None:
        """Unmap (the renewed-away mappings too); the owner also unlinks. Idempotent. Call once no thread of this
        process uses the doorbell."""
        self._unmap(self._words)
        retired, self._retired = self._retired, []
        for segment, words, anchor in retired:
            words.release()
            del anchor
            close_segment(segment, unlink=False)
