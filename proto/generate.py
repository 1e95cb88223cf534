"""Regenerate proto/*_pb2*.py from proto/*.proto. Run from anywhere: `python -m proto.generate`.

Generation runs from the repository root with `-I .`, so generated modules import each other
package-qualified (`from proto import pdserve_pb2`)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def generate(out_dir: Path = REPO) -> None:
    import subprocess

    protos = sorted(str(p.relative_to(REPO)) for p in (REPO / "proto").glob("*.proto"))
    # A child process: grpc_tools' bundled protobuf crashes when loaded into a process that
    # already holds torch/NIXL (seen in the full test run).
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{REPO}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            *protos,
        ],
        cwd=REPO,
        check=True,
    )


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
