"""Generate the Python gRPC code under specbatch/v1 from protos/ (run: python -m specbatch.protocol.generate).

The generated modules are committed; tests/test_protos.py fails when they are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.rglob("*.proto"))
    args = ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}"] + [str(p) for p in protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_dir / "specbatch" / "v1").glob("*.py*"))


if __name__ == "__main__":
    for path in generate(ROOT):
        print(path.relative_to(ROOT))
    sys.exit(0)
