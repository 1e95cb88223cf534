"""`pdserve router`: flags -> RouterConfig -> router.server.serve. Importing this module is
cheap (argparse only); the HTTP, gRPC and etcd stacks load when the command runs."""
from __future__ import annotations

import argparse

from router.config import POLICIES, PlacementConfig, RouterConfig


def register(subparsers) -> None:
    d, pd = RouterConfig(etcd=""), PlacementConfig()
    p = subparsers.add_parser(
        "router",
        help="OpenAI-compatible HTTP front end: places requests on prefill/decode workers",
        description="Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, "
        "/health, /metrics), placing each request on the decode and prefill workers "
        "registered in etcd.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--etcd", required=True, metavar="HOST:PORT", help="etcd endpoint")
    p.add_argument("--cluster", default=d.cluster, help="cluster name (etcd key prefix)")
    p.add_argument("--host", default=d.host, help="HTTP listen address")
    p.add_argument("--port", type=int, default=d.port, help="HTTP port")
    p.add_argument("--model", default=d.model,
                   help='tokenizer / chat template / context length source: "default" '
                   "(bundled SmolLM2-135M-Instruct) or an HF model directory")
    p.add_argument("--served-model-name", default=None,
                   help="model name in the API (default: the model directory's name)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    p.add_argument("--max-n", type=int, default=d.max_n, help="largest n accepted")
    p.add_argument("--generation-config", default=d.generation_config,
                   help='sampling defaults for omitted request fields: "auto" (the model\'s '
                   'generation_config.json), "vllm" (built-in defaults only) or a folder '
                   "holding a generation_config.json")
    p.add_argument("--enable-lora", action="store_true",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
                   "enabled by VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)")
    p.add_argument("--lora-modules", nargs="+", default=(), metavar="NAME=PATH",
                   help="LoRA adapters served as model NAME from the start (workers load them "
                   "from PATH on first use)")
    p.add_argument("--enable-dev-endpoints", action="store_true",
                   help="fleet-wide admin endpoints (vLLM's dev mode: /sleep, /wake_up, "
                        "/is_sleeping, /reset_prefix_cache, /collective_rpc; /update_weights); "
                        "also VLLM_SERVER_DEV_MODE=1")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    g = p.add_argument_group("placement")
    g.add_argument("--policy", choices=POLICIES, default=pd.policy,
                   help="affinity: prefix cache + load + estimated TTFT; round_robin and "
                   "least_loaded are baselines")
    g.add_argument("--prefix-weight", type=float, default=pd.prefix_weight,
                   help="decode score per unit of prompt fraction cached on the worker")
    g.add_argument("--load-weight", type=float, default=pd.load_weight,
                   help="decode score lost per --load-scale requests on the worker")
    g.add_argument("--load-scale", type=float, default=pd.load_scale,
                   help="requests that cost --load-weight of score")
    g.add_argument("--kv-weight", type=float, default=pd.kv_weight,
                   help="decode score lost per unit of KV pool in use")
    g.add_argument("--local-prefill-threshold", type=int, default=pd.local_prefill_threshold,
                   help="uncached prompt tokens below which the decode worker prefills locally")
    g.add_argument("--local-prefill-max-tokens", type=int, default=pd.local_prefill_max_tokens,
                   help="operator override: uncached prompt tokens above which the decode "
                        "worker never prefills on its estimated TTFT (0: never; unset: no "
                        "limit, the estimates decide for any length)")
    g.add_argument("--itl-slo-ms", type=float, default=pd.itl_slo_ms,
                   help="inter-token latency the decode worker's running requests keep: it "
                        "prefills a prompt itself only if a step with the prompt's chunk is "
                        "estimated within this (0: off)")
    g.add_argument("--prefill-queue-limit", type=int, default=pd.prefill_queue_limit,
                   help="queued prefill tokens above which a prefill worker is saturated")
    g.add_argument("--default-prefill-rate", type=float, default=pd.default_prefill_rate,
                   help="prefill tokens/s assumed until a worker reports its measured rate "
                   "(and no peer's measured rate stands in)")
    g.add_argument("--max-waiting-per-worker", type=int, default=pd.max_waiting_per_worker,
                   help="a decode worker with more waiting requests takes no new ones")
    g.add_argument("--lora-weight", type=float, default=pd.lora_weight,
                   help="decode score lost when the request's LoRA adapter is not loaded there")
    g.add_argument("--lora-load-time", type=float, default=pd.lora_load_s,
                   help="seconds added to a worker's estimated TTFT when it must load the "
                   "request's LoRA adapter first")
    g = p.add_argument_group("admission")
    g.add_argument("--queue-timeout", type=float, default=d.queue_timeout_s,
                   help="seconds a request waits for worker capacity before a 503")
    g.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="requests waiting for capacity beyond this get a 503 at once")
    g.add_argument("--max-retries", type=int, default=d.max_retries,
                   help="retries on another worker when one fails before the first token")
    g = p.add_argument_group("fault tolerance")
    g.add_argument("--max-migrations", type=int, default=d.max_migrations,
                   help="times a request may move to another decode worker after tokens were "
                   "streamed (its worker failed or stalled); it resumes from prompt + tokens "
                   "sent (0: never, the stream ends with an error event)")
    g.add_argument("--first-token-timeout", type=float, default=d.first_token_timeout_s,
                   help="seconds without a first token before the call is cancelled and "
                   "retried on another worker (0: off)")
    g.add_argument("--stall-timeout", type=float, default=d.stall_timeout_s,
                   help="seconds without an update from a call that already streamed (or "
                   "resumes a migrated request) before it is cancelled and the request "
                   "migrated (0: off)")
    g.add_argument("--stale-after", type=float, default=d.stale_after_s,
                   help="seconds without a republished registration before a worker gets "
                   "no new work")
    p.set_defaults(func=_run)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    placement = PlacementConfig(
        policy=args.policy, prefix_weight=args.prefix_weight, load_weight=args.load_weight,
        kv_weight=args.kv_weight, load_scale=args.load_scale,
        local_prefill_threshold=args.local_prefill_threshold,
        local_prefill_max_tokens=args.local_prefill_max_tokens, itl_slo_ms=args.itl_slo_ms,
        prefill_queue_limit=args.prefill_queue_limit,
        default_prefill_rate=args.default_prefill_rate,
        max_waiting_per_worker=args.max_waiting_per_worker,
        lora_weight=args.lora_weight, lora_load_s=args.lora_load_time,
    )
    return RouterConfig(
        etcd=args.etcd, cluster=args.cluster, host=args.host, port=args.port, model=args.model,
        served_model_name=args.served_model_name, max_model_len=args.max_model_len,
        api_key=args.api_key, placement=placement, queue_timeout_s=args.queue_timeout,
        max_queued_requests=args.max_queued_requests, max_retries=args.max_retries,
        max_migrations=args.max_migrations, first_token_timeout_s=args.first_token_timeout,
        stall_timeout_s=args.stall_timeout,
        stale_after_s=args.stale_after, max_n=args.max_n,
        generation_config=args.generation_config, enable_lora=args.enable_lora,
        lora_modules=tuple(args.lora_modules),
        enable_dev_endpoints=args.enable_dev_endpoints,
    )


def _run(args: argparse.Namespace) -> int:
    import logging

    from router.server import serve

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(config_from_args(args), log_level=args.log_level)
