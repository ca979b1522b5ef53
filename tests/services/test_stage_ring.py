"""The shared-memory message ring of the stage data plane (``services.transport.ring``): records arrive whole and
in order across laps and processes, a full ring blocks its producer (then fails), closing wakes both sides, and a
record no producer writes (whatever the shared bytes hold) is refused, never read past the ring."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.transport import ring as ring_module
from services.transport.ring import SUPPORTED, MessageRing, RingClosed, RingCorrupt, RingFull

pytestmark = pytest.mark.skipif(not SUPPORTED, reason="stage rings need x86-64 Linux")


@pytest.fixture
def ring() -> MessageRing:
    r = MessageRing.create(1024, "test ring")
    yield r
    r.close()


def _payload(i: int) -> bytes:
    return bytes([i % 251]) * (1 + (i * 37) % 300)  # 1..300 bytes: records of many sizes, laps of many offsets


def test_records_arrive_whole_and_in_order_across_many_laps(ring: MessageRing) -> None:
    n = 2000  # ~300 KB through a 1 KB ring: hundreds of laps, wrap records and a producer that waits for space
    got: list[bytes] = []

    def consume() -> None:
        for _ in range(n):
            item = ring.get(timeout=10)
            assert item is not None
            got.append(item[0])

    reader = threading.Thread(target=consume)
    reader.start()
    for i in range(n):
        ring.put(_payload(i), timeout=10)
    reader.join(20)
    assert got == [_payload(i) for i in range(n)]
    assert ring.get(timeout=0) is None  # drained


def test_a_record_carries_the_producers_monotonic_stamp(ring: MessageRing) -> None:
    before = time.perf_counter_ns()
    ring.put(b"x", timeout=1)
    item = ring.get(timeout=1)
    assert item is not None and item[0] == b"x" and before <= item[1] <= time.perf_counter_ns()


def test_a_consumer_in_another_process_reads_what_this_one_writes() -> None:
    ring = MessageRing.create(4096, "test ring")
    back = MessageRing.create(1 << 20, "test ring")  # holds every echo: the parent reads after writing
    code = (
        "import sys\n"
        "from services.transport.ring import MessageRing\n"
        "a, b = MessageRing.attach(sys.argv[1]), MessageRing.attach(sys.argv[2])\n"
        "while (item := a.get(timeout=20)) is not None and item[0]:\n"
        "    b.put(item[0][::-1], timeout=20)\n"
        "b.put(b'', timeout=20)\n"
        "a.close(); b.close()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, ring.name, back.name])
    try:
        sent = [_payload(i) for i in range(500)]
        for p in sent:
            ring.put(p, timeout=20)
        ring.put(b"", timeout=20)
        echoed = []
        while (item := back.get(timeout=20)) is not None and item[0]:
            echoed.append(item[0])
        assert echoed == [p[::-1] for p in sent]
        assert child.wait(20) == 0
    finally:
        child.kill()
        ring.close()
        back.close()


def _fill(ring: MessageRing) -> None:
    """Put 100-byte records until the next does not fit."""
    while True:
        try:
            ring.put(b"y" * 100, timeout=0.0)
        except RingFull:
            return


def test_a_full_ring_blocks_its_producer_until_the_timeout(ring: MessageRing) -> None:
    _fill(ring)
    start = time.perf_counter()
    with pytest.raises(RingFull, match="takes nothing"):
        ring.put(b"z" * 100, timeout=0.2)
    assert time.perf_counter() - start >= 0.2
    assert ring.get(timeout=0) == (b"y" * 100, pytest.approx(0, abs=1 << 62))  # the queued records are intact
    ring.put(b"z" * 100, timeout=0.2)  # and space freed is space again


def test_a_producer_waiting_for_space_is_woken_when_space_is_freed_and_only_then(
    ring: MessageRing, monkeypatch: pytest.MonkeyPatch
) -> None:
    space = ring_module._SPACE_WORD
    word = ring._words[space]
    ring.put(b"a", timeout=0.0)
    assert ring.get(timeout=0) is not None
    assert ring._words[space] == word  # nobody waited for space: no wake (no system call) on the read
    monkeypatch.setattr(ring_module, "_SLICE_S", 30.0)  # a missed wake would hold the producer 30 s
    _fill(ring)
    done = threading.Event()

    def produce() -> None:
        ring.put(b"z" * 100, timeout=60.0)
        done.set()

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    deadline = time.monotonic() + 10
    while not ring._words[ring_module._SPACE_WAITING]:  # it says it waits before it sleeps
        assert time.monotonic() < deadline, "the producer never waited for space"
        time.sleep(0.001)
    assert ring.get(timeout=0) is not None  # frees space, and wakes it
    assert done.wait(10)
    producer.join(10)
    assert not ring._words[ring_module._SPACE_WAITING]  # (it stopped waiting)


def test_a_record_larger_than_the_ring_is_refused_without_harm(ring: MessageRing) -> None:
    with pytest.raises(ValueError, match="does not fit"):
        ring.put(b"q" * (ring.max_record + 1), timeout=1)
    ring.put(b"ok", timeout=1)
    assert ring.get(timeout=1)[0] == b"ok"  # type: ignore[index]


def test_shutting_wakes_a_waiting_consumer_after_what_was_written(ring: MessageRing) -> None:
    ring.put(b"last", timeout=1)
    seen: list[object] = []

    def consume() -> None:
        try:
            while True:
                seen.append(ring.get(timeout=30))
        except RingClosed:
            seen.append("closed")

    reader = threading.Thread(target=consume)
    reader.start()
    while not seen:
        time.sleep(0.001)  # polling for the first record, not synchronising on time
    ring.shut()
    reader.join(5)
    assert not reader.is_alive()
    assert [s[0] if isinstance(s, tuple) else s for s in seen] == [b"last", "closed"]
    with pytest.raises(RingClosed):
        ring.put(b"more", timeout=1)


def test_interrupt_returns_a_waiting_get_at_once(ring: MessageRing) -> None:
    out: list[object] = []
    reader = threading.Thread(target=lambda: out.append(ring.get(timeout=30)))
    reader.start()
    time.sleep(0.05)  # let it block (if it has not yet, the interrupt is still seen by its next look)
    start = time.perf_counter()
    ring.interrupt()
    reader.join(5)
    assert out == [None] and time.perf_counter() - start < 1.0


def test_a_closed_ring_fails_its_users_cleanly(ring: MessageRing) -> None:
    ring.close()
    with pytest.raises(RingClosed):
        ring.get(timeout=0)
    with pytest.raises(RingClosed):
        ring.put(b"x", timeout=0)
    ring.shut()
    ring.interrupt()


def _forge(ring: MessageRing, length: int, kind: int, claimed: int) -> None:
    """Write a record header as a broken or hostile producer would: ``length`` and ``kind`` at the next record's
    place, and ``claimed`` more bytes written."""
    q = ring._q
    ring_module._REC.pack_into(ring._data, q[ring_module._WRITTEN] % ring.capacity, length, kind, 0)
    q[ring_module._WRITTEN] += claimed


@pytest.mark.parametrize(
    ("length", "kind", "claimed"),
    [
        (4096, 0, 32),  # longer than the bytes written
        (1 << 31, 0, 1024),  # longer than the lap
        (8, 7, 32),  # a kind no producer writes
        (8, 0, 4096),  # more written than the ring holds
        (0, 1, 16),  # a wrap record before the end of the lap it skips to the end of, past what was written
    ],
)
def test_a_record_that_does_not_fit_the_ring_is_refused_and_nothing_is_taken(
    ring: MessageRing, length: int, kind: int, claimed: int
) -> None:
    ring.put(b"good", timeout=1)
    assert ring.get(timeout=0)[0] == b"good"
    consumed = ring._q[ring_module._CONSUMED]
    _forge(ring, length, kind, claimed)
    for _ in range(2):  # and again: the ring stays refused, not read past
        with pytest.raises(RingCorrupt):
            ring.get(timeout=0)
    assert ring._q[ring_module._CONSUMED] == consumed


@settings(max_examples=300, deadline=None, database=None)
@given(st.binary(min_size=64, max_size=64), st.binary(max_size=200), st.integers(0, 3 * 1024))
def test_whatever_the_shared_bytes_hold_a_read_gives_a_record_within_the_ring_or_a_refusal(
    header: bytes, body: bytes, start: int
) -> None:
    ring = MessageRing.create(1024, "fuzzed ring")
    try:
        ring._buf[:64] = header
        ring._q[ring_module._CONSUMED] = start  # (the totals a hostile producer may leave; the consumer owns this)
        ring._data[: len(body)] = body
        for _ in range(4):
            try:
                got = ring.get(timeout=0)
            except (RingCorrupt, RingClosed):
                break
            if got is None:
                break
            assert len(got[0]) <= ring.max_record
    finally:
        ring.close()
