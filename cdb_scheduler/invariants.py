"""Ownership invariants of the scheduler, checked by the tests after every step."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cdb_scheduler.scheduler import Scheduler


def check_invariants(sched: Scheduler) -> None:
    """Ownership invariants (tests call this after every step): one row per running request, blocks owned
    by exactly the requests holding them, at most one token per request in the loop (queued or running)."""
    row_owners = sched.rows.owners()
    assert sorted(row_owners.values()) == sorted(r.rid for r in sched.running.values()), "row ownership"
    for req in sched.running.values():
        assert row_owners.get(req.row) == req.rid
    block_owners = sched.blocks.owners()
    held = {b: r.rid for r in sched.running.values() for b in r.blocks}
    assert block_owners == held, "KV block ownership"
    groups = [sched.ready, sched.refills, sched.stalled, sched.refill.held]
    groups += [[it for it in f.items if not it.exited] for f in sched._loop.values()]
    count: dict[int, set[int]] = {}
    for group in groups:
        for it in group:
            if it.live:
                count.setdefault(it.req.rid, set()).add(id(it))
    assert all(len(v) == 1 for v in count.values()), "more than one token of a request in the loop"
