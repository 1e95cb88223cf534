"""Verification: which drafts the target keeps, and the token it adds.

The target computes k + 1 positions for a sequence with k drafts d_1..d_k: row j predicts
the token after the sequence plus d_1..d_j (masks, penalties and the seeded stream of row j
see that history). The longest acceptable prefix of the drafts is kept, plus one token from
the target: a correction at the first rejection, or a bonus after k accepted drafts.

Two forms of the standard rule (Leviathan et al. 2023; Chen et al. 2023), which preserves
the target's distribution exactly:

- Drafts with a distribution q (`rejection_sample`): accept d_j with probability
  min(1, p(d_j) / q(d_j)); at the first rejection draw from the normalized residual
  max(0, p - q).
- Point-mass drafts (q = 1 at d_j; every built-in proposer): accept with probability p(d_j),
  else draw from p without d_j, renormalized. `accepted_prefix` realizes exactly that by
  letting each row draw its token as plain sampling would (inverse CDF of p with the row's
  (seed, position) uniform; argmax when greedy) and accepting d_j iff the draw equals it:
  P(accept) = p(d_j), and a rejected draw is distributed as p conditioned on != d_j. So the
  output is, token for token, what the sequence samples without speculation from the same
  logits — for every seed, at any acceptance length. (The logits themselves are those of a
  k + 1-row forward: in float32 they equal one-row decoding's here; in bfloat16 they may
  round differently, as a different batch composition does, and a near-tie can then flip.)"""

from __future__ import annotations

import torch

from engine.sampling.sample_row import SampleRow
from engine.sampling.sampler import inverse_cdf, row_uniforms


def accepted_prefix(drawn: list[int], drafts: list[int]) -> int:
    """Point-mass drafts: `drawn[j]` is the target's own draw at row j (len(drafts) + 1
    rows). Returns a, the number of drafts kept; the output is drawn[: a + 1]."""
    a = 0
    while a < len(drafts) and drawn[a] == drafts[a]:
        a += 1
    return a


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, drafts: list[int], rows: list[SampleRow]
) -> list[int]:
    """Drafts drawn from `q` ([k, vocab]); `p` ([k + 1, vocab]): the target's distribution
    at each row (engine.sampling.sampler.Sampler.target_probs). Returns the kept drafts plus the
    target's token. Row j's stream gives two uniforms: the accept test, then the residual draw; the
    bonus row draws with its first uniform, as plain sampling would."""
    out: list[int] = []
    for j, token in enumerate(drafts):
        u_accept, u_residual = (float(u) for u in row_uniforms([rows[j]], 2)[0])
        if u_accept * q[j, token] < p[j, token]:
            out.append(token)
            continue
        residual = (p[j] - q[j]).clamp(min=0)
        if not bool(residual.sum() > 0):
            residual = p[j]  # p == q (up to rounding): the residual is empty
        out.append(_draw(residual, u_residual))
        return out
    out.append(_draw(p[len(drafts)], float(row_uniforms([rows[len(drafts)]])[0, 0])))
    return out


def _draw(probs: torch.Tensor, u: float) -> int:
    return int(
        inverse_cdf(probs[None], torch.tensor([[u]], dtype=probs.dtype, device=probs.device))
    )
