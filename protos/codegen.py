"""The one codegen step: protos/*.proto -> protos/*_pb2.py, *_pb2_grpc.py.

Run with `python -m protos.codegen` (a build step: scripts/setup.sh and the
Dockerfile run it).  tests/unit/test_protos.py fails when the generated files
are older than their .proto.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent


def stale() -> bool:
    for proto in HERE.glob("*.proto"):
        out = HERE / f"{proto.stem}_pb2_grpc.py"
        if not out.exists() or out.stat().st_mtime < proto.stat().st_mtime:
            return True
    return False


def generate() -> None:
    from grpc_tools import protoc

    for proto in sorted(HERE.glob("*.proto")):
        # Proto path = the repo root, so generated imports read `from protos import ...`.
        rc = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={ROOT}",
                          f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}",
                          str(proto.relative_to(ROOT))])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {rc})")


if __name__ == "__main__":
    generate()
    print("generated", ", ".join(p.name for p in sorted(HERE.glob("*_pb2*.py"))), file=sys.stderr)
