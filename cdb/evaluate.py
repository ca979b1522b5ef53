"""``cdb eval``: quality against depth (``cdb_train.quality``: perplexity and greedy agreement per exit threshold q,
through the reference path), or with ``--harness`` the evaluation harness through the server's API over q
(``cdb_bench.harness``: each task's accuracy and the mean served depth against q)."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    if "--harness" in argv:
        from cdb_bench.harness import main as harness

        return harness([a for a in argv if a != "--harness"])
    from cdb_train.quality import main as quality

    return quality(argv)
