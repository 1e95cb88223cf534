"""How the CPU kernels are built (engine/cpu_kernels/__init__.py): the compiler sees exactly
the bytes the cache key was taken from, so a source edited while a build runs (a developer
saving a file, a checkout) can never land in the cache under the old key."""

import subprocess
from pathlib import Path

from engine import cpu_kernels


def test_build_compiles_the_hashed_bytes_not_the_files(tmp_path, monkeypatch):
    hashed = {src.name: src.read_bytes() for src in (*cpu_kernels._SOURCES, *cpu_kernels._HEADERS)}
    hashed["sampling_ops.cpp"] += b"\n// the bytes that were hashed\n"
    seen = {}

    def fake_compiler(cmd, **kwargs):
        sources = [Path(arg) for arg in cmd if arg.endswith(".cpp")]
        header = sources[0].parent / "vec16.h"  # included from the sources' own directory
        seen.update({p.name: p.read_bytes() for p in (*sources, header)})
        assert all(p.parent != cpu_kernels._DIR for p in sources)
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"library")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_compiler)
    out = tmp_path / "pdserve_cpu.so"
    cpu_kernels._build(out, hashed)
    assert seen == hashed
    assert out.read_bytes() == b"library"
    assert list(tmp_path.iterdir()) == [out]  # the copies are gone
