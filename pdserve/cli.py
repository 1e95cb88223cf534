"""The `pdserve` command. Each subcommand imports only what it needs, so `pdserve generate`
never loads gRPC or etcd and the worker commands never load the HTTP stack."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence


def _prepare_model(args: argparse.Namespace) -> int:
    from engine.models.prepare import DEFAULT_MODEL_NAME, bundled_gguf_path, cache_dir, prepare_model

    source = Path(args.gguf) if args.gguf else bundled_gguf_path()
    out = Path(args.out) if args.out else cache_dir() / DEFAULT_MODEL_NAME
    print(prepare_model(source, out))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine.greedy import greedy_generate
    from engine.models.loader import load_model

    loaded = load_model(args.model)
    tok = loaded.tokenizer
    if args.chat:
        ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        ids = tok.encode(args.prompt, add_special_tokens=True)
    out = greedy_generate(loaded, ids, args.max_tokens)
    print(tok.decode(out, skip_special_tokens=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "prepare-model",
        help="dequantize a GGUF (default: the bundled SmolLM2-135M-Instruct) into an HF directory",
    )
    p.add_argument("--gguf", help="GGUF file to convert (default: the bundled model)")
    p.add_argument("--out", help="output directory (default: $PDSERVE_CACHE/models/<name>)")
    p.set_defaults(func=_prepare_model)

    p = sub.add_parser("generate", help="offline generation for one prompt, printed to stdout")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument(
        "--model", default="default",
        help="HF-format LLaMA directory or GGUF file (default: bundled SmolLM2-135M-Instruct)",
    )
    p.set_defaults(func=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
