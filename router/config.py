"""The router's configuration: one frozen tree, built once from the command line; its flags
come from the fields (engine.flags; router/cli.py)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.chat_config import GROUP as CHAT_GROUP
from cluster.chat_config import ChatConfig
from cluster.etcd_security import GROUP as ETCD_GROUP
from cluster.etcd_security import EtcdSecurity
from cluster.grpc_security import GROUP as GRPC_SECURITY_GROUP
from cluster.grpc_security import GrpcSecurity
from engine.checks import FieldError, check_fields
from engine.config import LoRAModule, parse_size
from engine.flags import option
from router.endpoint_picker.config import GROUP as PICKER_GROUP
from router.endpoint_picker.config import WILDCARD_HOSTS, EndpointPickerConfig
from router.http.allowed_hosts import HostRule, parse_allowed_host
from router.placement.allowed_workers import ANY, IPNetwork, parse_network

POLICIES = ("affinity", "round_robin", "least_loaded")


@dataclass(frozen=True)
class PlacementConfig:
    """Weights and thresholds of the placement policies (router/placement/policy.py)."""

    policy: str = option("affinity", choices=POLICIES)
    """affinity (prefix cache + load + estimated TTFT); round_robin and least_loaded are
    baselines."""
    prefix_weight: float = 1.0
    """Decode score gained per unit of prompt fraction found in the worker's own prefix cache."""
    load_weight: float = 1.0
    """Decode score lost per `load_scale` requests running or waiting on the worker."""
    kv_weight: float = 0.5
    """Decode score lost per unit of the worker's KV pool in use (0..1)."""
    load_scale: float = 8.0
    """Requests that cost `load_weight` of score: how many requests a full prefix hit is worth."""
    local_prefill_threshold: int = 128
    """Uncached prompt tokens (on the decode worker) below which it prefills locally."""
    local_prefill_max_tokens: int | None = None
    """Operator override: uncached prompt tokens above which the decode worker never
    prefills a prompt because its estimated TTFT is lower (0: never on estimate; None: no
    limit, the estimates decide for any length)."""
    itl_slo_ms: float = 250.0
    """Inter-token latency the decode worker's running requests must keep: it prefills a
    prompt itself only if a step with the prompt's chunk is estimated within this (0: off)."""
    prefill_queue_limit: int = 16384
    """A prefill worker with more queued prefill tokens than this is saturated."""
    default_prefill_rate: float = 2000.0
    """Prefill tokens/s assumed for a worker that has not measured its rate yet (and no
    peer's measured rate stands in)."""
    max_waiting_per_worker: int = 64
    """A decode worker with more waiting requests than this has no capacity for new ones."""
    lora_weight: float = 0.5
    """Decode score lost when the request's LoRA adapter is not loaded on the worker."""
    lora_load_s: float = option(0.05, name="--lora-load-time")
    """Seconds added to a worker's estimated TTFT when it must load the request's LoRA
    adapter first."""
    kv_pull: bool = True
    """Let the worker that computes a prompt pull the prompt's blocks another worker holds
    beyond its own prefix hit (over the KV transfer) when that is estimated faster than
    computing them."""
    default_kv_pull_rate: float = 2000.0
    """KV blocks per second a worker is assumed to pull from a peer until it has measured
    its own rate."""
    default_kv_pull_overhead_s: float = option(0.01, name="--default-kv-pull-overhead")
    """Seconds one pull is assumed to take whatever its size (calls, the holder finishing
    its step, adoption) until the worker has measured its own."""
    default_kv_promote_s: float = option(0.0001, name="--default-kv-promote-time")
    """Seconds one block's promotion from a worker's second KV tier is assumed to take until
    the worker has measured it."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            [
                (self.policy in POLICIES, "policy", f"must be one of {', '.join(POLICIES)}"),
                (self.prefix_weight >= 0, "prefix_weight", "must be >= 0"),
                (self.load_weight >= 0, "load_weight", "must be >= 0"),
                (self.kv_weight >= 0, "kv_weight", "must be >= 0"),
                (self.load_scale > 0, "load_scale", "must be > 0"),
                (self.local_prefill_threshold >= 0, "local_prefill_threshold", "must be >= 0"),
                (self.prefill_queue_limit >= 0, "prefill_queue_limit", "must be >= 0"),
                (
                    self.local_prefill_max_tokens is None or self.local_prefill_max_tokens >= 0,
                    "local_prefill_max_tokens",
                    "must be >= 0",
                ),
                (self.itl_slo_ms >= 0, "itl_slo_ms", "must be >= 0"),
                (self.default_prefill_rate > 0, "default_prefill_rate", "must be > 0"),
                (self.max_waiting_per_worker >= 0, "max_waiting_per_worker", "must be >= 0"),
                (self.lora_weight >= 0, "lora_weight", "must be >= 0"),
                (self.lora_load_s >= 0, "lora_load_s", "must be >= 0"),
                (self.default_kv_pull_rate > 0, "default_kv_pull_rate", "must be > 0"),
                (self.default_kv_promote_s >= 0, "default_kv_promote_s", "must be >= 0"),
                (
                    self.default_kv_pull_overhead_s >= 0,
                    "default_kv_pull_overhead_s",
                    "must be >= 0",
                ),
            ],
        )


@dataclass(frozen=True)
class LimitsConfig:
    """What one client may ask of the router (docs/router.md, "Limits"): bounds on the HTTP
    layer (router/http/limits.py) and on a request's inputs (router/generation/prepare.py,
    router/generation/structured.py), each refusal an OpenAI-shaped 4xx."""

    max_request_body_bytes: int = option(16 << 20, type=parse_size, metavar="BYTES")
    """Largest request body (e.g. 16MiB): a larger one is a 413, refused on its
    Content-Length before it is read, or as soon as a chunked body passes the cap."""
    request_header_timeout_s: float = option(10.0, name="--request-header-timeout")
    """A connection whose request line and headers have not fully arrived this many seconds
    after it opened (or after its previous response) is closed."""
    request_body_timeout_s: float = option(30.0, name="--request-body-timeout")
    """A request whose body has not fully arrived this many seconds after its headers is a
    408."""
    limit_concurrency: int = 2048
    """Open connections (or requests in progress) beyond which a new request is a 503
    (uvicorn's limit_concurrency; keep the open-files limit above it)."""
    timeout_keep_alive_s: float = option(5.0, name="--timeout-keep-alive")
    """An idle keep-alive connection is closed after this many seconds (uvicorn's)."""
    max_prompt_chars: int | None = None
    """Longest text one prompt (or chat conversation, /tokenize text, embedding input) may
    have, checked before it is tokenized; longer is a 400. Default: the longest text that can
    fit the context, max_model_len x the longest vocabulary entry (in characters)."""
    max_prompts_per_request: int = 256
    """Most prompts in one /v1/completions batch, or inputs in one /v1/embeddings request."""
    max_choices_per_request: int = 512
    """Most completions one request asks for: n x the number of prompts."""
    max_stop_strings: int = 64
    """Most `stop` strings in one request."""
    max_bad_words: int = 128
    """Most `bad_words` in one request."""
    max_logit_bias: int = 1024
    """Most `logit_bias` entries in one request."""
    max_grammar_bytes: int = option(128 << 10, type=parse_size, metavar="BYTES")
    """Largest structured-output constraint (a JSON schema as JSON, a regex, a grammar, the
    choices, a structural tag); larger is a 400."""
    grammar_compile_timeout_s: float = option(10.0, name="--grammar-compile-timeout")
    """A constraint that does not compile within this many seconds is a 400 (the compile runs
    in a child process that is killed then)."""
    grammar_compile_processes: int = 1
    """Child processes compiling constraints (each compiles one at a time)."""
    grammar_compile_wait_s: float = option(10.0, name="--grammar-compile-wait")
    """The longest a request waits for a free compile process (API keys take turns, one
    compile each; keyless requests are one tenant); past it the request is a 503
    (`compile_busy`, Retry-After). A compile cache hit never waits."""
    max_grammar_repetitions: int = option(1000, metavar="N")
    """Largest product of nested counted-repetition bounds (`(a{1,50}){1,50}`: 2500) in a
    constraint's regexes (a JSON schema's patterns too) and grammars; larger is a 400
    (`grammar_too_complex`) before any compile. 0: no limit."""
    tokenizer_threads: int = 2
    """Threads tokenizing large prompts off the event loop."""
    max_concurrent_requests_per_key: int = option(0, metavar="N")
    """Most requests one API key may have in progress on /v1/completions, /v1/chat/completions,
    /v1/responses, /v1/embeddings, /tokenize and /detokenize, and endpoint-picker decisions
    (a stream holds its slot until it ends or the client leaves); one more is a 429
    (rate_limit_exceeded, Retry-After: 1). 0: no limit. Needs API keys; admin keys are not
    limited."""
    max_tokens_per_minute_per_key: int = option(0, metavar="TOKENS")
    """Tokens one API key may spend per minute on those paths (a bucket of one minute's tokens,
    refilled continuously): a request reserves its prompt tokens + max_tokens x n (no
    max_tokens: what the context leaves) when it is dispatched, and gets back what it did not
    generate when it ends; without enough tokens it is a 429 (rate_limit_exceeded,
    Retry-After: the seconds until there are). A request above a whole minute's tokens waits
    for a full bucket and overdraws it. 0: no limit. Needs API keys; admin keys are not
    limited."""
    max_compile_seconds_per_minute_per_key: float = option(0.0, metavar="SECONDS")
    """Grammar compile seconds one API key may spend per minute (a bucket like the tokens',
    charged the seconds each of its compiles took, a timed-out one the whole timeout): with
    the bucket empty or in debt, a request whose constraint misses the compile cache is a
    429 (rate_limit_exceeded, Retry-After: the seconds until it refills). 0: no limit (the
    seconds are still counted per key). Admin keys and keyless routers are not limited."""

    def __post_init__(self) -> None:
        positive = (
            "max_request_body_bytes",
            "request_header_timeout_s",
            "request_body_timeout_s",
            "limit_concurrency",
            "timeout_keep_alive_s",
            "max_prompts_per_request",
            "max_choices_per_request",
            "max_grammar_bytes",
            "grammar_compile_timeout_s",
            "grammar_compile_processes",
            "grammar_compile_wait_s",
            "tokenizer_threads",
        )
        check_fields(
            self,
            [(getattr(self, name) > 0, name, "must be > 0") for name in positive]
            + [
                (getattr(self, name) >= 0, name, "must be >= 0")
                for name in (
                    "max_stop_strings",
                    "max_bad_words",
                    "max_logit_bias",
                    "max_concurrent_requests_per_key",
                    "max_tokens_per_minute_per_key",
                    "max_compile_seconds_per_minute_per_key",
                    "max_grammar_repetitions",
                )
            ]
            + [
                (
                    self.max_prompt_chars is None or self.max_prompt_chars > 0,
                    "max_prompt_chars",
                    "must be > 0",
                )
            ],
        )


@dataclass(frozen=True)
class RouterConfig:
    etcd: str = option(metavar="HOST:PORT")
    """etcd endpoint, host:port."""
    etcd_security: EtcdSecurity = option(default_factory=EtcdSecurity, group=ETCD_GROUP)
    """How the router authenticates to etcd: a user that may read the cluster's keys, TLS."""
    cluster: str = "default"
    """Cluster name: workers are read from /pdserve/<cluster>/workers/."""
    host: str = "127.0.0.1"
    """HTTP listen address."""
    port: int = 8000
    """HTTP port."""
    allowed_hosts: tuple[HostRule, ...] = option(
        (), type=str, group="security", metavar="HOST[,HOST...]"
    )
    """Host names (name, name:port, an IP; comma-separated) a router without an API key also
    answers to, besides --host, localhost, 127.0.0.1 and [::1] (a DNS-rebinding guard: a
    request for any other name is a 421); and browser origins it accepts besides its own
    (another Origin is a 403). '*': any host name (the Origin check stays). On a wildcard
    --host (0.0.0.0, ::) any IP address is served too; a name (a Service's, a proxy's) needs
    this flag."""
    model: str = "default"
    """Tokenizer / chat template / context length source: "default" or an HF directory."""
    served_model_name: str | None = None
    """Model name clients send and /v1/models lists. Default: the model directory's name."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens. Default: the model's max_position_embeddings."""
    # ---- authentication and tenant isolation (router/http/auth.py resolves the keys at start) ----
    api_key: tuple[str, ...] = option((), group="security", metavar="KEY")
    """Keys clients send as `Authorization: Bearer <key>` on /v1/*, /tokenize and /detokenize
    (vLLM's flag; several: one per tenant, or old and new during a rotation). Visible in
    `ps`: prefer --api-key-file or PDSERVE_API_KEY. Not given: --api-key-file, else
    PDSERVE_API_KEY, else VLLM_API_KEY, else no key is needed. Empty or placeholder keys
    are refused."""
    api_key_file: str | None = option(None, group="security", metavar="PATH")
    """File holding the API keys, one per line (instead of --api-key)."""
    admin_api_key: tuple[str, ...] = option((), group="security", metavar="KEY")
    """Keys for the admin surface (the dev endpoints, LoRA load/unload, /dashboard/data); an
    API key is then not enough there. Not given: --admin-api-key-file, else
    PDSERVE_ADMIN_API_KEY, else the API keys guard the admin surface too."""
    admin_api_key_file: str | None = option(None, group="security", metavar="PATH")
    """File holding the admin keys, one per line (instead of --admin-api-key)."""
    enable_prompt_tokens_details: bool = option(False, group="security")
    """Report usage.prompt_tokens_details.cached_tokens (vLLM's flag). Off by default: the
    count tells a client whether its prompt's prefix was cached, also by another client."""
    cache_salt_from_api_key: bool = option(False, group="security")
    """Salt every request's prefix-cache hashes with a hash of the API key it presented (and
    its own cache_salt), so clients holding different keys never share cached blocks. Needs
    an API key; with several, --admin-api-key too."""
    placement: PlacementConfig = option(default_factory=PlacementConfig, group="placement")
    """Weights and thresholds of the placement policies."""
    queue_timeout_s: float = option(10.0, name="--queue-timeout", group="admission")
    """How long a request waits for a worker with capacity before a 503."""
    max_queued_requests: int = option(1024, group="admission")
    """Requests waiting for capacity beyond this get a 503 at once."""
    max_retries: int = option(1, group="admission")
    """Attempts on another decode worker when one fails before the first token."""
    max_migrations: int = option(3, group="fault tolerance")
    """Times one request may move to another decode worker after tokens were streamed (its
    worker failed or stalled); it resumes there from prompt + tokens sent. 0: never (the
    stream ends with an error event)."""
    first_token_timeout_s: float = option(
        0.0, name="--first-token-timeout", group="fault tolerance"
    )
    """A call that streams no token within this many seconds is cancelled and retried on
    another worker. 0: off (a request may legitimately queue behind others for long)."""
    stall_timeout_s: float = option(60.0, name="--stall-timeout", group="fault tolerance")
    """A call that streamed tokens (or resumes a migrated request) and then streams nothing
    for this many seconds is cancelled and the request migrated. 0: off."""
    stale_after_s: float = option(2.0, name="--stale-after", group="fault tolerance")
    """A worker whose registration was not republished for this long gets no new work."""
    max_n: int = 128
    """Largest `n` accepted."""
    enable_lora: bool = False
    """Allow loading and unloading LoRA adapters at run time (POST /v1/load_lora_adapter,
    /v1/unload_lora_adapter); also enabled by VLLM_ALLOW_RUNTIME_LORA_UPDATING=true."""
    lora_modules: tuple[LoRAModule, ...] = option((), type=str, metavar="NAME=PATH")
    """LoRA adapters served as model NAME from the start (the workers load them from PATH on
    first use)."""
    enable_dev_endpoints: bool = False
    """Serve the fleet-wide admin endpoints (vLLM's dev-mode names: /sleep, /wake_up,
    /is_sleeping, /reset_prefix_cache, /collective_rpc, plus /update_weights); also enabled
    by VLLM_SERVER_DEV_MODE=1. Guarded by --admin-api-key, else --api-key, when set."""
    chat: ChatConfig = option(default_factory=ChatConfig, group=CHAT_GROUP)
    """The chat template, tool calling and reasoning (vLLM's flags)."""
    enable_response_store: bool = option(False, group="responses API")
    """Keep finished /v1/responses responses in memory, so that a later request continues one
    with `previous_response_id` (OpenAI's `store`, true unless a request says false); also
    enabled by VLLM_ENABLE_RESPONSES_API_STORE=1 (vLLM's switch). Off: previous_response_id
    is a 400. The store is this router process's: a client continues a response on the
    router that answered it."""
    response_store_max_entries: int = option(1024, group="responses API", metavar="N")
    """Most responses kept; past it, the least recently used goes first."""
    response_store_max_bytes: int = option(
        256 << 20, type=parse_size, metavar="BYTES", group="responses API"
    )
    """Most conversation text kept, as JSON, summed over the responses kept (e.g. 256MiB);
    past it, the least recently used go first."""
    generation_config: str = "auto"
    """Sampling defaults for fields a request omits (temperature, top_p, top_k, min_p,
    repetition_penalty; max_new_tokens for chat): "auto" = the model's generation_config.json,
    "vllm" = none (built-in defaults), or a folder holding a generation_config.json."""
    allowed_worker_cidrs: tuple[IPNetwork, ...] = option(
        ANY, type=parse_network, group="security", metavar="CIDR"
    )
    """Networks a registration's gRPC and metrics addresses must lie in (IP addresses; a
    host name is refused unless every address is allowed); others are ignored, with one
    warning each, so a forged registration gets no prompts and no /metrics fetch. Default:
    any address; `pdserve up` passes 127.0.0.0/8 ::1/128."""
    limits: LimitsConfig = option(default_factory=LimitsConfig, group="limits")
    """Bounds on what one client may ask: body size, timeouts, batch sizes, grammars."""
    endpoint_picker: EndpointPickerConfig = option(
        default_factory=EndpointPickerConfig, group=PICKER_GROUP
    )
    """The Gateway API Inference Extension endpoint picker this router can also serve."""
    grpc_security: GrpcSecurity = option(default_factory=GrpcSecurity, group=GRPC_SECURITY_GROUP)
    """What the router presents to the workers' gRPC ports (and their KV-event streams): the
    cluster token and/or a mutual-TLS identity, as the workers of the cluster expect."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", tuple(map(LoRAModule.parse, self.lora_modules)))
        object.__setattr__(self, "allowed_hosts", _allowed_hosts(self.allowed_hosts))
        for name in ("api_key", "admin_api_key"):  # one key may be given as a string
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, (getattr(self, name),))
        check_fields(
            self,
            [
                (0 < self.port < 65536, "port", "must be in 1..65535"),
                (
                    self.max_model_len is None or self.max_model_len >= 1,
                    "max_model_len",
                    "must be >= 1",
                ),
                (self.queue_timeout_s >= 0, "queue_timeout_s", "must be >= 0"),
                (self.max_queued_requests >= 0, "max_queued_requests", "must be >= 0"),
                (self.max_retries >= 0, "max_retries", "must be >= 0"),
                (self.max_migrations >= 0, "max_migrations", "must be >= 0"),
                (self.first_token_timeout_s >= 0, "first_token_timeout_s", "must be >= 0"),
                (self.stall_timeout_s >= 0, "stall_timeout_s", "must be >= 0"),
                (self.stale_after_s > 0, "stale_after_s", "must be > 0"),
                (self.max_n >= 1, "max_n", "must be >= 1"),
                (
                    self.response_store_max_entries >= 1,
                    "response_store_max_entries",
                    "must be >= 1",
                ),
                (self.response_store_max_bytes >= 1, "response_store_max_bytes", "must be >= 1"),
                (bool(self.allowed_worker_cidrs), "allowed_worker_cidrs", "must name a network"),
                (
                    not self.endpoint_picker.port
                    or self.endpoint_picker.endpoint is not None
                    or self.host not in WILDCARD_HOSTS,
                    "endpoint_picker",
                    "needs --endpoint-picker-endpoint when --host is a wildcard address "
                    "(the gateway must be told an address it can reach)",
                ),
            ],
        )


def _allowed_hosts(given: tuple[HostRule | str, ...] | str) -> tuple[HostRule, ...]:
    """--allowed-hosts' values (comma-separated, or several values) as rules."""
    if isinstance(given, str):
        given = (given,)
    rules: list[HostRule] = []
    for item in given:
        if isinstance(item, HostRule):
            rules.append(item)
            continue
        for part in filter(None, (p.strip() for p in item.split(","))):
            try:
                rules.append(parse_allowed_host(part))
            except ValueError as exc:
                raise FieldError("allowed_hosts", f"allowed_hosts: {exc}") from None
    return tuple(rules)
