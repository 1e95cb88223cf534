"""Request specs: what each benchmark request asks for. Seeded, so a run is reproducible.

Prompts are random common English words separated by spaces. Most such words are one token
(with or without the leading space) in BPE vocabularies, so n words are about n tokens. With a
tokenizer, only the words that are exactly one token both ways are kept, and a prompt of n words
is exactly n tokens (pre-tokenizers split on spaces, so words never merge)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdserve.bench.config import WorkloadConfig

_WORDS = """
the of and to in is was for on are as with his they at be this from have or by one had not
but what all were when we there can an your which their said if do will each about how up
out them then she many some so these would other into has more her two like him see time
could no make than first been its who now people my made over did down only way find use may
water long little very after words called just where most know get through back much before
go good new write our used me man too any day same right look think also around another came
come work three word must because does part even place well such here take why things help
put years different away again off went old number great tell men say small every found still
between name should home big give air line set own under read last never us left end along
while might next sound below saw something thought both few those always looked show large
often together asked house world going want school important until form food keep children
feet land side without boy once animals life enough took sometimes four head above kind began
almost live page got earth need far hand high year mother light parts country father let
night following picture being study second eyes soon times story boys since white days ever
paper hard near sentence better best across during today others however sure means knew try
told young miles sun ways thing whole hear example heard several change answer room sea
against top turned learn point city play toward five using himself usually money seen car
""".split()


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    """Position in the run (also the order of arrival)."""
    prompt: str
    """Completions: the text after the prefix; chat: the user message."""
    max_tokens: int
    prompt_len: int
    """Intended prompt tokens, prefix included (exact with a tokenizer, approximate without;
    chat templates add their own tokens on top)."""
    prefix: str | None = None
    """shared-prefix: the tenant's system prompt (chat: the system message)."""
    tenant: int | None = None

    def completion_prompt(self) -> str:
        return f"{self.prefix} {self.prompt}" if self.prefix else self.prompt

    def chat_messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.prefix}] if self.prefix else []
        return [*system, {"role": "user", "content": self.prompt}]


@dataclass(frozen=True)
class WordSource:
    words: tuple[str, ...]
    exact: bool
    """True when every word is exactly one token of the tokenizer it was filtered with."""

    def text(self, rng: random.Random, n: int) -> str:
        return " ".join(rng.choices(self.words, k=n))


def word_source(tokenizer: str | None) -> WordSource:
    """The common words; with a tokenizer ("default" or a model directory), only those that
    encode to a single token both at the start of a text and after a space."""
    if tokenizer is None:
        return WordSource(tuple(_WORDS), exact=False)
    from engine.models.prepare import resolve_model_path
    from engine.processing.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model_path(tokenizer))
    words = tuple(w for w in _WORDS if len(tok.encode(w)) == 1 and len(tok.encode(" " + w)) == 1)
    if len(words) < 16:
        raise ValueError(
            f"tokenizer {tokenizer!r}: only {len(words)} single-token words; "
            "run without --tokenizer (approximate lengths)"
        )
    return WordSource(words, exact=True)


def build_workload(cfg: WorkloadConfig, words: WordSource | None = None) -> list[RequestSpec]:
    """cfg.num_requests specs. Same config and seed -> same specs."""
    words = words or word_source(cfg.tokenizer)
    rng = random.Random(cfg.seed)

    def draw(span: tuple[int, int]) -> int:
        return rng.randint(*span)

    if cfg.dataset == "random":
        specs = []
        for i in range(cfg.num_requests):
            n = draw(cfg.input_len)
            specs.append(RequestSpec(i, words.text(rng, n), draw(cfg.output_len), n))
        return specs
    # shared-prefix: independent random text per tenant, so tenants share no prefix beyond
    # (almost surely) their first few words.
    prefixes = [words.text(rng, cfg.prefix_len) for _ in range(cfg.num_tenants)]
    specs = []
    for i in range(cfg.num_requests):
        t = rng.randrange(cfg.num_tenants)
        n = draw(cfg.input_len)
        specs.append(
            RequestSpec(
                i,
                words.text(rng, n),
                draw(cfg.output_len),
                cfg.prefix_len + n,
                prefix=prefixes[t],
                tenant=t,
            )
        )
    return specs
