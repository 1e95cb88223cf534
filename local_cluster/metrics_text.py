"""Reading Prometheus text exposition (the router's and the workers' /metrics) for the planner:
one scrape as a flat map of samples, and windowed figures from two scrapes of the same process
(counter increase, histogram quantile over the observations between them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Scrape:
    """One /metrics page: sample name (with its `_total` / `_bucket` / `_count` suffix) and
    sorted label pairs -> value."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    @classmethod
    def parse(cls, text: str) -> "Scrape":
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return cls(samples)

    def value(self, name: str, **labels: str) -> float | None:
        """Sum of the samples named `name` whose labels include `labels` (None: no such sample)."""
        want = set(labels.items())
        found = [v for (n, ls), v in self.samples.items() if n == name and want <= set(ls)]
        return sum(found) if found else None

    def buckets(self, histogram: str, **labels: str) -> dict[float, float]:
        """Cumulative counts by upper bound (`le`, +Inf included) of histogram `histogram`."""
        want = set(labels.items())
        out: dict[float, float] = {}
        for (n, ls), v in self.samples.items():
            if n == f"{histogram}_bucket" and want <= set(ls):
                le = float(dict(ls)["le"])
                out[le] = out.get(le, 0.0) + v
        return out


def increase(new: Scrape, old: Scrape | None, name: str, **labels: str) -> float:
    """How much counter `name` grew from `old` to `new` (all of it without `old`; 0 when the
    counter is missing or went down, i.e. the process restarted)."""
    now = new.value(name, **labels)
    if now is None:
        return 0.0
    before = old.value(name, **labels) if old is not None else 0.0
    grown = now - (before or 0.0)
    return grown if grown >= 0 else 0.0


def window_buckets(new: Scrape, old: Scrape | None, histogram: str) -> dict[float, float]:
    """Cumulative counts of the observations made between `old` and `new`."""
    after = new.buckets(histogram)
    before = old.buckets(histogram) if old is not None else {}
    window = {le: c - before.get(le, 0.0) for le, c in after.items()}
    if any(c < 0 for c in window.values()):
        return {}  # restarted in between: the window is not comparable
    return window


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """The q-quantile of a cumulative histogram, interpolated linearly inside its bucket (as
    Prometheus' histogram_quantile does); observations above the largest finite bound count
    as that bound. None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = (le if not math.isinf(le) else lower), count
    return lower
