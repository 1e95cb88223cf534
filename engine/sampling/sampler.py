"""Turns logits into tokens: request masks (engine.sampling.logits_masks), penalties, temperature,
top-k, top-p, min-p, seeded draws, logprobs (from the raw logits, before any of these, as
vLLM's default `raw_logprobs`). Rows are independent of each other, so a request samples
the same token whatever else is in the batch.

Randomness for a row is a counter-based hash of (request seed, completion index, output
position) (`row_uniforms`, vectorized over the batch): a prefill worker sampling the first
token and a decode worker sampling the rest draw exactly what a single engine would.

The hot path is batched: no per-row generators or kernels, one host transfer of the tokens
per step; penalties come from incrementally maintained counts (engine/sampling/penalties.py), the
one per-request state a `Sampler` keeps (by request id; the model runner tells it which requests
left)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from engine import cpu_kernels
from engine.processing.tokens import SampledToken
from engine.sampling.logits_masks import apply_masks
from engine.sampling.penalties import Penalties
from engine.sampling.sample_row import SampleRow

_MASK = 0xFFFF_FFFF_FFFF_FFFF


def draw_seed(seed: int, completion_index: int, position: int) -> int:
    """splitmix64 over the three numbers: a well-spread 63-bit seed for one row's draws."""
    x = (seed * 0x9E3779B97F4A7C15 + completion_index * 0xBF58476D1CE4E5B9 + position) & _MASK
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mult) & _MASK
    return (x ^ (x >> 31)) & 0x7FFF_FFFF_FFFF_FFFF


def _filter(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature (in place), then top-k / top-p / min-p masks (to -inf) where a row asks
    for them; rows without them cost one in-place division."""
    params = [r.request.sampling for r in rows]
    column = lambda values: torch.tensor(values, dtype=logits.dtype, device=logits.device)[:, None]  # noqa: E731
    if any(p.temperature != 1.0 for p in params):
        logits.div_(column([p.temperature for p in params]))
    if any(p.top_k for p in params):
        # By rank, not by value: exactly k tokens survive even when logits tie.
        vocab = logits.shape[-1]
        ks = torch.tensor([p.top_k or vocab for p in params], device=logits.device)
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        logits = logits.scatter(
            1, order, sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
        )
    if any(p.top_p < 1.0 for p in params):
        top_p = column([p.top_p for p in params])
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if any(p.min_p > 0.0 for p in params):
        min_p = column([p.min_p for p in params])
        probs = logits.softmax(-1)
        logits = logits.masked_fill(
            probs < min_p * probs.max(-1, keepdim=True).values, float("-inf")
        )
    return logits


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def draw_keys(rows: list[SampleRow]) -> torch.Tensor:
    """int64 [rows, 3]: what `draw_seed` takes for each row — its seed mod 2^64 (as the int64
    of the same bits), completion index, output position — for the kernels' `first_uniforms`."""
    keys: list[int] = []
    for r in rows:
        keys += (r.request.seed & _MASK, r.completion_index, r.num_output_tokens)
    return torch.from_numpy(np.array(keys, dtype=np.uint64).view(np.int64)).view(len(rows), 3)


def row_uniforms(rows: list[SampleRow], count: int = 1) -> np.ndarray:
    """[len(rows), count] float64 uniforms in [0, 1): row i's stream at its
    (seed, completion index, output position), vectorized over the batch. Uniform k of a
    row is splitmix64(draw_seed + k * golden gamma) scaled from its top 53 bits, so every
    worker draws the same numbers for the same row."""
    seeds = np.fromiter(
        (draw_seed(r.request.seed, r.completion_index, r.num_output_tokens) for r in rows),
        dtype=np.uint64,
        count=len(rows),
    )
    gamma = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        steps = (np.arange(1, count + 1, dtype=np.uint64) * gamma)[None, :]
        bits = _splitmix64(seeds[:, None] + steps)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


# Draws and argmaxes look at the vocabulary in chunks of this many tokens: a pass over the
# chunk totals, then one chunk per row (no [rows, vocab] cumsum or argmax kernel).
_CHUNK = 256


def _chunk_view(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [rows, vocab] as ([rows, full chunks, _CHUNK] view, [rows, rest] or None)."""
    rows, vocab = x.shape
    full = vocab // _CHUNK * _CHUNK
    body = x[:, :full].reshape(rows, vocab // _CHUNK, _CHUNK)
    return body, (x[:, full:] if full < vocab else None)


def _chunk_of(
    x: torch.Tensor, chunk: torch.Tensor, fill: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(columns [rows, _CHUNK], values [rows, _CHUNK]) of chunk index `chunk` ([rows, 1]) of
    each row; columns past the vocabulary hold `fill`."""
    vocab = x.shape[-1]
    cols = chunk * _CHUNK + torch.arange(_CHUNK, device=x.device)[None, :]
    values = x.gather(1, cols.clamp(max=vocab - 1)).masked_fill(cols >= vocab, fill)
    return cols, values


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for [rows, vocab] (the first index of the maximum): on the CPU with the
    kernels one pass in C++, else via the chunks' maxima (torch's CPU argmax is ~10x slower
    than its max over a large row)."""
    if cpu_kernels.reads_logits(x):
        return cpu_kernels.argmax_rows(x)
    body, rest = _chunk_view(x)
    maxima = body.amax(-1)
    if rest is not None:
        maxima = torch.cat([maxima, rest.amax(-1, keepdim=True)], 1)
    chunk = maxima.argmax(-1, keepdim=True)  # the first chunk holding the maximum
    cols, values = _chunk_of(x, chunk, float("-inf"))
    return cols.gather(1, values.argmax(-1, keepdim=True)).squeeze(1)


def chunk_totals(probs: torch.Tensor) -> torch.Tensor:
    """The sums of each _CHUNK columns of `probs` [rows, vocab]: [rows, ceil(vocab / _CHUNK)]."""
    body, rest = _chunk_view(probs)
    totals = body.sum(-1)
    return totals if rest is None else torch.cat([totals, rest.sum(-1, keepdim=True)], 1)


def inverse_cdf(
    probs: torch.Tensor, uniforms: torch.Tensor, totals: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row of `probs` ([rows, vocab], unnormalized is fine) for `uniforms`
    ([rows, 1] in [0, 1)): the first index whose cdf exceeds u * total, always one with
    p > 0. The cdf is taken over chunk totals (`totals`, else `chunk_totals(probs)`), then
    inside the one chunk it lands in."""
    if totals is None:
        totals = chunk_totals(probs)
    cdf = totals.cumsum(-1)
    target = uniforms.to(probs.dtype) * cdf[:, -1:]
    index = torch.arange(cdf.shape[1], device=probs.device)[None, :]
    last_chunk = torch.where(totals > 0, index, 0).amax(-1, keepdim=True)
    chunk = torch.searchsorted(cdf, target, right=True).minimum(
        last_chunk
    )  # rounding: u * total >= total
    before = torch.where(chunk > 0, cdf.gather(1, (chunk - 1).clamp(min=0)), 0)
    cols, values = _chunk_of(probs, chunk, 0.0)
    inside = torch.searchsorted(values.cumsum(-1), target - before, right=True)
    last_inside = torch.where(values > 0, torch.arange(_CHUNK, device=probs.device)[None, :], 0)
    inside = inside.minimum(last_inside.amax(-1, keepdim=True))
    return cols.gather(1, inside).squeeze(1)


def softmax_(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim, written over `x` on CPU (bit-identical: the kernel reads
    each element before it writes it; a test holds it to that): a fresh [rows, vocab]
    output costs more in page faults than the softmax itself."""
    if x.device.type != "cpu":
        return x.softmax(-1)
    return torch.ops.aten._softmax.out(x, -1, False, out=x)


def draw(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of softmax(`logits`) ([rows, vocab] fp32, may be overwritten) for
    `uniforms` ([rows, 1] in [0, 1)): `inverse_cdf` over the softmax written over the logits;
    on the CPU with the kernels, one C++ op that reads the logits and writes nothing
    (`sample_rows`: the same draw over the unnormalized numerators `exp_chunk_totals_`
    computes — the draw scales its uniform by the row's total)."""
    if cpu_kernels.reads_logits(logits):
        return cpu_kernels.sample_rows(logits, _row_values(uniforms), None, _CHUNK)
    probs = softmax_(logits)
    return inverse_cdf(probs, uniforms.to(probs.device), chunk_totals(probs))


def _row_values(values: torch.Tensor) -> torch.Tensor:
    """One float32 per row, contiguous: what the kernels take for uniforms and temperatures."""
    return values.to(torch.float32).reshape(-1).contiguous()


def draws_plainly(row: SampleRow) -> bool:
    """Whether a row's token depends on its logits only through an argmax (greedy) or a draw
    from softmax(logits / temperature): `SamplingParams.plain_draw`, no grammar, no bad
    words, min_tokens reached (`needs_masks`' other masks). Such rows can be sampled straight
    from the LM head's output."""
    request = row.request
    p = request.sampling
    return (
        p.plain_draw
        and request.grammar is None
        and not request.bad_words_token_ids
        and (not p.min_tokens or row.num_output_tokens >= p.min_tokens)
    )


def raw_logprobs(
    logits: torch.Tensor, rows: list[SampleRow]
) -> tuple[list[int], torch.Tensor | None]:
    """(rows asking for logprobs, their log-softmax before any mask or penalty)."""
    lp_idx = [i for i, r in enumerate(rows) if r.request.sampling.logprobs is not None]
    return lp_idx, (logits[lp_idx].log_softmax(-1) if lp_idx else None)


class Sampler:
    """Draws tokens from a step's logits, one per SampleRow; holds the penalty counts of the
    requests it has sampled for, by request id, until `forget`."""

    def __init__(self) -> None:
        self.penalties = Penalties()

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop what is kept for these requests (they finished, were aborted or preempted)."""
        self.penalties.forget(request_ids)

    def adjust_logits(self, logits: torch.Tensor, rows: list[SampleRow]) -> None:
        """Request masks, then penalties, in place: what every draw sees before temperature."""
        apply_masks(logits, rows)
        self.penalties.apply(logits, rows)

    def reads_head_logits(self, rows: list[SampleRow], device: torch.device) -> bool:
        """Whether `sample` takes these rows' logits as the LM head made them (bf16 on a bf16
        model) and never needs an fp32 copy: every row draws plainly and the CPU kernels
        read the logits in place."""
        return device.type == "cpu" and all(map(draws_plainly, rows)) and cpu_kernels.load()

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SampleRow],
        plainly: bool | None = None,
    ) -> list[SampledToken]:
        """One token per row. `logits`: [len(rows), vocab], fp32 (modified in place), or in
        the LM head's dtype where `reads_head_logits` said so (`plainly`: what it said, when
        the caller asked already)."""
        if plainly is None:
            plainly = all(map(draws_plainly, rows))
        if plainly and cpu_kernels.reads_logits(logits):
            return self._sample_plainly(logits, rows)
        logits = logits.float()
        raw = raw_logprobs(logits, rows)
        self.adjust_logits(logits, rows)
        random_idx = [i for i, r in enumerate(rows) if not r.request.sampling.greedy]
        if not random_idx:
            return with_logprobs(argmax_rows(logits).tolist(), rows, raw)
        greedy_idx = [i for i, r in enumerate(rows) if r.request.sampling.greedy]
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if greedy_idx:
            tokens[greedy_idx] = argmax_rows(logits[greedy_idx])
        whole = len(random_idx) == len(rows)
        sub_rows = rows if whole else [rows[i] for i in random_idx]
        # Inverse CDF: one uniform per row, from that row's own (seed, index, position) stream.
        drawn = draw(
            _filter(logits if whole else logits[random_idx], sub_rows),
            torch.from_numpy(row_uniforms(sub_rows)),
        )
        if whole:
            tokens = drawn
        else:
            tokens[random_idx] = drawn
        return with_logprobs(tokens.tolist(), rows, raw)

    @staticmethod
    def _sample_plainly(logits: torch.Tensor, rows: list[SampleRow]) -> list[SampledToken]:
        """Rows that all draw plainly, in one kernel call: the same tokens as the path above
        (the argmax; the tempered logits' softmax for the row's uniform), with no fp32 copy,
        no in-place temperature pass and no index splitting."""
        temperatures = [r.request.sampling.temperature for r in rows]
        if not any(temperatures):
            tokens = cpu_kernels.argmax_rows(logits)
        else:
            uniforms = cpu_kernels.first_uniforms(draw_keys(rows))  # row_uniforms' own, in C++
            tokens = cpu_kernels.sample_rows(
                logits, uniforms, torch.tensor(temperatures, dtype=torch.float32), _CHUNK
            )
        return [SampledToken(t) for t in tokens.tolist()]

    def target_probs(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The distribution `sample` draws each row from ([rows, vocab]): masks, penalties,
        then temperature / top-k / top-p / min-p; a point mass on the argmax for greedy rows.
        `logits` is modified in place."""
        self.adjust_logits(logits, rows)
        probs = torch.zeros_like(logits)
        greedy = [i for i, r in enumerate(rows) if r.request.sampling.greedy]
        random_idx = [i for i, r in enumerate(rows) if not r.request.sampling.greedy]
        if greedy:
            probs[greedy] = probs[greedy].scatter(1, argmax_rows(logits[greedy])[:, None], 1.0)
        if random_idx:
            probs[random_idx] = _filter(logits[random_idx], [rows[i] for i in random_idx]).softmax(
                -1
            )
        return probs


def with_logprobs(
    tokens: list[int], rows: list[SampleRow], raw: tuple[list[int], torch.Tensor | None]
) -> list[SampledToken]:
    """SampledTokens for one token per row, with logprobs (from `raw_logprobs`) where asked."""
    out = [SampledToken(token) for token in tokens]
    lp_idx, logprobs = raw
    if logprobs is None:
        return out
    chosen = logprobs.gather(
        1, torch.tensor([tokens[i] for i in lp_idx], device=logprobs.device)[:, None]
    )
    ranks = token_ranks(logprobs, chosen).tolist()
    for j, (i, value) in enumerate(zip(lp_idx, chosen.squeeze(1).tolist())):
        n = rows[i].request.sampling.logprobs
        top: tuple[tuple[int, float], ...] = ()
        if n:
            vals, ids = logprobs[j].topk(n)
            top = tuple(zip(ids.tolist(), vals.tolist()))
        out[i] = SampledToken(out[i].token_id, value, top, ranks[j])
    return out


def token_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """1-based rank of each row's chosen logprob ([rows, 1]) among the row's logprobs, as
    vLLM counts it: the number of tokens at least as likely (ties share the worse rank)."""
    return (logprobs >= chosen).sum(-1)
