"""``PriorityDepth`` (``--priority-depth``): under overload a looped model trades depth before anyone queues.

While requests wait for admission (the server is saturated), every running request of a less urgent priority than
the most urgent one present (running or waiting) exits by its shallow policy (``Request.depth_policies``: the
operator's floor threshold, or its own where that exits sooner), so that its tokens leave the loop earlier and
free rows sooner; once nothing waits, every request is back at its own policy. A token's exit state serves either
policy (same rule), so a switch takes effect at its next decision. Served depths are reported as always.

Checked once per scheduling round, in time constant unless something changed (a request admitted or released, the
waiting queue emptied or filled, a more urgent request queued): then once over the running requests.
"""

from __future__ import annotations

from cdb_scheduler.residency import Residency


class PriorityDepth:
    def __init__(self) -> None:
        self._key: tuple[bool, int, int, int] = (False, -1, -1, 0)
        self.shallow = 0  # running requests at their shallow policy now

    def update(self, residency: Residency) -> None:
        waiting, running = residency.waiting, residency.running
        saturated = bool(waiting)
        first = waiting[0].priority if waiting else 0  # (the waiting queue is ordered by priority)
        key = (saturated, residency.releases, len(running), first)
        if key == self._key:
            return
        self._key = key
        priorities = [r.priority for r in running.values()]
        if waiting:
            priorities.append(first)
        top = min(priorities, default=0)
        shallow = 0
        for req in running.values():
            pair = req.depth_policies
            if pair is not None:
                low = saturated and req.priority > top
                req.policy = pair[1] if low else pair[0]
                shallow += low
        self.shallow = shallow
