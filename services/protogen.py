"""Generate the Python stubs of the contract in `protos/`: `python -m services.protogen`.

The stubs land in `services/contract/` (committed). Generated modules import each other by
proto path (`from llmstage.v1 import ...`); those imports are rewritten to the package path so
the stubs work without touching `sys.path`. `--check` regenerates into a scratch folder and fails
when the committed stubs differ, which is how CI proves they are current. The output depends on
the grpcio-tools version, pinned in pyproject.toml.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "services" / "contract"
PACKAGE = "services.contract"
_IMPORT = re.compile(r"^(from|import) (llmstage\.)", re.MULTILINE)
_GENERATED = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs of every proto under `protos/` into `out_dir`; return the files."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    protos = [str(p.relative_to(PROTO_DIR)) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    files = sorted(f for pat in _GENERATED for f in out_dir.rglob(pat))
    for f in files:
        f.write_text(_IMPORT.sub(rf"\1 {PACKAGE}.\2", f.read_text()))
    for d in {f.parent for f in files}:
        while d != out_dir and d.is_relative_to(out_dir):
            (d / "__init__.py").touch()
            d = d.parent
    return files


def _clean(out_dir: Path) -> None:
    for pat in _GENERATED:
        for f in out_dir.rglob(pat):
            f.unlink()


def check() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        want = {f.relative_to(tmp) for f in fresh}
        have = {f.relative_to(OUT_DIR) for pat in _GENERATED for f in OUT_DIR.rglob(pat)}
        stale = sorted(str(p) for p in want ^ have)
        stale += sorted(str(p) for p in want & have
                        if not filecmp.cmp(Path(tmp) / p, OUT_DIR / p, shallow=False))
    if stale:
        print("generated stubs are stale: " + ", ".join(stale), file=sys.stderr)
        print("run: python -m services.protogen", file=sys.stderr)
        return 1
    print(f"stubs are current ({len(want)} files)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m services.protogen", description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="fail when the committed stubs differ from a fresh generation")
    args = parser.parse_args()
    if args.check:
        return check()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    _clean(OUT_DIR)
    with tempfile.TemporaryDirectory() as tmp:
        for f in generate(Path(tmp)):
            dest = OUT_DIR / f.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
    for d in OUT_DIR.rglob("*"):
        if d.is_dir():
            (d / "__init__.py").touch()
    (OUT_DIR / "__init__.py").touch()
    print(f"wrote stubs for {len(proto_files())} protos into {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
