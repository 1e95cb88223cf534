"""The engine's configuration: one frozen object, parsed once in each process's entry point."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from engine.checks import check_fields
from engine.spec_decode.config import SpeculativeConfig

GiB = 1 << 30
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
"""vLLM's kv_cache_dtype values pdserve stores (engine/kv_format.py)."""


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"
    """HF-format LLaMA directory, GGUF file, or "default" (bundled SmolLM2-135M-Instruct)."""
    dtype: str = "auto"
    """float32 | bfloat16 | float16 | auto (bfloat16 on CUDA and on CPUs with native bf16
    (AVX512-BF16/AMX), else float32)."""
    device: str = "auto"
    """cpu | cuda | auto."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: int | None = None
    """KV pool size in bytes. Default on CPU: 2 GiB; on CUDA: derived from
    gpu_memory_utilization after a profiling forward."""
    gpu_memory_utilization: float = 0.9
    """Share of the GPU's memory this engine may use (weights + activations + KV pool)."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens. Default: the model's max_position_embeddings."""
    max_num_seqs: int = 128
    """Most requests in one batch."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (prefill chunks + decodes)."""
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    """Off: a prompt is scheduled only when all of it fits the step's budget."""
    long_prefill_token_threshold: int = 0
    """Most prompt tokens one request computes in one step (vLLM's knob; 0: only the step
    budget limits a chunk). On a decode worker that prefills long prompts itself, this keeps
    each step short enough for the decodes sharing it (the router's --itl-slo-ms estimate
    reads it from the worker's registration). Needs chunked prefill."""
    attention_backend: str = "auto"
    """torch | triton | auto (triton on CUDA, torch on CPU)."""
    num_layers: int | None = None
    """Load only the first N layers (tests and quick experiments)."""
    seed: int = 0
    """Seeds the draw of per-request seeds for requests that bring none."""
    generation_config: str = "auto"
    """Where default sampling settings come from (vLLM's --generation-config): auto (the
    model's generation_config.json), vllm (built-in defaults only) or a folder holding a
    generation_config.json. See engine.generation_config."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (vLLM's speculative_config; a dict or its JSON is accepted and
    parsed here). None: off. See engine.spec_decode."""

    kv_cache_dtype: str = "auto"
    """How K/V are stored (vLLM's): auto (the model dtype), fp8 / fp8_e4m3, fp8_e5m2, or int8
    (per-token, per-head scales inside the block). See engine.kv_format."""
    enable_sleep_mode: bool = False
    """Allow `sleep(level)` / `wake_up()` (vLLM's): free the KV pool (level 1; weights stay, on
    the CPU) or also drop the weights (level 2)."""
    worker_extension_cls: str | None = None
    """`module:Class` whose methods `collective_rpc` can call (vLLM's hook); built as
    Class(engine)."""
    enable_lora: bool = False
    """Serve LoRA adapters over the base model (engine/lora)."""
    max_loras: int = 1
    """Distinct adapters in one step (GPU-resident slots)."""
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    """Adapters kept loaded on the CPU (default: max_loras)."""
    lora_modules: tuple[str, ...] = ()
    """`name=path` adapters loaded at start (vLLM's --lora-modules)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        check_fields(self, [
            (self.block_size in (8, 16, 32, 64, 128), "block_size", "must be 8, 16, 32, 64 or 128"),
            (self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory", "must be > 0"),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]"),
            (self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1"),
            (self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold", "must be >= 0"),
            (self.enable_chunked_prefill or not self.long_prefill_token_threshold,
             "long_prefill_token_threshold", "needs enable_chunked_prefill"),
            (self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", "is not supported"),
            (self.device in ("auto", "cpu", "cuda"), "device", "must be cpu, cuda or auto"),
            (self.attention_backend in ("auto", "torch", "triton"), "attention_backend", "is unknown"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
             f"must be one of {', '.join(KV_CACHE_DTYPES)}"),
            (self.max_loras >= 1, "max_loras", "must be >= 1"),
            (1 <= self.max_lora_rank <= 512, "max_lora_rank", "must be in [1, 512]"),
            (self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
             "must be >= max_loras"),
            (all("=" in m and m.split("=", 1)[0] and m.split("=", 1)[1] for m in self.lora_modules),
             "lora_modules", "must be name=path"),
            (self.enable_lora or not self.lora_modules, "lora_modules", "needs enable_lora"),
        ])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def _size(text: str) -> int:
    """Bytes from '2GiB', '512MiB', '1e9' or a plain integer."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9}
    low = text.strip().lower()
    for suffix, mult in units.items():
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * mult)
    return int(float(low))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """vLLM-style flags for EngineConfig (names match vLLM's where the concept is the same)."""
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=d.model, help="HF LLaMA directory, GGUF file, or 'default'")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", type=_size, default=None,
                   help="KV pool bytes, e.g. 2GiB (default: 2GiB on CPU, profiled on CUDA)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=d.enable_chunked_prefill)
    g.add_argument("--long-prefill-token-threshold", type=int,
                   default=d.long_prefill_token_threshold,
                   help="most prompt tokens one request computes per step (0: the step budget "
                        "only); on decode workers it keeps decodes flowing beside long local "
                        "prefills")
    g.add_argument("--attention-backend", default=d.attention_backend,
                   choices=["auto", "torch", "triton"])
    g.add_argument("--num-layers", type=int, default=None, help="load only the first N layers")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or '
                        '\'{"method": "draft_model", "model": "self:8" | PATH, '
                        '"num_speculative_tokens": 3}\' (decode workers speculate)')
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage: auto (model dtype), fp8 (= fp8_e4m3), fp8_e5m2, int8")
    g.add_argument("--enable-sleep-mode", action="store_true",
                   help="allow sleep/wake_up (free the KV pool, offload or drop weights)")
    g.add_argument("--worker-extension-cls", default=None, metavar="MODULE:CLASS",
                   help="a class whose methods collective_rpc may call")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT format)")
    g.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="distinct LoRA adapters in one batch")
    g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank)
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="LoRA adapters kept loaded on the CPU (default: --max-loras)")
    g.add_argument("--lora-modules", nargs="+", default=(), metavar="NAME=PATH",
                   help="LoRA adapters to load at start, served as model NAME")
    g.add_argument("--generation-config", default=d.generation_config,
                   help="default sampling settings: auto (the model's generation_config.json), "
                        "vllm (built-in defaults) or a folder with a generation_config.json")
