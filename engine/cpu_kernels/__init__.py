"""The engine's CPU kernels in C++ (engine/cpu_kernels/*.cpp): built on first use with the
system's g++ against the installed torch, cached, loaded as `torch.ops.pdserve_cpu`.

The build is keyed by the source, the compiler flags, the torch version and this CPU's
flags (it is compiled with -march=native), so a cached library never runs on a CPU or torch
it was not built for; the compiler reads a copy of the very bytes the key was taken from (a
source edited during a build cannot land under the old key). It lands in
`$PDSERVE_KERNEL_CACHE` (default ~/.cache/pdserve/cpu_kernels); concurrent builds (pytest
workers) serialise on a lock file. A library is code this process runs: the cache directory,
the key's directory and the library must be owned by this process's user (or root) and not
writable by group or others, else the cache is refused (`KernelCacheRefused`, logged) and the
plain-torch paths are used. Without a compiler, or with PDSERVE_CPU_KERNELS=0, `load()`
returns False and the torch backend and the model layers keep their plain-torch paths — same
results to rounding, slower.

`paged_decode(query, kv_cache, layer, block_tables, seq_lens, scale, window, soft_cap)`:
decode rows (one query token per sequence) attending over the pool in place. query
[S, Hq, D] (unit last stride), kv_cache the engine's contiguous `[N, Hkv, L, 2, B, D]` pool
in query's dtype, or quantized (engine/kv/kv_format.py: float8_e4m3fn / float8_e5m2 with the
same D, int8 with D + 4: each row's float32 scale after its values; widened to fp32 as read,
never dequantized into new tensors), block_tables int32 [S, >= blocks], seq_lens
int32 [S] (keys 0..seq_len-1, the query at seq_len-1), window 0 = none (else keys
seq_len-window..seq_len-1; no table entry before the window's first block is read),
soft_cap 0 = none. Returns [S, Hq, D] in query's dtype; softmax and sums in fp32.

`paged_prefill(query, kv_cache, layer, block_tables, seq_lens, query_lens, scale)`: the
query rows of S sequences back to back (sequence s: query_lens[s] rows, the last ones of its
seq_lens[s] positions, causal), bf16 [T, Hq, D] (unit last stride, D a multiple of 32), over
a bf16 pool that already holds their K/V; block_tables int32 [S, >= blocks], seq_lens and
query_lens int32 [S]. Returns [T, Hq, D] bf16; scores and softmax in fp32, the probabilities
rounded to bf16 for the P V product (as torch's CPU flash attention). AMX-BF16 tiles where
the compiler targets AMX, else AVX512-BF16's vdpbf16ps (`prefill_isa()`: "amx" /
"avx512_bf16"); not built without AVX512-BF16 (`prefills_in_place`); no window, no soft cap.

`store_kv_(key, value, kv_cache, layer, slot_mapping)`: a step's K/V rows ([T, Hkv, D] each,
each token's heads contiguous) into `layer` of a pool in their dtype, in place, at
slot_mapping (int64 [T], block * B + offset; -1 = not stored); `stores_in_place` says
whether it serves a key/value/pool (quantized pools keep the torch backend's path).

`sample_rows(x, uniforms, temperatures, chunk)`: the sampler's tokens (sampling_ops.cpp), one
per row of x (float32 or bfloat16 [rows, vocab], unit last stride, read only; bf16 widened as
read), int64 [rows]. A row whose temperature (float32 [rows], or None: all 1) is 0 takes its
argmax (`argmax_rows`); any other draws for its uniform (float32 [rows] in [0, 1)) what
engine/sampling/sampler.py's `inverse_cdf` draws from the numerators exp(x / t - max) and their
chunk sums — x / t an fp32 division, as the sampler's fallback `div_` — without writing them (the
chunk the draw lands in is recomputed).
`argmax_rows(x)`: x.argmax(-1) (first index of the maximum, of the first NaN where a row has
one) for float32 or bfloat16 [rows, vocab], unit last stride, in one read of each row.
`first_uniforms(keys)`: float32 [rows], each row's first uniform of engine/sampling/sampler.py's
`row_uniforms` rounded to float32, from its `draw_keys` (int64 [rows, 3]: seed mod 2^64,
completion index, output position).
`exp_chunk_totals_(x, chunk)`: x (float32 [rows, vocab], unit last stride) becomes exp(x - its
row's max) in place, and the sums of each `chunk` columns come back, [rows, ceil(vocab /
chunk)] float32 — the numerators and sums `sample_rows` draws from (the tests' view of them).

`LAYER_OPS`: RMSNorm, residual add + RMSNorm, RoPE in place and SiLU-and-mul (layer_ops.cpp),
with the contracts of the Triton kernels of the same names (`kernels`), so a model's layers
call either set through `ctx.kernels` (engine/models/layers.py)."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import stat
import subprocess
import sysconfig
from pathlib import Path

import torch

from engine.kv.kv_format import SCALE_BYTES

log = logging.getLogger(__name__)
_DIR = Path(__file__).parent
_SOURCES = (
    _DIR / "paged_decode.cpp",
    _DIR / "paged_prefill.cpp",
    _DIR / "layer_ops.cpp",
    _DIR / "sampling_ops.cpp",
)
_HEADERS = (_DIR / "vec16.h",)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _flags() -> list[str]:
    """The compiler flags: -march from PDSERVE_CPU_KERNELS_MARCH (default native; e.g.
    x86-64-v3 builds the AVX2 paths on an AVX-512 host, which is how the tests cover them).
    -fopenmp: ATen's parallel_for is OpenMP pragmas in the headers (serial without it); the
    library's libgomp.so.1 resolves to the one torch already loaded."""
    march = os.environ.get("PDSERVE_CPU_KERNELS_MARCH", "native")
    return [
        "-O3",
        f"-march={march}",
        "-fopenmp",
        "-ffp-contract=fast",
        "-std=c++20",
        "-shared",
        "-fPIC",
    ]


def _build(out: Path, sources: dict[str, bytes]) -> None:
    """Compile `sources` (file name -> the bytes the cache key was taken from) into `out`:
    from a copy, so a source edited during the build cannot land under the old key."""
    import tempfile

    from torch.utils import cpp_extension

    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        for name, text in sources.items():
            (Path(tmp) / name).write_bytes(text)
        cmd = [
            "g++",
            *_flags(),
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *[f"-I{p}" for p in cpp_extension.include_paths()],
            f"-I{sysconfig.get_paths()['include']}",
            *(str(Path(tmp) / src.name) for src in _SOURCES),
            "-o",
            str(out),
            *[f"-L{p}" for p in cpp_extension.library_paths()],
            "-lc10",
            "-ltorch_cpu",
            "-lmvec",
        ]
        subprocess.run(cmd, check=True, capture_output=True, text=True)


class KernelCacheRefused(PermissionError):
    """The kernel cache could be changed by someone other than this process's user."""


def check_private(path: Path, follow: bool = False) -> None:
    """KernelCacheRefused unless `path` (a symbolic link refused, or followed with `follow`)
    is owned by this process's user or root and not writable by group or others."""
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif st.st_uid not in (os.geteuid(), 0):
        problem = f"is owned by uid {st.st_uid}, not this process's user ({os.geteuid()})"
    elif st.st_mode & 0o022:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}: group or others may write it"
    else:
        return
    raise KernelCacheRefused(
        f"CPU kernel cache {path} {problem}; a library there would run in this process "
        "(set PDSERVE_KERNEL_CACHE to a directory of this user with mode 0700)"
    )


@functools.cache
def load() -> bool:
    """Build (once per source / torch / CPU) and load the kernels; False where they cannot
    be (no compiler, a failed build, PDSERVE_CPU_KERNELS=0)."""
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        return False
    try:
        # absent from an install that left out the sources: OSError, the torch paths instead
        sources = {src.name: src.read_bytes() for src in (*_SOURCES, *_HEADERS)}
        key = hashlib.sha256()
        for text in sources.values():
            key.update(text)
        key.update(" ".join(_flags()).encode())
        key.update(torch.__version__.encode())
        key.update(_cpu_flags().encode())
        cache = Path(
            os.environ.get("PDSERVE_KERNEL_CACHE", Path.home() / ".cache/pdserve/cpu_kernels")
        )
        lib = cache / key.hexdigest()[:16] / "pdserve_cpu.so"
        lib.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private(cache, follow=True)
        check_private(lib.parent)
        with open(lib.parent / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not lib.exists():
                tmp = lib.with_suffix(f".{os.getpid()}.tmp")
                _build(tmp, sources)
                tmp.chmod(0o700)
                os.replace(tmp, lib)
        check_private(lib)
        torch.ops.load_library(str(lib))
    except (OSError, subprocess.CalledProcessError, RuntimeError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        log.warning("CPU kernels unavailable (plain torch instead): %s %s", exc, detail[-2000:])
        return False
    return True


def vector_isa() -> str:
    """The ISA the loaded library's vector paths were built for: "avx512", "avx2" or "scalar"
    (vec16.h); `load()` must have returned True."""
    return torch.ops.pdserve_cpu.vector_isa()


def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """See the module docstring; `load()` must have returned True."""
    return torch.ops.pdserve_cpu.paged_decode(
        query, kv_cache, layer, block_tables, seq_lens, scale, window or 0, soft_cap or 0.0
    )


def prefills_in_place(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether `paged_prefill` serves this query and pool: bf16 both, head_dim a multiple of
    32, a block size that is a multiple of 16, on a CPU with AVX512-BF16 or AMX-BF16 (the op
    is built only there) and the kernels loaded."""
    return (
        query.device.type == "cpu"
        and query.dtype == kv_cache.dtype == torch.bfloat16
        and query.stride(-1) == 1
        and query.shape[-1] % 32 == 0
        and kv_cache.shape[4] % 16 == 0
        and kv_cache.shape[-1] == query.shape[-1]
        and load()
        and hasattr(torch.ops.pdserve_cpu, "paged_prefill")
    )


def paged_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """See the module docstring; `prefills_in_place` must have returned True."""
    return torch.ops.pdserve_cpu.paged_prefill(
        query, kv_cache, layer, block_tables, seq_lens, query_lens, scale
    )


def stores_in_place(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether `store_kv_` serves these rows and pool (CPU, the pool in their dtype, each
    token's heads contiguous) and the kernels loaded."""
    return (
        key.device.type == "cpu"
        and kv_cache.dtype == key.dtype == value.dtype
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and key.stride(-2) == key.shape[-1]
        and value.stride(-2) == value.shape[-1]
        and load()
    )


def store_kv_(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    """See the module docstring; `stores_in_place` must have returned True."""
    torch.ops.pdserve_cpu.store_kv_(key, value, kv_cache, layer, slot_mapping)


def exp_chunk_totals_(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """See the module docstring; `load()` must have returned True."""
    return torch.ops.pdserve_cpu.exp_chunk_totals_(x, chunk)


def sample_rows(
    x: torch.Tensor, uniforms: torch.Tensor, temperatures: torch.Tensor | None, chunk: int
) -> torch.Tensor:
    """See the module docstring; `load()` must have returned True."""
    return torch.ops.pdserve_cpu.sample_rows(x, uniforms, temperatures, chunk)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """See the module docstring; `load()` must have returned True."""
    return torch.ops.pdserve_cpu.argmax_rows(x)


def first_uniforms(keys: torch.Tensor) -> torch.Tensor:
    """See the module docstring; `load()` must have returned True."""
    return torch.ops.pdserve_cpu.first_uniforms(keys)


def reads_logits(x: torch.Tensor) -> bool:
    """Whether `sample_rows` / `argmax_rows` serve these logits (CPU, float32 or bfloat16,
    unit last stride) and the kernels loaded."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.dim() == 2
        and x.stride(-1) == 1
        and load()
    )


_EXTRA_BYTES = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 0, torch.int8: SCALE_BYTES}
"""Quantized pools `paged_decode` reads: what each row stores after its head_dim values."""


def fits(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether `paged_decode` serves this query and pool (CPU; the pool in query's dtype or
    one of the quantized formats, with the matching head size)."""
    if (
        query.device.type != "cpu"
        or query.stride(-1) != 1
        or query.dtype not in (torch.float32, torch.bfloat16, torch.float16)
    ):
        return False
    extra = 0 if kv_cache.dtype == query.dtype else _EXTRA_BYTES.get(kv_cache.dtype)
    return extra is not None and kv_cache.shape[-1] == query.shape[-1] + extra


class LayerOps:
    """The layer kernels for `ctx.kernels` on the CPU (the Triton package's names and
    contracts: kernels/rms_norm.py, rope.py, silu_and_mul.py). `load()` must have returned
    True."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Over x's last dim; x may be a strided view (Qwen3's per-head q/k norms read views
        of the fused qkv): it is read through a contiguous copy then."""
        return torch.ops.pdserve_cpu.rms_norm(x.contiguous(), weight, eps)

    @staticmethod
    def add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype first."""
        return torch.ops.pdserve_cpu.add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def apply_rope(
        q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> None:
        """q [T, Hq, D], k [T, Hk, D] (strided views allowed) rotated in place at `positions`
        by the fp32 `cos | sin` table [P, R]; dims past R pass through."""
        torch.ops.pdserve_cpu.rope_(q, k, positions.to(torch.int64), cos_sin_cache)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve_cpu.silu_and_mul(x)


LAYER_OPS = LayerOps()
