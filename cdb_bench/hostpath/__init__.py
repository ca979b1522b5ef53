"""``cdb bench hostpath``: the benchmark and what it reports are described in ``cdb_bench.hostpath.cli``.

Modules: ``points`` (what is measured and each point's engine config), ``measure`` (CPU readings, the steady
window, the collector's pauses), ``consumers`` (in-process, or clients of the public API in a child process),
``timeline`` (the loop stage's op log: busy fraction, idle gaps, reaction split), ``report`` (tables, medians over
rounds, JSON and plot), ``cli`` (the command).
"""

from cdb_bench.hostpath.cli import main, run_point
from cdb_bench.hostpath.points import Point, points, scaled_cost
from cdb_bench.hostpath.report import medians, write_outputs
from cdb_bench.hostpath.timeline import loop_timeline, reaction_split

__all__ = [
    "Point",
    "loop_timeline",
    "main",
    "medians",
    "points",
    "reaction_split",
    "run_point",
    "scaled_cost",
    "write_outputs",
]
