"""``cdb native``: the scheduler compiled with mypyc (``cdb_scheduler._native``).

- ``build``: compile it (needs a C compiler and mypy, the dev extra); ``make install`` runs it.
- ``status``: whether this interpreter runs the compiled scheduler, and if not, why not.
- ``clean``: remove the build (the package then runs from its source).
"""

from __future__ import annotations

import argparse
import shutil

from cdb_scheduler import _native


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cdb native", description="the scheduler compiled with mypyc")
    parser.add_argument("action", choices=("build", "status", "clean"), nargs="?", default="status")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    if args.action == "build":
        _native.build(quiet=not args.verbose)
        print(f"compiled scheduler built in {_native.BUILD}")
    elif args.action == "clean":
        shutil.rmtree(_native.BUILD, ignore_errors=True)
    else:
        print(f"scheduler: {_native.describe()}")
    return 0
