"""Offline greedy throughput per architecture: `engine.LLM` against transformers' `generate`
on the same random checkpoint. Prints ratios measured in one run; asserts nothing.

    python benchmarks/arch_throughput.py                       # all 8 archs, fp32 (+ bf16), ~3 min
    python benchmarks/arch_throughput.py --archs gemma3,mixtral --dtypes float32 --hidden 512

Each architecture gets a "tiny but not trivial" checkpoint built once into a temp dir with
transformers' own class (tests/models/test_arch_parity.py's approach at a larger size): the
bundled tokenizer's vocabulary (49,152), --hidden / --layers / --heads / --kv-heads, sliding
window --window where the architecture has one (mistral: every layer; gemma2: alternate
layers; gemma3: every --global-every'th layer global, the rest sliding), MoE --experts with
top-k 2 (qwen3-moe: every layer sparse). Both sides load that directory in the same dtype.

Workload: --num-prompts random-id prompts of 7/8 * --prompt-len .. --prompt-len tokens,
--output-len greedy tokens each, ignore_eos (min = max new tokens on the HF side). The HF
side runs the prompts as ONE left-padded static batch (with its attention mask), as
engine_bench does. Output tok/s = generated tokens / wall time of the whole call (prefill
included), best of --reps, the two sides interleaved rep by rep, after a warm-up call each.
"match" counts prompts whose greedy tokens are identical on both sides (a sanity check: on
random weights near-ties can flip a token, so fewer than all is not by itself a bug).
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.models.prepare import resolve_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Size:
    """Checkpoint shape shared by every architecture (parsed once from the CLI)."""

    vocab: int
    hidden: int
    intermediate: int
    """Dense MLP width; each expert's is moe_intermediate."""
    layers: int
    heads: int
    kv_heads: int
    window: int
    """Sliding window (tokens) of the layers that slide."""
    global_every: int
    """gemma3: every n-th layer is global, the others slide."""
    experts: int
    top_k: int
    moe_intermediate: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def common(self) -> dict:
        return dict(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )


def _llama(s: Size):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**s.common(), tie_word_embeddings=True))


def _qwen3(s: Size):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(
        Qwen3Config(**s.common(), head_dim=s.head_dim, tie_word_embeddings=True)
    )


def _mistral(s: Size):
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(
        MistralConfig(**s.common(), sliding_window=s.window, tie_word_embeddings=False)
    )


def _gemma2(s: Size):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(
        Gemma2Config(
            **s.common(),
            head_dim=s.head_dim,
            query_pre_attn_scalar=s.head_dim,
            sliding_window=s.window,
        )
    )


def _gemma3(s: Size):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    }
    types = [
        "full_attention" if (i + 1) % s.global_every == 0 else "sliding_attention"
        for i in range(s.layers)
    ]
    return Gemma3ForCausalLM(
        Gemma3TextConfig(
            **s.common(),
            head_dim=s.head_dim,
            query_pre_attn_scalar=s.head_dim,
            sliding_window=s.window,
            rope_parameters=rope,
            layer_types=types,
        )
    )


def _phi3(s: Size):
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(**s.common(), tie_word_embeddings=False))


def _mixtral(s: Size):
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            **{**s.common(), "intermediate_size": s.moe_intermediate},
            num_local_experts=s.experts,
            num_experts_per_tok=s.top_k,
            tie_word_embeddings=False,
        )
    )


def _qwen3_moe(s: Size):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            **s.common(),
            head_dim=s.head_dim,
            num_experts=s.experts,
            num_experts_per_tok=s.top_k,
            moe_intermediate_size=s.moe_intermediate,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        )
    )


ARCHS = {
    "llama": _llama,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "mixtral": _mixtral,
    "qwen3-moe": _qwen3_moe,
}


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16: where bf16 matmuls are native on this CPU."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def build_checkpoint(arch: str, size: Size, out: Path) -> Path:
    """transformers' class at `size` with its own random init, saved with the bundled tokenizer."""
    torch.manual_seed(0)
    ARCHS[arch](size).save_pretrained(out, safe_serialization=True)
    tokenizer_dir = resolve_model_path("default")
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out / name)
    return out


def make_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(100, 49000) for _ in range(rng.randint(length * 7 // 8, length))]
        for _ in range(n)
    ]


def run_ours(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    """(seconds, generated token ids per prompt) of one LLM.generate call."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def run_hf(
    hf, prompts: list[list[int]], output_len: int, pad: int = 0
) -> tuple[float, list[list[int]]]:
    """(seconds, generated token ids per prompt) of one left-padded static-batch generate."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    out = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        pad_token_id=pad,
    )
    return time.perf_counter() - t0, out[:, width:].tolist()


def bench_arch(arch: str, model_dir: Path, dtype: str, args) -> dict:
    from transformers import AutoModelForCausalLM

    prompts = make_prompts(args.num_prompts, args.prompt_len)
    generated = len(prompts) * args.output_len
    llm = LLM(
        str(model_dir), dtype=dtype, kv_cache_memory=256 << 20, max_num_seqs=max(8, len(prompts))
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    run_ours(llm, prompts[:1], 4)  # warm-up: first-call allocations, kernel selection
    run_hf(hf, prompts[:1], 4)
    ours_s = hf_s = float("inf")
    for _ in range(args.reps):
        seconds, ours_tokens = run_ours(llm, prompts, args.output_len)
        ours_s = min(ours_s, seconds)
        seconds, hf_tokens = run_hf(hf, prompts, args.output_len)
        hf_s = min(hf_s, seconds)
    match = sum(a == b for a, b in zip(ours_tokens, hf_tokens))
    return {
        "ours": generated / ours_s,
        "hf": generated / hf_s,
        "match": match,
        "attn": hf.config._attn_implementation,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--archs", default=",".join(ARCHS), help=f"comma-separated, of {', '.join(ARCHS)}"
    )
    parser.add_argument(
        "--dtypes",
        default="auto",
        help="comma-separated; auto = float32, and bfloat16 if the CPU has AVX512-BF16/AMX",
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument(
        "--global-every", type=int, default=4, help="gemma3: every n-th layer global"
    )
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--moe-intermediate", type=int, default=768)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = (
        (["float32", "bfloat16"] if cpu_has_bf16() else ["float32"])
        if args.dtypes == "auto"
        else args.dtypes.split(",")
    )
    size = Size(
        vocab=49152,
        hidden=args.hidden,
        intermediate=args.intermediate,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        window=args.window,
        global_every=args.global_every,
        experts=args.experts,
        top_k=args.top_k,
        moe_intermediate=args.moe_intermediate,
    )
    import transformers

    transformers.utils.logging.disable_progress_bar()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} "
        f"thread(s), AVX512-BF16/AMX: {cpu_has_bf16()}"
    )
    print(
        f"{size}\n{args.num_prompts} prompts of {args.prompt_len * 7 // 8}-{args.prompt_len} "
        "tokens -> "
        f"{args.output_len} greedy tokens, ignore_eos; HF: one left-padded static batch; best of "
        f"{args.reps}"
    )
    print(
        f"\n{'arch':10} {'dtype':9} {'ours tok/s':>10} {'HF tok/s':>9} {'ratio':>6} {'match':>6}  "
        "HF attention"
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="arch-bench-") as tmp:
        for arch in args.archs.split(","):
            model_dir = build_checkpoint(arch, size, Path(tmp) / arch)
            for dtype in dtypes:
                r = bench_arch(arch, model_dir, dtype, args)
                print(
                    f"{arch:10} {dtype:9} {r['ours']:10.1f} {r['hf']:9.1f} "
                    f"{r['ours'] / r['hf']:5.2f}x "
                    f"{r['match']:>3}/{args.num_prompts:<2}  {r['attn']}",
                    flush=True,
                )
    print(f"\n{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
