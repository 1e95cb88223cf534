"""`pdserve bench`: flags -> BenchConfig -> workload -> run -> report. Importing this module is
cheap (argparse and the config dataclasses); httpx, numpy, tqdm and matplotlib load when the
command runs, torch only with --tokenizer."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from pdserve.bench.config import (
    DATASETS,
    ENDPOINTS,
    BenchConfig,
    EndpointConfig,
    LoadConfig,
    SloConfig,
    WorkloadConfig,
)


def _range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (two integers), got {text!r}")
    return lo, hi


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except for flags that are off or unset by default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def register(subparsers) -> None:
    e, w, ld = EndpointConfig(), WorkloadConfig(), LoadConfig()
    p = subparsers.add_parser(
        "bench",
        help="serving load generator against any OpenAI-compatible URL "
        "(TTFT/ITL/TPOT/e2e, throughput, goodput)",
        description="Send streamed requests to an OpenAI-compatible server at a Poisson "
        "request rate or a fixed concurrency, and report throughput, TTFT / ITL / TPOT / "
        "end-to-end latency (mean, p50, p90, p99) and goodput. See docs/bench.md.",
        formatter_class=_Help,
    )
    g = p.add_argument_group("server")
    g.add_argument("--url", default=e.url, help="base URL of the server (no /v1 suffix)")
    g.add_argument(
        "--model",
        default=None,
        help="model name sent in requests (default: the first id from GET /v1/models)",
    )
    g.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default=e.endpoint,
        help="/v1/completions or /v1/chat/completions",
    )
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos=true so every request generates its max_tokens",
    )
    g = p.add_argument_group("workload")
    g.add_argument(
        "--dataset",
        choices=DATASETS,
        default=w.dataset,
        help="random: independent prompts; shared-prefix: --num-tenants tenants, "
        "each with a --prefix-len-token system prompt, plus a question per request",
    )
    g.add_argument("--num-requests", type=int, default=w.num_requests, help="requests to send")
    g.add_argument(
        "--input-len",
        type=int,
        default=w.input_len[0],
        help="prompt tokens (shared-prefix: question tokens after the prefix)",
    )
    g.add_argument(
        "--input-len-range",
        type=_range,
        default=None,
        metavar="MIN,MAX",
        help="draw prompt tokens uniformly from [MIN, MAX] instead of --input-len",
    )
    g.add_argument(
        "--output-len", type=int, default=w.output_len[0], help="max_tokens of each request"
    )
    g.add_argument(
        "--output-len-range",
        type=_range,
        default=None,
        metavar="MIN,MAX",
        help="draw max_tokens uniformly from [MIN, MAX] instead of --output-len",
    )
    g.add_argument(
        "--num-tenants",
        type=int,
        default=w.num_tenants,
        help="shared-prefix: number of tenants (distinct system prompts)",
    )
    g.add_argument(
        "--prefix-len",
        type=int,
        default=w.prefix_len,
        help="shared-prefix: tokens in each tenant's system prompt",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help='"default" (bundled SmolLM2) or an HF model directory: exact prompt '
        "token counts for that tokenizer (default: about one token per word)",
    )
    g.add_argument(
        "--seed", type=int, default=w.seed, help="seeds prompts, lengths, tenants and arrival times"
    )
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=float,
        default=ld.request_rate,
        help="mean requests/s, Poisson arrivals; inf = all at once",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight at once (default: unbounded)",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=ld.timeout_s,
        help="seconds for the whole run; unfinished requests then count as failed (or unsent)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("report")
    g.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=None,
        help="goodput: a request is good only if its TTFT <= this",
    )
    g.add_argument(
        "--slo-itl-ms",
        type=float,
        default=None,
        help="goodput: a request is good only if every gap between its streamed chunks is <= this",
    )
    g.add_argument(
        "--worker-metrics",
        default=None,
        metavar="up|HOST:PORT,...",
        help="scrape these workers' /metrics before and after the run and report the split "
        "path's KV pushes and handovers ('up': the running `pdserve up`'s workers)",
    )
    g.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    g.add_argument(
        "--plot", type=Path, default=None, help="write a PNG of TTFT / ITL / e2e latency CDFs here"
    )
    p.set_defaults(func=_run)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        endpoint=EndpointConfig(
            url=args.url,
            model=args.model,
            endpoint=args.endpoint,
            api_key=args.api_key,
            ignore_eos=args.ignore_eos,
        ),
        workload=WorkloadConfig(
            dataset=args.dataset,
            num_requests=args.num_requests,
            input_len=args.input_len_range or (args.input_len, args.input_len),
            output_len=args.output_len_range or (args.output_len, args.output_len),
            num_tenants=args.num_tenants,
            prefix_len=args.prefix_len,
            seed=args.seed,
            tokenizer=args.tokenizer,
        ),
        load=LoadConfig(
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            timeout_s=args.timeout,
            progress=not args.no_progress,
        ),
        slo=SloConfig(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms),
        out=args.out,
        plot=args.plot,
        worker_metrics=args.worker_metrics,
    )


def _run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    from pdserve.bench.report import format_table, summarize, to_json, write_json
    from pdserve.bench.runner import run_benchmark
    from pdserve.bench.worker_side import kv_transfer_stats, metrics_urls, scrape
    from pdserve.bench.workload import build_workload

    specs = build_workload(cfg.workload)
    workers = metrics_urls(cfg.worker_metrics) if cfg.worker_metrics else []
    before = scrape(workers)
    run = run_benchmark(cfg, specs)
    report = summarize(run, cfg.slo)
    if workers:
        report = replace(report, kv_transfer=kv_transfer_stats(before, scrape(workers)))
    rate = "inf" if math.isinf(cfg.load.request_rate) else f"{cfg.load.request_rate:g}/s"
    print(
        f"model {run.model} at {cfg.endpoint.url} ({cfg.endpoint.endpoint}), "
        f"dataset {cfg.workload.dataset}, rate {rate}, "
        f"max concurrency {cfg.load.max_concurrency or 'unbounded'}"
        + (" -- run deadline reached" if run.timed_out else "")
    )
    print(format_table(report))
    if cfg.out:
        write_json(cfg.out, to_json(cfg, run, report))
        print(f"wrote {cfg.out}")
    if cfg.plot:
        from pdserve.bench.plot import plot_cdfs

        plot_cdfs(
            run.results,
            cfg.slo,
            cfg.plot,
            title=f"{run.model}: {cfg.workload.dataset}, rate {rate}",
        )
        print(f"wrote {cfg.plot}")
    return 0 if report.completed else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pdserve.bench ...`: the same command without the rest of pdserve."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
