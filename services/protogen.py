"""Generate the Python stubs of the contract in `protos/`: `python -m services.protogen`.

The stubs land in two committed places, one generation each: `services/contract/` for the
servers, and `clients/python/llm_stage_client/_contract/` so the client library installs alone
(without the servers) and still speaks exactly this contract. Generated modules import each
other by proto path (`from llmstage.v1 import ...`); those imports are rewritten to each copy's
package path so the stubs work without touching `sys.path`. `--check` regenerates both into a
scratch folder and fails when a committed copy differs, which is how CI proves they are current.
The output depends on the grpcio-tools version, pinned in pyproject.toml.
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
# Each place the stubs go, and the package they are imported as there.
TARGETS = ((ROOT / "services" / "contract", "services.contract"),
           (ROOT / "clients" / "python" / "llm_stage_client" / "_contract",
            "llm_stage_client._contract"))
_IMPORT = re.compile(r"^(from|import) (llmstage\.)", re.MULTILINE)
_GENERATED = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path, package: str) -> list[Path]:
    """Write the stubs of every proto under `protos/` into `out_dir`, importing each other as
    modules of `package`; return the files."""
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
        f.write_text(_IMPORT.sub(rf"\1 {package}.\2", f.read_text()))
    for d in {f.parent for f in files}:
        while d != out_dir and d.is_relative_to(out_dir):
            (d / "__init__.py").touch()
            d = d.parent
    return files


def _clean(out_dir: Path) -> None:
    for pat in _GENERATED:
        for f in out_dir.rglob(pat):
            f.unlink()


def _stale(out_dir: Path, package: str) -> list[str]:
    """The stub files of `out_dir` that a fresh generation would add, drop or change."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp), package)
        want = {f.relative_to(tmp) for f in fresh}
        have = {f.relative_to(out_dir) for pat in _GENERATED for f in out_dir.rglob(pat)}
        stale = sorted(want ^ have)
        stale += sorted(p for p in want & have
                        if not filecmp.cmp(Path(tmp) / p, out_dir / p, shallow=False))
    return [str((out_dir / p).relative_to(ROOT)) for p in stale]


def check() -> int:
    stale = [f for out_dir, package in TARGETS for f in _stale(out_dir, package)]
    if stale:
        print("generated stubs are stale: " + ", ".join(stale), file=sys.stderr)
        print("run: python -m services.protogen", file=sys.stderr)
        return 1
    print(f"stubs are current ({len(proto_files())} protos in {len(TARGETS)} places)")
    return 0


def write(out_dir: Path, package: str) -> None:
    """Replace the stubs in `out_dir` with a fresh generation."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _clean(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        for f in generate(Path(tmp), package):
            dest = out_dir / f.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
    for d in out_dir.rglob("*"):
        if d.is_dir() and d.name != "__pycache__":
            (d / "__init__.py").touch()
    (out_dir / "__init__.py").touch()
    print(f"wrote stubs for {len(proto_files())} protos into {out_dir.relative_to(ROOT)}")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m services.protogen", description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="fail when a committed copy of the stubs differs from a fresh "
                             "generation")
    args = parser.parse_args()
    if args.check:
        return check()
    for out_dir, package in TARGETS:
        write(out_dir, package)
    return 0


if __name__ == "__main__":
    sys.exit(main())
