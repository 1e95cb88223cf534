"""A `tokenizers` tokenizer.json from a GGUF vocabulary, equal (same ids) to the one transformers
builds from the same file (`integrations/gguf/gguf_tokenizer_mapping.py`), with one deliberate
difference: `tokenizer.ggml.pre = "smollm"`, which transformers does not know, gets llama.cpp's
split (each digit alone, then GPT-2's) instead of GPT-2's alone.

- `tokenizer.ggml.model = "gpt2"`: byte-level BPE from the file's merges, split per
  `tokenizer.ggml.pre` (qwen2, llama3, ... else GPT-2's regex).
- `"llama"` for a Gemma architecture: Gemma's SentencePiece-style BPE (byte fallback, spaces as
  `▁`); the file has no merges, so they are rebuilt from the vocabulary, best first in file
  order, as transformers does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from engine.models.errors import ModelFileError

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the regex its merges were learned with (transformers' table).
_PRE_SPLITS = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
}
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table of byte-level vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_BYTE_CHARS = frozenset(_BYTE_TO_CHAR.values())


def tokenizer_json(
    arch: str,
    model: str,
    pre: str,
    tokens: Sequence[str],
    token_types: Sequence[int],
    merges: Sequence[str] | None,
    unk_token: str,
) -> str:
    """The tokenizer.json of a GGUF tokenizer (`tokenizer.ggml.*` fields)."""
    if model == "gpt2":
        if merges is None:
            raise ModelFileError("GGUF byte-level tokenizer without tokenizer.ggml.merges")
        tok, known = _byte_level(tokens, merges, pre)
    elif model == "llama" and arch in _GEMMA_ARCHS:
        tok, known = _gemma(tokens, unk_token)
    else:
        raise ModelFileError(
            f"GGUF tokenizer {model!r} for architecture {arch!r} is not supported "
            "(byte-level 'gpt2', or Gemma's SentencePiece 'llama')"
        )
    _add_special_tokens(tok, tokens, token_types, known, byte_level=model == "gpt2")
    return tok.to_str()


def _byte_level(tokens: Sequence[str], merges: Sequence[str], pre: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    # A token outside the byte alphabet (raw text in some files) is respelled into it.
    vocab = {
        t if set(t) <= _BYTE_CHARS else "".join(_BYTE_TO_CHAR[b] for b in t.encode()): i
        for i, t in enumerate(tokens)
    }
    pairs = cast("list[tuple[str, str]]", [tuple(m.split(" ", 1)) for m in merges])  # "a b"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    if pre == "smollm":  # llama.cpp: every digit on its own, then GPT-2's byte-level split
        splits = [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    elif pre in _PRE_SPLITS:
        splits = [
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    else:  # "default", "gpt2" and the rest: GPT-2's regex, as transformers
        splits = [
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    # The binding takes no options (it ignored the ones given): add_prefix_space, trim_offsets
    # and use_regex are all true, as transformers writes them.
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, set(vocab)


def _gemma(tokens: Sequence[str], unk_token: str):
    """transformers' GemmaTokenizer over the file's vocabulary. A token of two or more spaces
    is stored as real spaces and looked up as `▁▁…`, so those are respelled first."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: i for i, token in enumerate(spelled)}
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_from_vocab(spelled, vocab),
            fuse_unk=True,
            unk_token=unk_token,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok, set(vocab)


def _merges_from_vocab(tokens: Sequence[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of every token into two vocabulary tokens, best first: a merge ranks as
    the token it makes, by that token's place in the file (Gemma's scores do not follow its
    merge order; the file order does), then by the lengths of its parts (transformers'
    `generate_merges` with scores `-index`)."""
    ranked: list[tuple[int, int, int, str, str]] = []
    for index, token in enumerate(tokens):
        if vocab.get(token) != index:
            continue  # a duplicate spelling: transformers keeps its last position
        local = [
            (token[:k], token[k:])
            for k in range(1, len(token))
            if token[:k] in vocab and token[k:] in vocab
        ]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((index, len(left), len(right), left, right) for left, right in local)
    # generate_merges sorts (score, len_l, len_r) descending with score -index; the sort is
    # stable, so ties keep the per-token order above.
    ranked.sort(key=lambda m: (m[0], -m[1], -m[2]))
    return [(left, right) for _, _, _, left, right in ranked]


def _add_special_tokens(
    tok, tokens: Sequence[str], token_types: Sequence[int], known: set[str], byte_level: bool
) -> None:
    """Control tokens (e.g. `<|im_end|>`) as special tokens; user-defined ones (e.g.
    `<think>`) as plain added tokens, matched whole — as llama.cpp and transformers. In a
    byte-level vocabulary a control token outside the byte alphabet is a llama.cpp mislabel
    and is left out (transformers does the same)."""
    from tokenizers import AddedToken

    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, token_types)
            if kind == TOKEN_TYPE_CONTROL and (not byte_level or set(t) <= _BYTE_CHARS)
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, token_types)
            if kind == TOKEN_TYPE_USER_DEFINED and t in known
        ]
    )
