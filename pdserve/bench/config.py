"""The benchmark's configuration: one frozen tree, built once from the command line
(`cli.config_from_args`) and passed down. Importing this module is cheap (no third-party
imports)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

DATASETS = ("random", "shared-prefix")
ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class EndpointConfig:
    url: str = "http://127.0.0.1:8000"
    """Base URL of the server; requests go to {url}/v1/completions or {url}/v1/chat/completions."""
    model: str | None = None
    """Model name sent in each request; None = the first id listed by GET {url}/v1/models."""
    endpoint: str = "completions"
    """"completions" (prompt text) or "chat" (messages)."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer KEY` when set."""
    ignore_eos: bool = False
    """Ask the server to keep generating past EOS, so every request produces max_tokens."""

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")


@dataclass(frozen=True)
class WorkloadConfig:
    dataset: str = "random"
    """"random": independent prompts; "shared-prefix": tenants with a long shared system
    prompt each, followed by a short question per request."""
    num_requests: int = 100
    """How many requests the run sends."""
    input_len: tuple[int, int] = (128, 128)
    """Prompt tokens (shared-prefix: question tokens), drawn uniformly from [min, max]."""
    output_len: tuple[int, int] = (128, 128)
    """max_tokens of each request, drawn uniformly from [min, max]."""
    num_tenants: int = 4
    """shared-prefix: how many tenants (distinct system prompts)."""
    prefix_len: int = 512
    """shared-prefix: tokens in each tenant's system prompt."""
    seed: int = 0
    """Seeds prompt text, lengths, tenant choice and arrival times."""
    tokenizer: str | None = None
    """None: prompts are random common words, about one token each. "default" (the bundled
    model) or an HF model directory: only words that are exactly one token are used, so
    prompt lengths are exact for that tokenizer."""

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        for name in ("input_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} range must satisfy 1 <= min <= max, got {lo},{hi}")
        if self.num_tenants < 1 or self.prefix_len < 1:
            raise ValueError("num_tenants and prefix_len must be >= 1")


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf
    """Mean arrivals per second (Poisson process); inf = every request at once."""
    max_concurrency: int | None = None
    """At most this many requests in flight (a request that arrives waits for a slot);
    None = unbounded."""
    timeout_s: float = 600.0
    """Deadline for the whole run: requests still running are cancelled (counted as failed),
    requests not yet sent are counted as unsent."""
    progress: bool = True
    """Show a tqdm progress bar (on stderr)."""

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf = all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if not self.timeout_s > 0:
            raise ValueError("timeout must be > 0")


@dataclass(frozen=True)
class SloConfig:
    ttft_ms: float | None = None
    """A request meets the TTFT SLO when its time to first token is <= this."""
    itl_ms: float | None = None
    """A request meets the ITL SLO when every gap between its streamed chunks is <= this."""

    @property
    def enabled(self) -> bool:
        return self.ttft_ms is not None or self.itl_ms is not None


@dataclass(frozen=True)
class BenchConfig:
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    out: Path | None = None
    """Where to write the JSON result (None: not written)."""
    plot: Path | None = None
    """Where to write the PNG of latency CDFs (None: not drawn)."""
    worker_metrics: str | None = None
    """Workers whose /metrics are scraped before and after the run for the split path's KV
    transfer and handover figures: `up`, or comma-separated host:port (None: not scraped)."""
