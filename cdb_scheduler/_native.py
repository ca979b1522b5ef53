"""The scheduler compiled to C with mypyc, where it has been built and matches the source.

The planner runs on the engine thread for every loop step, over every token in the batch: in the interpreter its
per-token work costs ≈ 2.5-5 µs a token, the largest part of the scheduler process's CPU per step. mypyc compiles
the same typed modules to a C extension (native classes, unboxed ints, direct calls) with the same behaviour.

- ``cdb native build`` (run by ``make install`` and the image build) compiles the package's
  modules into ``cdb_scheduler/_native_build/`` with a manifest of the sources' SHA-256 digests.
- At import, ``cdb_scheduler`` calls :func:`attach`: the compiled modules are used only if every compiled module's
  source is byte for byte the one they were built from, for this interpreter; otherwise (a module edited since,
  another Python, no build, ``CDB_NATIVE=off``) the package runs from its source as always. A stale build is never
  used. ``cdb_scheduler.NATIVE`` says which one runs; ``cdb native status`` too.

Not compiled: this module and ``__init__`` (they decide), ``invariants`` (the tests' checks, which take any
scheduler, the interpreted one too), and ``sampling`` (its classes cross the front-end link, whose codec reads
their annotations). A class built per token writes its ``__init__`` out: the ``dataclass`` decorator's own is a
Python function even in a compiled class. (mypyc 2.4 emits C that does not compile for a ``while`` loop whose
condition is an ``and`` of three terms ending a function: ``prefill.pick_chunks`` tests the first apart.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
BUILD = PACKAGE / "_native_build"
MANIFEST = "manifest.json"
GROUP = "cdb_scheduler_native"  # the shared library every compiled module loads (``GROUP__mypyc``)
SKIP = frozenset({"__init__.py", "_native.py", "invariants.py", "sampling.py"})
OFF = ("0", "off", "false", "no")


def sources(package: Path = PACKAGE) -> list[Path]:
    """The modules that are compiled, in name order."""
    return sorted(p for p in package.glob("*.py") if p.name not in SKIP)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fresh(build: Path = BUILD, package: Path = PACKAGE) -> str | None:
    """None if ``build`` holds a build of exactly the current sources for this interpreter; else why not."""
    try:
        manifest = json.loads((build / MANIFEST).read_text())
    except FileNotFoundError:
        return "not built (cdb native build)"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest: {exc}"
    if manifest.get("cache_tag") != sys.implementation.cache_tag:
        return f"built for {manifest.get('cache_tag')}, running {sys.implementation.cache_tag}"
    built = manifest.get("sources", {})
    current = {p.name: _digest(p) for p in sources(package)}
    if set(built) != set(current):
        return "the package's modules changed since the build"
    changed = sorted(name for name, digest in current.items() if built[name] != digest)
    if changed:
        return f"edited since the build: {', '.join(changed)}"
    return None


used = False  # whether this process runs the compiled modules (``attach``)


def attach(path: list[str]) -> bool:
    """Put the compiled modules ahead of the sources on the package's ``__path__`` if they are fresh and wanted;
    returns whether they are used."""
    global used
    if os.environ.get("CDB_NATIVE", "auto").strip().lower() in OFF or fresh() is not None:
        return False
    path.insert(0, str(BUILD / "cdb_scheduler"))
    if str(BUILD) not in sys.path:
        sys.path.append(str(BUILD))  # where the shared library of the compiled modules is imported from
    used = True
    return True


def describe() -> str:
    """Which scheduler this process runs, and why not the compiled one."""
    if used:
        return "compiled (mypyc)"
    why = fresh()
    return f"interpreted ({why or 'CDB_NATIVE=' + os.environ.get('CDB_NATIVE', '')})"


def build(package: Path = PACKAGE, into: Path = BUILD, *, quiet: bool = True) -> None:
    """Compile the modules of ``package`` with mypyc into ``into`` (replaced whole), manifest last."""
    with tempfile.TemporaryDirectory(prefix="cdb-native-") as tmp:
        work = Path(tmp)
        shutil.copytree(package, work / "cdb_scheduler", ignore=shutil.ignore_patterns("_native_build", "__pycache__"))
        names = [f"cdb_scheduler/{p.name}" for p in sources(work / "cdb_scheduler")]
        script = (
            "import sys\n"
            "from setuptools import setup\n"
            "from mypyc.build import mypycify\n"
            f"setup(name='{GROUP}', ext_modules=mypycify({names!r}, opt_level='3', group_name='{GROUP}'),"
            " script_args=['build_ext', '--inplace'])\n"
        )
        out = subprocess.DEVNULL if quiet else None
        subprocess.run([sys.executable, "-c", script], cwd=work, check=True, stdout=out)
        staged = work / "staged"
        (staged / "cdb_scheduler").mkdir(parents=True)
        suffix = "*" + _ext_suffix()
        for lib in (work / "cdb_scheduler").glob(suffix):
            shutil.copy2(lib, staged / "cdb_scheduler" / lib.name)
        for lib in work.glob(suffix):
            shutil.copy2(lib, staged / lib.name)
        digests = {p.name: _digest(p) for p in sources(package)}
        if {p.name for p in sources(work / "cdb_scheduler")} != set(digests):
            raise RuntimeError("the package changed during the build")
        manifest = {"cache_tag": sys.implementation.cache_tag, "sources": digests}
        (staged / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if into.exists():
            shutil.rmtree(into)
        shutil.copytree(staged, into)


def _ext_suffix() -> str:
    import importlib.machinery

    return importlib.machinery.EXTENSION_SUFFIXES[0]
