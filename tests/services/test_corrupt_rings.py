"""A stage's rings are shared memory any process of the stage's user can write: a record no producer writes (here a
length past what was written, forged on each of the tree's six rings while it idles) is refused by the side that
reads it, and ends that stage's session like a lost stage — healed by re-attaching the stages, the scheduler the
same process, the next requests' tokens those of a fault-free run."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdb_engine.config import EngineConfig
from clients.sync_client import Client
from services.transport import ring as ring_module
from services.transport.ring import SUPPORTED, MessageRing
from tests.services.tree import IDLE, process_tree, wait_for_counters

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not SUPPORTED, reason="stage rings need x86-64 Linux"),
]

CONFIG = EngineConfig(model="ouro-tiny", dtype="float64", max_num_seqs=8, num_kv_blocks=512, max_waiting=64)


def greedy(client: Client) -> list[list[tuple[int, int]]]:
    out = []
    for i in range(4):
        result = client.generate("And God said", max_tokens=8 + i, ignore_eos=True)
        out.append([(t.id, t.depth) for t in result.tokens])
    return out


def forge(name: str) -> None:
    """A record header claiming 4 KiB where 32 bytes were written."""
    ring = MessageRing.attach(name)
    try:
        q = ring._q
        ring_module._REC.pack_into(ring._data, q[ring_module._WRITTEN] % ring.capacity, 4096, 0, 0)
        q[ring_module._WRITTEN] += 32
    finally:
        ring.close()


def test_a_forged_record_on_every_ring_is_healed_as_a_stage_loss_and_the_scheduler_lives_on() -> None:
    with process_tree(CONFIG) as tree, Client(tree.address, timeout=120) as client:
        reference = greedy(client)
        assert tree.scheduler is not None
        pid = tree.scheduler.pid
        rings = sorted(p.name for p in Path("/dev/shm").glob(f"cdb-ring-{pid}-*"))
        assert len(rings) == 6, rings  # each stage's ops ring and replies ring
        for name in rings:
            forge(name)
        wait_for_counters(client, lambda c: c["recoveries"] >= 1, "the stages re-attached", 60)
        client.wait_for_status("SERVING", timeout=60)
        assert greedy(client) == reference
        assert tree.scheduler.pid == pid and tree.scheduler.poll() is None
        wait_for_counters(client, lambda c: all(c[k] == v for k, v in IDLE.items()), "nothing held", 30)
        log = tree.log("scheduler") + "".join(tree.log(role) for role in ("prelude", "loop", "head"))
        assert "cannot be read" in log or "ops ring is corrupt" in log, log[-2000:]
        assert not any(Path("/dev/shm", name).exists() for name in rings), "the forged rings were replaced"
