"""Incremental detokenizing: engine/processing/detokenizer.py (over `tokenizers`' DecodeStream)
against re-decoding a window of recent tokens per token (what it did before), on the bundled
model's tokenizer, in the same run. Prints microseconds per token and the ratio; both texts must be
equal, and the tokenizer's full decode (which may add a final incomplete character).

    python benchmarks/detok_bench.py [--tokens 4000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import time

from engine.models.prepare import resolve_model_path
from engine.processing.detokenizer import IncrementalDetokenizer
from engine.processing.tokenizer import Tokenizer

_TEXT = (
    "The quick brown fox jumps over the lazy dog, then writes `def f(x): return x`. "
    "日本語のテキスト、絵文字 🎉🚀 and naïve café. "
)


def _window_redecode(tok: Tokenizer, ids: list[int], skip: bool) -> str:
    """The baseline: decode ids[prefix:] and ids[prefix:read] for every token."""
    text, seen, prefix, read = "", [], 0, 0
    for token_id in ids:
        seen.append(token_id)
        prefix_text = tok.decode(seen[prefix:read], skip)
        new_text = tok.decode(seen[prefix:], skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            text += new_text[len(prefix_text) :]
            prefix, read = read, len(seen)
    return text


def _detokenizer(tok: Tokenizer, ids: list[int], skip: bool) -> str:
    detok = IncrementalDetokenizer(tok, skip, ())
    for token_id in ids:
        detok.append(token_id)
    return detok.text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    tok = Tokenizer.from_dir(resolve_model_path("default"))
    text_ids = tok.encode(_TEXT * (args.tokens // 30 + 1))[: args.tokens]
    rng = random.Random(0)
    random_ids = [rng.randrange(tok.vocab_size) for _ in range(args.tokens)]
    print("| ids | skip special | re-decode window us/tok | DecodeStream us/tok | ratio |")
    print("|---|---|---|---|---|")
    for name, ids in (("text", text_ids), ("random", random_ids)):
        for skip in (True, False):
            times, texts = {}, {}
            for label, fn in (("window", _window_redecode), ("stream", _detokenizer)):
                best = float("inf")
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    texts[label] = fn(tok, ids, skip)
                    best = min(best, time.perf_counter() - t0)
                times[label] = best * 1e6 / len(ids)
            full = tok.decode(ids, skip)
            assert texts["window"] == texts["stream"] and full.startswith(texts["stream"]), name
            print(
                f"| {name} | {skip} | {times['window']:.1f} | {times['stream']:.1f} | "
                f"{times['window'] / times['stream']:.1f}x |"
            )


if __name__ == "__main__":
    main()
