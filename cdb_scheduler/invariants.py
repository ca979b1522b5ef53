"""Ownership invariants of the scheduler, checked by the tests after every step."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cdb_scheduler.scheduler import Scheduler


def check_invariants(sched: Scheduler) -> None:
    """Ownership invariants (tests call this after every step): one row per running request (and one per token
    it runs speculatively ahead), blocks referenced exactly by the requests holding them, at most one token per request
    in the loop (queued or running) besides its speculative ones, each in a row of its own."""
    row_owners = sched.rows.owners()
    held_rows = {row: r.rid for r in sched.running.values() for row in (r.row, *r.spec_rows)}
    assert row_owners == held_rows, "row ownership"
    held: dict[int, int] = {}
    for r in sched.running.values():
        for b in r.blocks:
            held[b] = held.get(b, 0) + 1
    assert sched.blocks.owners() == held, "KV block ownership (references)"
    groups = [sched.ready, sched.refills, sched.stalled, sched.refill.held]
    groups += [[it for it in f.items if not it.exited] for f in sched.loop.flights.values()]
    count: dict[int, dict[int, int]] = {}
    for group in groups:
        for it in group:
            if it.live:
                count.setdefault(it.req.rid, {})[id(it)] = it.row
    for rid, rows in count.items():
        req = sched.running[rid]
        assert len(rows) <= 1 + len(req.spec_rows), "more than one token of a request in the loop"
        assert len(set(rows.values())) == len(rows), "two tokens of a request in one row"
