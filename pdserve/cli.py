"""The `pdserve` command. Each subcommand imports only what it needs, so `pdserve generate`
never loads gRPC or etcd and the worker commands never load the HTTP stack."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Sequence


def _prepare_model(args: argparse.Namespace) -> int:
    from engine.models.prepare import bundled_gguf_path, bundled_model, cache_dir, prepare_model

    source = Path(args.gguf) if args.gguf else bundled_gguf_path(args.model)
    out = Path(args.out) if args.out else cache_dir() / bundled_model(args.model).name
    print(prepare_model(source, out))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, EngineConfig, SamplingParams

    llm = LLM(config=EngineConfig.from_args(args))
    tok = llm.tokenizer
    prompts = [
        tok.encode_chat([{"role": "user", "content": p}]) if args.chat else p for p in args.prompt
    ]
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        n=args.n,
    )
    for out in llm.generate(prompts, params, use_tqdm=len(prompts) > 1):
        for completion in out.outputs:
            print(completion.text)
    return 0


class _NoAbbrevParser(argparse.ArgumentParser):
    """A subcommand's parser: no abbreviated flags either."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from engine.config import add_engine_args

    # No abbreviated flags (as vLLM's parser): `--cluster-token S` must not pass for
    # --cluster-token-file, nor `--etcd-password P` for --etcd-password-file (a secret taken
    # as a path would also be printed in the error).
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving.", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_NoAbbrevParser)

    from engine.models.prepare import BUNDLED_MODELS, DEFAULT_MODEL

    p = sub.add_parser(
        "prepare-model",
        help="dequantize a GGUF (default: the bundled SmolLM2-135M-Instruct) into an HF directory",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        choices=sorted(BUNDLED_MODELS),
        help="which bundled model to prepare (default: %(default)s, SmolLM2)",
    )
    p.add_argument("--gguf", help="GGUF file to convert instead of a bundled model")
    p.add_argument("--out", help="output directory (default: $PDSERVE_CACHE/models/<name>)")
    p.set_defaults(func=_prepare_model)

    p = sub.add_parser(
        "generate", help="offline generation with the paged engine; completions to stdout"
    )
    p.add_argument(
        "--prompt", required=True, action="append", help="prompt text (repeat for a batch)"
    )
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--sampling-seed", type=int, default=None, help="seed for sampling")
    add_engine_args(p)
    p.set_defaults(func=_generate)

    from pdserve.worker_main import register as register_workers

    register_workers(sub)
    __import__("pdserve.role_cli").role_cli.register(sub)
    __import__("pdserve.etcd_users_cli").etcd_users_cli.register(sub)
    __import__("local_cluster.cli").cli.register(sub)
    __import__("router.cli").cli.register(sub)
    __import__("pdserve.bench.cli").bench.cli.register(sub)
    __import__("pdserve.chaos.cli").chaos.cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
