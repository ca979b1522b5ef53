"""Regenerate the protobuf/gRPC stubs of ``protos/cdb_api/v1/*.proto`` into ``cdb_api/v1/``.

Run ``python -m cdb_api.build`` (``make protos``) from anywhere; the output is deterministic for a given
grpcio-tools version, and the generated files are committed so that a fresh clone imports them without
grpcio-tools. ``python -m cdb_api.build --check`` exits 1 when the committed stubs differ from a fresh build.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = Path("cdb_api") / "v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """The .proto files, relative to ``protos/`` (their import path)."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into ``out_dir`` (which mirrors the repository root); return the generated files."""
    from grpc_tools import protoc  # only needed to regenerate, not to import the stubs

    well_known = str(resources.files("grpc_tools") / "_proto")
    files = [str(p) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed for {files}")
    return sorted(out_dir.joinpath(PACKAGE_DIR).glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare committed stubs with a fresh build")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        stale = []
        for path in generated:
            target = ROOT / PACKAGE_DIR / path.name
            if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                stale.append(target)
                if not args.check:
                    target.write_bytes(path.read_bytes())
        if args.check:
            for target in stale:
                print(f"stale: {target.relative_to(ROOT)}", file=sys.stderr)
            return 1 if stale else 0
        print(f"generated {len(generated)} files in {PACKAGE_DIR} ({len(stale)} changed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
