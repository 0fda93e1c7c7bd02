"""Generate the Python protobuf/gRPC modules from `proto/`.

The `.proto` files under `proto/tlt/v1/` are the single source of truth for
every message that crosses a process boundary. This module runs `grpc_tools`'
protoc over them and writes `tlt/v1/*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py`.
The build (`make`) runs it; `tests/test_proto_fresh.py` regenerates into a
temporary folder and fails when the committed code is stale.

    python -m tlt.protogen            # regenerate in place
    python -m tlt.protogen --check    # exit 1 if stale
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_PACKAGE = ("tlt", "v1")


def proto_files() -> list[Path]:
    return sorted((PROTO_DIR / Path(*OUT_PACKAGE)).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc into `out_root`; return the generated files."""
    from grpc_tools import protoc  # build-time dependency
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_DIR)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *files,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
    out_dir = out_root.joinpath(*OUT_PACKAGE)
    return sorted(p for p in out_dir.iterdir() if p.name.endswith((".py", ".pyi")) and p.name != "__init__.py")


def stale_files() -> list[str]:
    """Names of generated files that differ from (or are missing in) the package."""
    committed = ROOT.joinpath(*OUT_PACKAGE)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        names = {p.name for p in fresh}
        bad = [p.name for p in fresh if not (committed / p.name).exists() or not filecmp.cmp(p, committed / p.name, shallow=False)]
        extra = [p.name for p in committed.glob("*_pb2*.py*") if p.name not in names]
    return sorted(bad + extra)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed code is stale")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale_files()
        if bad:
            print("stale generated code: " + ", ".join(bad) + " (run `python -m tlt.protogen`)", file=sys.stderr)
            return 1
        print("generated code is fresh")
        return 0
    out = regenerate()
    print(f"generated {len(list(out.glob('*_pb2*.py*')))} files in {out}")
    return 0


def regenerate() -> Path:
    """Regenerate the package's modules in place; return their folder. protoc writes into a temporary
    folder first and the package's files are replaced only once it succeeded: a failed run (a broken
    .proto) leaves the previous modules, so the package still imports. Modules of protos that no longer
    exist are removed. The temporary folder is under ROOT (the package's file system): each `os.replace`
    is atomic."""
    out = ROOT.joinpath(*OUT_PACKAGE)
    with tempfile.TemporaryDirectory(prefix=".protogen-", dir=ROOT) as tmp:
        fresh = generate(Path(tmp))  # raises on a protoc failure, before anything in `out` is touched
        names = {p.name for p in fresh}
        for p in out.glob("*_pb2*.py*"):
            if p.name not in names:
                p.unlink()
        for p in fresh:
            os.replace(p, out / p.name)
    return out


if __name__ == "__main__":
    sys.exit(main())
