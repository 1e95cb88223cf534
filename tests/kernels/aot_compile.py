"""Compile every kernel exactly as its launcher would launch it, for an NVIDIA target, without a
GPU: the Triton interpreter accepts code the compiler rejects (e.g. non-constexpr globals), and
ptxas ships inside the triton wheel, so a CPU machine can still build the cubins.

Run as a script with TRITON_INTERPRET unset (tests/kernels/test_aot_compile.py does):
    python tests/kernels/aot_compile.py [--arch 90]
The launchers run on CPU tensors with each kernel replaced by a recorder; the recorded
arguments become the compile signature (tensors -> pointer types, keyword args -> constexprs,
divisibility by 16 -> the same specialisation attributes a real launch gets).
Prints one line per distinct variant; exits non-zero on the first failure.
"""

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

KERNELS = {  # module -> name of its kernel global
    "kernels.paged_attention": "paged_attention_kernel",
    "kernels.merge_partitions": "merge_partitions_kernel",
    "kernels.store_kv": "_store_kv_kernel",
    "kernels.rms_norm": "_rms_norm_kernel",
    "kernels.rope": "_rope_kernel",
    "kernels.silu_and_mul": "_silu_and_mul_kernel",
    "kernels.lora_shrink": "_lora_shrink_kernel",
    "kernels.lora_expand": "_lora_expand_kernel",
}
TYPE_CODES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.int8: "i8",
    torch.uint8: "u8",
}


class Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **constexprs)` is recorded."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def _type_code(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPE_CODES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def _resource_usage(cubin: bytes) -> str:
    """'regs=N stack=M' from cuobjdump (shipped with triton's NVIDIA backend); stack > 0 means
    register spills."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return "regs=? stack=?"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    found = dict(re.findall(r"\b(REG|STACK):(\d+)", out))
    return f"regs={found.get('REG', '?')} stack={found.get('STACK', '?')}"


def _divisible_by_16(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def record_launches() -> list:
    import kernels
    from kernels import (
        add_rms_norm,
        apply_rope,
        lora_expand,
        lora_shrink,
        paged_attention,
        plan_paged_attention,
        rms_norm,
        rope_cos_sin_cache,
        silu_and_mul,
        store_kv,
    )

    launches: list = []
    for module_name, attr in KERNELS.items():
        module = importlib.import_module(module_name)
        setattr(module, attr, Recorder(getattr(module, attr), launches))
    assert kernels  # the package import above already bound every launcher to its module

    def pool(dtype, block_size=16, kv_heads=3, head_dim=64):
        d_stored = head_dim + 4 if dtype == torch.int8 else head_dim  # int8: + the scale bytes
        return torch.zeros(8, kv_heads, 2, 2, block_size, d_stored, dtype=dtype)

    def attention(
        dtype,
        q_lens,
        seq_lens,
        partition_size,
        gqa=3,
        kv_heads=3,
        head_dim=64,
        kv_dtype=None,
        sliding_window=None,
        logits_soft_cap=None,
        **launch,
    ):
        cache = pool(kv_dtype or dtype, kv_heads=kv_heads, head_dim=head_dim)
        query = torch.zeros(sum(q_lens), kv_heads * gqa, head_dim, dtype=dtype)
        tables = torch.zeros(len(q_lens), 8, dtype=torch.int32)
        qsl = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        plan = plan_paged_attention(
            query.device,
            query.shape[0],
            len(q_lens),
            query.shape[1],
            kv_heads,
            head_dim,
            max(q_lens),
            max(seq_lens),
            partition_size=partition_size,
            sliding_window=sliding_window,
            kv_dtype=cache.dtype,
            **launch,
        )
        paged_attention(
            query,
            cache,
            1,
            tables,
            qsl,
            lens,
            0.125,
            max(q_lens),
            max(seq_lens),
            plan=plan,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        attention(dtype, [1, 1], [100, 30], partition_size=32)  # split-KV decode + merge
        attention(dtype, [64, 1], [100, 30], partition_size=0)  # prefill-sized tiles
    attention(torch.bfloat16, [40], [100], partition_size=0, gqa=1)
    attention(torch.bfloat16, [1, 1], [100, 30], partition_size=32, num_warps=8, num_stages=2)
    attention(torch.bfloat16, [1, 1], [100, 30], partition_size=0, head_dim=128, kv_heads=2, gqa=4)
    for dtype in (torch.bfloat16, torch.float16):  # sliding window + soft-cap (Gemma 2 / Mistral)
        attention(
            dtype, [1, 1], [100, 30], partition_size=32, sliding_window=40, logits_soft_cap=50.0
        )
        attention(
            dtype, [64, 1], [100, 30], partition_size=0, sliding_window=40, logits_soft_cap=50.0
        )
    attention(
        torch.bfloat16, [64, 1], [100, 30], partition_size=0, sliding_window=40, kv_dtype=torch.int8
    )
    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):  # quantized pools
        attention(torch.bfloat16, [1, 1], [100, 30], partition_size=32, kv_dtype=kv_dtype)
        attention(torch.bfloat16, [64, 1], [100, 30], partition_size=0, kv_dtype=kv_dtype)
        attention(torch.float16, [1, 1], [100, 30], partition_size=0, kv_dtype=kv_dtype)
    for dtype in (torch.bfloat16, torch.float32):
        key = torch.zeros(5, 3, 64, dtype=dtype)
        store_kv(key, key, pool(dtype), 1, torch.arange(5))
    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
        key = torch.zeros(5, 3, 64, dtype=torch.bfloat16)
        store_kv(key, key, pool(kv_dtype), 1, torch.arange(5))
    x = torch.zeros(4, 576, dtype=torch.bfloat16)
    rms_norm(x, x[0], 1e-5)
    add_rms_norm(x, x, x[0], 1e-5)
    q = torch.zeros(4, 9, 64, dtype=torch.bfloat16)
    apply_rope(q, q[:, :3], torch.arange(4), rope_cos_sin_cache(64, 16, 1e5))
    silu_and_mul(torch.zeros(4, 3072, dtype=torch.bfloat16))
    slots = torch.tensor([0, -1, 1, 0], dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        for rank in (16, 64):
            x = torch.zeros(4, 576, dtype=dtype)
            shrunk = lora_shrink(x, torch.zeros(2, rank, 576, dtype=dtype), slots)
            lora_shrink(x, torch.zeros(2, rank, 576, dtype=dtype), slots, split_k=4)
            qkv = torch.zeros(4, 3 * 576, dtype=dtype)
            lora_expand(
                qkv[:, 576:1152],
                shrunk,
                torch.zeros(2, 576, rank, dtype=dtype),
                slots,
                torch.ones(2),
            )
    return launches


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    args = parser.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    seen = set()
    for fn, call_args, kwargs in record_launches():
        assert isinstance(fn, triton.runtime.jit.JITFunction), "run without TRITON_INTERPRET"
        constexprs = {k: v for k, v in kwargs.items() if k in fn.arg_names}
        options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}  # num_warps, ...
        params = [name for name in fn.arg_names if name not in constexprs]
        signature = {name: _type_code(value) for name, value in zip(params, call_args)}
        signature.update({name: "constexpr" for name in constexprs})
        key = (fn.__name__, tuple(sorted(signature.items())), tuple(sorted(kwargs.items())))
        if key in seen:
            continue
        seen.add(key)
        start = time.perf_counter()
        # Triton's launch-time specialisation: 16-byte-aligned pointers and ints divisible by 16
        # are compiled as such (this is what lets loads vectorise).
        attrs = {
            (fn.arg_names.index(name),): [["tt.divisibility", 16]]
            for name, value in zip(params, call_args)
            if _divisible_by_16(value)
        }
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs, attrs), target=target, options=options
        )
        shown = {
            k: v
            for k, v in kwargs.items()
            if k
            in (
                "BLOCK_M",
                "TILE_N",
                "SPLIT_KV",
                "HAS_RESIDUAL",
                "SPLIT_K",
                "BLOCK_R",
                "KV_FORMAT",
                "USE_WINDOW",
                "USE_SOFT_CAP",
                "num_warps",
                "num_stages",
            )
        }
        dtype = signature[params[0]] if params else ""
        print(
            f"sm_{args.arch} {fn.__name__:24s} {dtype:6s} {shown} "
            f"shared={compiled.metadata.shared} "
            f"{_resource_usage(compiled.asm['cubin'])} ({time.perf_counter() - start:.1f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
