"""Our tokenizer (built from the GGUF vocab at preparation time) against transformers' own
GGUF tokenizer conversion, and our chat-template rendering against apply_chat_template.

transformers' GGUF conversion ignores the file's `tokenizer.ggml.pre = "smollm"` and uses the
plain GPT-2 split; llama.cpp (which defines that field) splits every digit off first. The
reference gets the model's pre-tokenizer, and a separate test checks our split against
llama.cpp's two regexes run with the `regex` module."""

import random

import pytest
import regex
from tokenizers import pre_tokenizers

from engine.processing.tokenizer import ChatTemplateError, Tokenizer

_PIECES = [
    "Hello",
    " world",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "   \t ",
    "12345",
    "3.14159",
    "1,000,000",
    "def f(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) { a[i] += 1; }",
    "héllo",
    "wörld",
    "naïve café",
    "日本語のテキスト",
    "中文",
    "한국어",
    "Привет мир",
    "مرحبا",
    "🎉",
    "👩‍💻",
    "emoji🙂mixed",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<file_sep>",
    "don't",
    "I'll",
    "we've",
    "CamelCaseIdentifier",
    "snake_case_name",
    "URL: https://x.y/z?q=1",
    "  leading spaces",
    "trailing spaces   ",
    "\r\n",
    "ALL CAPS TEXT",
    "$$\\frac{a}{b}$$",
    "<html><body>hi</body></html>",
    '{"json": [1, 2, 3]}',
    "a" * 40,
    "…",
    "—",
    "½",
]


def _corpus(n: int = 300) -> list[str]:
    rng = random.Random(1234)
    out = list(_PIECES)
    while len(out) < n:
        out.append("".join(rng.choice(_PIECES) for _ in range(rng.randint(2, 8))))
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def test_ids_equal_transformers_gguf_tokenizer(tokenizer, hf_gguf_tokenizer):
    ref = hf_gguf_tokenizer.backend_tokenizer
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), ref.pre_tokenizer]
    )
    mismatches = [
        s for s in _corpus() if tokenizer.encode(s) != ref.encode(s, add_special_tokens=False).ids
    ]
    assert not mismatches, (
        f"{len(mismatches)} strings tokenize differently, e.g. {mismatches[:3]!r}"
    )


_LLAMA_CPP_SMOLLM_SPLITS = [
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
]


def _llama_cpp_pieces(text: str) -> list[str]:
    """Each regex splits the previous pieces; unmatched text stays a piece of its own."""
    pieces = [text]
    for pattern in _LLAMA_CPP_SMOLLM_SPLITS:
        out = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(pattern, piece):
                if m.start() > pos:
                    out.append(piece[pos : m.start()])
                out.append(m.group())
                pos = m.end()
            if pos < len(piece):
                out.append(piece[pos:])
        pieces = out
    return pieces


def test_pre_tokenization_matches_llama_cpp_rule(tokenizer):
    # BPE never merges across pieces, so encoding piece by piece must give the same ids.
    for s in (c for c in _corpus() if "<" not in c):
        by_piece = [i for p in _llama_cpp_pieces(s) for i in tokenizer.encode(p)]
        assert tokenizer.encode(s) == by_piece, repr(s)


def test_decode_inverts_encode(tokenizer):
    for s in _corpus():
        assert tokenizer.decode(tokenizer.encode(s)) == s


def test_special_tokens_are_single_ids(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokenizer.token_id("<|im_start|>") and ids[-1] == tokenizer.token_id(
        "<|im_end|>"
    )
    assert tokenizer.is_special(ids[0]) and not tokenizer.is_special(ids[1])
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tokenizer.eos_token_id in tokenizer.stop_token_ids


_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Write a haiku about 日本."},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second\n\nwith  spaces"},
        {"role": "user", "content": "<code>x = 1</code>"},
    ],
]


@pytest.mark.parametrize("messages", _CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_apply_chat_template(
    tokenizer, hf_gguf_tokenizer, messages, add_generation_prompt
):
    ours = tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == ref
    assert tokenizer.encode_chat(messages, add_generation_prompt) == hf_gguf_tokenizer.encode(
        ref, add_special_tokens=False
    )


def test_chat_template_default_system_prompt(tokenizer):
    text = tokenizer.render_chat([{"role": "user", "content": "x"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_chat_template_errors_are_clear(tokenizer):
    with pytest.raises(ChatTemplateError):
        tokenizer.render_chat([{"content": "no role"}])
