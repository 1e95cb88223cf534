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


def _refused_load(cache, monkeypatch, caplog):
    """load() against `cache`, bypassing its memo; the compiler must never run."""
    import logging

    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "1")

    def no_compiler(cmd, **kwargs):
        raise AssertionError("a refused cache must not be built into")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels.load.__wrapped__() is False
    return caplog.text


def test_a_world_writable_kernel_cache_is_refused(tmp_path, monkeypatch, caplog):
    """Anyone who can write the cache could plant a library this process loads."""
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    text = _refused_load(cache, monkeypatch, caplog)
    assert f"CPU kernel cache {cache} has mode 0777: group or others may write it" in text


def test_a_planted_library_in_a_group_writable_key_directory_is_refused(
    tmp_path, monkeypatch, caplog
):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "test")
    loaded = []
    monkeypatch.setattr(cpu_kernels.torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(cpu_kernels, "_build", lambda out, sources: out.write_bytes(b"lib"))
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "1")
    assert cpu_kernels.load.__wrapped__() is True and len(loaded) == 1  # a private cache loads
    [key_dir] = list(cache.iterdir())
    lib = key_dir / "pdserve_cpu.so"
    assert stat_mode(lib) == 0o700 and stat_mode(key_dir) == 0o700
    key_dir.chmod(0o770)
    text = _refused_load(cache, monkeypatch, caplog)
    assert f"CPU kernel cache {key_dir} has mode 0770" in text and len(loaded) == 1
    key_dir.chmod(0o700)
    lib.chmod(0o666)
    text = _refused_load(cache, monkeypatch, caplog)
    assert f"CPU kernel cache {lib} has mode 0666" in text and len(loaded) == 1


def test_check_private_refuses_symbolic_links_and_other_users(tmp_path):
    import os

    import pytest

    target = tmp_path / "t"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(cpu_kernels.KernelCacheRefused, match="is a symbolic link"):
        cpu_kernels.check_private(link)
    cpu_kernels.check_private(link, follow=True)  # the cache root may be a link
    if os.geteuid() == 0:
        os.chown(target, 12345, 12345)
        with pytest.raises(cpu_kernels.KernelCacheRefused, match="owned by uid 12345"):
            cpu_kernels.check_private(target)


def stat_mode(path) -> int:
    import stat

    return stat.S_IMODE(path.stat().st_mode)
