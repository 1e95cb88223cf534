"""The engine's configuration: one frozen object, parsed once in each process's entry point.
Its flags come from its fields (engine.flags): names, defaults, choices, and help from the
docstring under each field."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import NamedTuple

from engine.checks import FieldError, check_fields
from engine.flags import add_flags, from_args, option
from engine.spec_decode.config import SpeculativeConfig

log = logging.getLogger(__name__)

GiB = 1 << 30
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
"""vLLM's kv_cache_dtype values pdserve stores (engine/kv/kv_format.py)."""


def parse_size(text: str) -> int:
    """Bytes from '2GiB', '512MiB', '1e9' or a plain integer."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9}
    low = text.strip().lower()
    for suffix, mult in units.items():
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * mult)
    return int(float(low))


def parse_offloading_size(text: str) -> int:
    """Bytes from vLLM's --kv-offloading-size: a plain number is GiB (vLLM's unit, e.g.
    '64' or '0.5'); with a unit it is what parse_size reads ('512MiB'), 'B' for bytes."""
    low = text.strip().lower()
    if low.endswith("b") and low[:-1].replace(".", "", 1).isdigit():
        return int(float(low[:-1]))
    try:
        return int(float(low) * GiB)
    except ValueError:
        return parse_size(text)


def format_offloading_size(size: int) -> str:
    """The inverse of parse_offloading_size (exact: in bytes)."""
    return f"{size}B"


class LoRAModule(NamedTuple):
    """One `--lora-modules` entry, vLLM's `name=path`: a LoRA adapter served as model `name`.
    `dict(config.lora_modules)` is name -> path."""

    name: str
    path: str

    @classmethod
    def parse(cls, value: "LoRAModule | str") -> "LoRAModule":
        """From `name=path` (the flag's text) or a LoRAModule."""
        if isinstance(value, LoRAModule):
            return value
        name, sep, path = str(value).partition("=")
        if not (sep and name and path):
            raise FieldError("lora_modules", f"lora_modules must be name=path, got {value!r}")
        return cls(name, path)

    def __str__(self) -> str:
        return f"{self.name}={self.path}"


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"
    """HF-format LLaMA directory, GGUF file, or "default" (bundled SmolLM2-135M-Instruct)."""
    dtype: str = option("auto", choices=DTYPES)
    """float32 | bfloat16 | float16 | auto (bfloat16 on CUDA and on CPUs with native bf16
    (AVX512-BF16/AMX), else float32)."""
    device: str = option("auto", choices=DEVICES)
    """cpu | cuda | auto."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: int | None = option(None, type=parse_size, metavar="BYTES")
    """KV pool size in bytes, e.g. 2GiB or 512MiB. Default on CPU: 2 GiB; on CUDA: derived
    from gpu_memory_utilization after a profiling forward."""
    gpu_memory_utilization: float = 0.9
    """Share of the GPU's memory this engine may use (weights + activations + KV pool)."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens. Default: the model's max_position_embeddings;
    longer is refused unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (as vLLM)."""
    max_num_seqs: int = 128
    """Most requests in one batch."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (prefill chunks + decodes)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of earlier prompts' blocks (by chained block hash)."""
    enable_chunked_prefill: bool = True
    """Off: a prompt is scheduled only when all of it fits the step's budget."""
    long_prefill_token_threshold: int = 0
    """Most prompt tokens one request computes in one step (vLLM's knob; 0: only the step
    budget limits a chunk). On a decode worker that prefills long prompts itself, this keeps
    each step short enough for the decodes sharing it (the router's --itl-slo-ms estimate
    reads it from the worker's registration). Needs chunked prefill."""
    attention_backend: str = option("auto", choices=ATTENTION_BACKENDS)
    """torch | triton | auto (triton on CUDA, torch on CPU)."""
    num_layers: int | None = None
    """Load only the first N layers (tests and quick experiments)."""
    enforce_eager: bool = False
    """vLLM's flag: run every step eagerly. Off (the default), decode steps on CUDA with the
    Triton backend replay CUDA graphs captured per batch size (engine/runner/cuda_graphs.py); on
    the CPU the forward is always eager (a compiled CPU decode forward measured no faster,
    docs/kernels.md), so there the flag changes nothing."""
    cuda_graph_sizes: tuple[int, ...] = ()
    """vLLM's: the decode batch sizes to capture CUDA graphs for (a step of n rows replays
    the smallest size >= n; larger batches run eagerly). Empty: 1, 2, 4 and every multiple
    of 8 up to max_num_seqs. Refused where no graph is captured (CPU, the torch attention
    backend, enforce_eager, tensor_parallel_size > 1)."""
    seed: int = 0
    """Seeds the draw of per-request seeds for requests that bring none."""
    generation_config: str = "auto"
    """Where default sampling settings come from (vLLM's --generation-config): auto (the
    model's generation_config.json), vllm (built-in defaults only) or a folder holding a
    generation_config.json. See engine.processing.generation_config."""
    speculative_config: SpeculativeConfig | None = option(
        None, type=str, format=SpeculativeConfig.to_json, metavar="JSON"
    )
    """Speculative decoding (vLLM's speculative_config; a dict or its JSON is accepted and
    parsed here), e.g. '{"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4}' or '{"method": "draft_model", "model": "self:8" | PATH,
    "num_speculative_tokens": 3}'. None: off. Decode workers speculate, prefill workers drop
    it. See engine.spec_decode."""

    kv_cache_dtype: str = option("auto", choices=KV_CACHE_DTYPES)
    """How K/V are stored (vLLM's): auto (the model dtype), fp8 / fp8_e4m3, fp8_e5m2, or int8
    (per-token, per-head scales inside the block). See engine.kv.kv_format."""
    kv_offloading_size: int = option(
        0, type=parse_offloading_size, format=format_offloading_size, metavar="SIZE"
    )
    """Capacity of the KV cache's second tier (vLLM's flag; a plain number is GiB, or say
    512MiB, 4GiB): cached blocks evicted from the KV pool are copied there instead of dropped,
    and a prefix hit there is copied back instead of recomputed (engine/kv/kv_tier.py;
    docs/kv_offloading.md). 0: off."""
    kv_offloading_path: str | None = option(None, metavar="PATH")
    """Back the second tier by this file (mapped shared; scratch space, overwritten, never
    read back after a restart) instead of anonymous host memory. Needs kv_offloading_size.
    Created 0600; an existing file must be this user's with no group/other permissions."""
    enable_sleep_mode: bool = False
    """Allow `sleep(level)` / `wake_up()` (vLLM's): free the KV pool (level 1; weights stay, on
    the CPU) or also drop the weights (level 2)."""
    worker_extension_cls: str | None = option(None, metavar="MODULE:CLASS")
    """`module:Class` whose methods `collective_rpc` can call (vLLM's hook); built as
    Class(engine)."""
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT format) over the base model (engine/lora)."""
    max_loras: int = 1
    """Distinct adapters in one step (GPU-resident slots)."""
    max_lora_rank: int = 16
    """Largest adapter rank served."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded on the CPU (default: max_loras)."""
    lora_modules: tuple[LoRAModule, ...] = option((), type=str, metavar="NAME=PATH")
    """Adapters loaded at start, served as model NAME (vLLM's --lora-modules; `name=path`
    strings are accepted and parsed here)."""
    max_grammar_bytes: int = option(128 << 10, type=parse_size, metavar="BYTES")
    """Largest structured-output constraint (a JSON schema as JSON, a regex, a grammar, the
    choices, a structural tag) a request may bring; larger is refused before any compile
    (INVALID_ARGUMENT on a worker, naming the field). The router's flag of the same name
    refuses it first for requests that come through it."""
    grammar_compile_timeout_s: float = option(10.0, name="--grammar-compile-timeout")
    """A constraint that does not compile within this many seconds is refused (the compile
    runs in a child process, killed then; INVALID_ARGUMENT on a worker, naming the field). 0:
    compile in the request's thread without a limit (no child process; for offline use: a
    worker would give a thread to a pathological constraint for as long as it compiles)."""
    grammar_compile_processes: int = 1
    """Child processes compiling constraints, each one at a time; started on the first
    structured request that misses the compile cache."""
    grammar_compile_wait_s: float = option(10.0, name="--grammar-compile-wait")
    """The longest a compile waits for a free compile process (tenants, told apart by the
    request's cache_salt, take turns, one compile each); past it the request is refused as
    busy (RESOURCE_EXHAUSTED on a worker). A compile cache hit never waits."""
    max_grammar_repetitions: int = option(1000, metavar="N")
    """Largest product of nested counted-repetition bounds in a constraint's regexes and
    grammars (engine/structured/repetition.py); larger is refused before any compile
    (INVALID_ARGUMENT on a worker, naming the field). 0: no limit."""
    tensor_parallel_size: int = option(1, aliases=("-tp",), metavar="N")
    """Processes this engine's model is split across (vLLM's; docs/parallelism.md): rank 0
    is this process (scheduler, KV block manager, sampling, the worker's gRPC face), ranks
    1..N-1 are started and supervised by it and run each step's forward in lockstep over
    their attention heads, MLP rows and vocabulary slice, each with its heads' KV. Refused
    with it > 1: LoRA, KV offloading, sleep mode, a draft model (ngram speculation works),
    weight updates, a worker extension, --share-host-cores. Disaggregated KV transfer works
    between workers of any sizes (each rank writes / receives its heads, kvtransfer/heads.py)."""
    enable_expert_parallel: bool = False
    """MoE models: split whole experts across the tensor-parallel ranks instead of each
    expert's rows (vLLM's)."""
    distributed_timeout_s: float = option(60.0, name="--distributed-timeout", metavar="SECONDS")
    """With tensor_parallel_size > 1: the longest a collective (or the ranks' start) may
    wait; a rank that died or hangs fails the step, and the worker, within it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", tuple(map(LoRAModule.parse, self.lora_modules)))
        try:
            spec = SpeculativeConfig.parse(self.speculative_config)
        except FieldError as exc:  # a key of the JSON, not a field of this config
            raise FieldError("speculative_config", f"speculative_config: {exc}") from None
        object.__setattr__(self, "speculative_config", spec)
        object.__setattr__(
            self, "cuda_graph_sizes", tuple(self.cuda_graph_sizes)
        )  # a list from LLM(...)
        check_fields(
            self,
            [
                (
                    all(isinstance(s, int) and s >= 1 for s in self.cuda_graph_sizes),
                    "cuda_graph_sizes",
                    "must be integers >= 1",
                ),
                (
                    not (self.enforce_eager and self.cuda_graph_sizes),
                    "cuda_graph_sizes",
                    "needs CUDA graphs, which enforce_eager turns off: give one or the other",
                ),
                (
                    self.block_size in (8, 16, 32, 64, 128),
                    "block_size",
                    "must be 8, 16, 32, 64 or 128",
                ),
                (
                    self.kv_cache_memory is None or self.kv_cache_memory > 0,
                    "kv_cache_memory",
                    "must be > 0",
                ),
                (
                    0.0 < self.gpu_memory_utilization <= 1.0,
                    "gpu_memory_utilization",
                    "must be in (0, 1]",
                ),
                (self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1"),
                (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1"),
                (
                    self.long_prefill_token_threshold >= 0,
                    "long_prefill_token_threshold",
                    "must be >= 0",
                ),
                (
                    self.enable_chunked_prefill or not self.long_prefill_token_threshold,
                    "long_prefill_token_threshold",
                    "needs enable_chunked_prefill",
                ),
                (self.dtype in DTYPES, "dtype", "is not supported"),
                (self.device in DEVICES, "device", "must be cpu, cuda or auto"),
                (self.attention_backend in ATTENTION_BACKENDS, "attention_backend", "is unknown"),
                (
                    self.kv_cache_dtype in KV_CACHE_DTYPES,
                    "kv_cache_dtype",
                    f"must be one of {', '.join(KV_CACHE_DTYPES)}",
                ),
                (self.kv_offloading_size >= 0, "kv_offloading_size", "must be >= 0"),
                (
                    self.enable_prefix_caching or not self.kv_offloading_size,
                    "kv_offloading_size",
                    "needs enable_prefix_caching (the tier holds prefix-cache blocks)",
                ),
                (
                    self.kv_offloading_path is None or self.kv_offloading_size > 0,
                    "kv_offloading_path",
                    "needs kv_offloading_size > 0",
                ),
                (self.max_loras >= 1, "max_loras", "must be >= 1"),
                (1 <= self.max_lora_rank <= 512, "max_lora_rank", "must be in [1, 512]"),
                (
                    self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                    "max_cpu_loras",
                    "must be >= max_loras",
                ),
                (self.enable_lora or not self.lora_modules, "lora_modules", "needs enable_lora"),
                (self.max_grammar_bytes > 0, "max_grammar_bytes", "must be > 0"),
                (self.grammar_compile_timeout_s >= 0, "grammar_compile_timeout_s", "must be >= 0"),
                (self.grammar_compile_processes >= 1, "grammar_compile_processes", "must be >= 1"),
                (self.grammar_compile_wait_s > 0, "grammar_compile_wait_s", "must be > 0"),
                (self.max_grammar_repetitions >= 0, "max_grammar_repetitions", "must be >= 0"),
                (self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1"),
                (self.distributed_timeout_s > 0, "distributed_timeout_s", "must be > 0"),
            ],
        )
        if self.tensor_parallel_size > 1:
            check_fields(self, tensor_parallel_refusals(self))

    @property
    def parallel(self) -> bool:
        """Whether the model runs on a tensor-parallel group of processes."""
        return self.tensor_parallel_size > 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The config `add_engine_args`' flags describe."""
        return from_args(cls, args)


def tensor_parallel_refusals(config: EngineConfig) -> list[tuple[bool, str, str]]:
    """The features that do not run across tensor-parallel ranks yet, as check_fields rows:
    each is refused by name at start, never ignored (docs/parallelism.md)."""
    spec = config.speculative_config
    why = "is not supported with tensor_parallel_size > 1"
    return [
        (not config.enable_lora, "enable_lora", f"{why} (LoRA deltas are not sharded)"),
        (not config.lora_modules, "lora_modules", f"{why} (LoRA deltas are not sharded)"),
        (
            not config.kv_offloading_size,
            "kv_offloading_size",
            f"{why} (the second tier would hold rank 0's heads only)",
        ),
        (
            not config.enable_sleep_mode,
            "enable_sleep_mode",
            f"{why} (only rank 0's weights and KV would sleep)",
        ),
        (
            config.worker_extension_cls is None,
            "worker_extension_cls",
            f"{why} (collective_rpc would run it on rank 0 only, over rank 0's shard)",
        ),
        (
            spec is None or spec.method != "draft_model",
            "speculative_config",
            f"{why} with a draft model (it runs outside the ranks' lockstep); ngram works",
        ),
        (
            not config.cuda_graph_sizes,
            "cuda_graph_sizes",
            f"{why} (decode steps run eagerly there)",
        ),
        (
            config.device != "cuda" or config.kv_cache_memory is not None,
            "kv_cache_memory",
            "must be given with tensor_parallel_size > 1 on CUDA (no profiling forward across "
            "ranks yet)",
        ),
    ]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """EngineConfig's flags (vLLM's names where the concept is the same), in group "engine"."""
    add_flags(parser, EngineConfig, group="engine")


ALLOW_LONG_MAX_MODEL_LEN = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
"""vLLM's environment switch for a `max_model_len` beyond the model's trained length."""


def resolve_max_model_len(requested: int | None, model_max: int) -> int:
    """The context length served: `requested`, or the model's `max_position_embeddings`.

    A request beyond the model's length is refused by name, as vLLM does, unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (then served with a warning: positions past training may
    give garbage — useful for speed tests of long prompts)."""
    if requested is None:
        return model_max
    if requested > model_max:
        if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN) != "1":
            raise FieldError(
                "max_model_len",
                f"max_model_len {requested} exceeds the model's max_position_embeddings "
                f"{model_max}; set {ALLOW_LONG_MAX_MODEL_LEN}=1 to serve it anyway",
            )
        log.warning(
            "max_model_len %d exceeds the model's max_position_embeddings %d (%s=1)",
            requested,
            model_max,
            ALLOW_LONG_MAX_MODEL_LEN,
        )
    return requested
