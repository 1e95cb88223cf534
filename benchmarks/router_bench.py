"""Router benchmarks.

`decision`: placement decision time, pure (no processes): 64 simulated workers, 1M indexed
blocks, multi-tenant prompts with shared system prompts. Prints p50/p99 of the block hashing,
of the placement decision (index match + candidates + policy), and of both together.

`cluster`: a multi-tenant shared-prefix workload over real processes (etcd + 2 prefill + 1
decode + router), once per policy (affinity, round_robin, least_loaded): prefix-cache hit rate
and TTFT p50/p90; then router overhead (TTFT through the router vs calling the decode worker
directly). Small model (--num-layers) and short prompts by default, sized for a CPU. The
cluster runs with a cluster token, as `pdserve up` does (its cost alone:
benchmarks/grpc_auth_bench.py).

    .venv/bin/python benchmarks/router_bench.py decision
    .venv/bin/python benchmarks/router_bench.py cluster --tenants 8 --system-tokens 1024
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

from cluster.registration import Capacity, WorkerInfo
from cluster.roles import Role


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def fmt_ms(values: list[float]) -> str:
    return (
        f"p50 {pct(values, 50) * 1e3:.3f} ms  p90 {pct(values, 90) * 1e3:.3f} ms  "
        f"p99 {pct(values, 99) * 1e3:.3f} ms  max {max(values) * 1e3:.3f} ms"
    )


# ---- decision time ---------------------------------------------------------------------------
def bench_decision(args: argparse.Namespace) -> None:
    from router.config import PlacementConfig
    from router.placement.index import KVIndex
    from router.placement.placer import Placer, PromptKey
    from router.placement.policy import make_policy
    from router.placement.registry import WorkerRegistry

    rng = random.Random(0)
    bs = args.block_size
    n_prefill = args.workers // 4
    roles = [Role.PREFILL if i < n_prefill else Role.DECODE for i in range(args.workers)]
    infos = [
        WorkerInfo(
            f"{roles[i]}-{i}",
            roles[i],
            f"10.0.0.{i}:5000",
            "m",
            "c",
            bs,
            capacity=Capacity(
                total_blocks=100_000,
                free_blocks=rng.randint(1_000, 100_000),
                running=rng.randint(0, 32),
                waiting=rng.randint(0, 4),
                queued_prefill_tokens=rng.randint(0, 8_000),
                prefill_tokens_per_s=rng.uniform(2_000, 20_000),
            ),
        )
        for i in range(args.workers)
    ]
    registry = WorkerRegistry(stale_after_s=1e9)
    registry.replace_all(infos)
    index = KVIndex()

    # Tenants: a shared system prompt each, cached (whole or in part) on a few workers.
    tenants = [
        [rng.randrange(50_000) for _ in range(args.system_tokens)] for _ in range(args.tenants)
    ]
    t0 = time.perf_counter()
    for t in tenants:
        hashes = PromptKey(t + [0]).hashes(bs)
        for w in rng.sample(infos, 3):
            index.stored(w.worker_id, hashes[: rng.randint(len(hashes) // 2, len(hashes))])
    # Filler: other cached blocks (random 32-byte hashes) until the index holds the target.
    per_worker = (args.blocks - len(index)) // len(infos) + 1
    for w in infos:
        index.stored(w.worker_id, [os.urandom(32) for _ in range(per_worker)])
    print(
        f"index: {len(index):,} blocks over {len(infos)} workers "
        f"({n_prefill} prefill, {len(infos) - n_prefill} decode), built in "
        f"{time.perf_counter() - t0:.1f}s"
    )

    prompts = [
        rng.choice(tenants) + [rng.randrange(50_000) for _ in range(args.question_tokens)]
        for _ in range(args.requests)
    ]
    for policy in ("affinity", "round_robin", "least_loaded"):
        placer = Placer(
            registry, index, make_policy(PlacementConfig(policy=policy, local_prefill_threshold=0))
        )
        hashing, deciding, total = [], [], []
        for ids in prompts:
            key = PromptKey(ids)
            a = time.perf_counter()
            key.hashes(bs)
            b = time.perf_counter()
            placement = placer.place(key)
            c = time.perf_counter()
            assert placement is not None
            hashing.append(b - a)
            deciding.append(c - b)
            total.append(c - a)
        print(
            f"\n{policy} ({len(prompts)} requests of {args.system_tokens}+{args.question_tokens} "
            "tokens)"
        )
        print(f"  block hashes ({(len(prompts[0]) - 1) // bs} blocks): {fmt_ms(hashing)}")
        print(f"  placement decision:          {fmt_ms(deciding)}")
        print(f"  hashes + decision:           {fmt_ms(total)}")


# ---- cluster workload --------------------------------------------------------------------------
class _Proc:
    def __init__(self, cmd: list[str], log_path: str) -> None:
        import subprocess

        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=open(log_path, "w"),
            text=True,
            env={**os.environ, "UCX_NET_DEVICES": "lo"},
        )
        self.log_path = log_path

    def wait_ready(self, timeout: float = 180.0) -> tuple[str, str]:
        """(gRPC address, metrics address) from the worker's READY line."""
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            if line.startswith("READY "):  # READY <role> <id> grpc=<addr> metrics=<addr>
                fields = dict(f.split("=", 1) for f in line.split()[3:])
                return fields["grpc"], fields["metrics"]
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"worker did not start; see {self.log_path}")

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except Exception:
            self.proc.kill()


def _start_router(
    etcd: str, policy: str, log_dir: str, token_file: str, *extra: str
) -> tuple[_Proc, str]:
    import sys

    import httpx

    from cluster.net import free_port

    port = free_port()
    proc = _Proc(
        [
            sys.executable,
            "-m",
            "pdserve",
            "router",
            "--etcd",
            etcd,
            "--port",
            str(port),
            "--policy",
            policy,
            "--log-level",
            "warning",
            "--cluster-token-file",
            token_file,
            "--enable-prompt-tokens-details",
            *extra,
        ],  # usage.cached_tokens is measured
        f"{log_dir}/router-{policy}.log",
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            h = httpx.get(url + "/health", timeout=1).json()
            if h.get("decode_workers", 0) >= 1 and h.get("prefill_workers", 0) >= 2:
                time.sleep(0.5)  # KV snapshots
                return proc, url
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError("router did not see the workers")


def _ttft(client, prompt: list[int], max_tokens: int) -> tuple[float, int, int]:
    """(seconds to the first token, prompt tokens, cached prompt tokens) of one streamed call."""
    t0, first, usage = time.perf_counter(), None, None
    for chunk in client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - t0
        usage = chunk.usage or usage
    return (
        first or time.perf_counter() - t0,
        usage.prompt_tokens,
        usage.prompt_tokens_details.cached_tokens,
    )


def _prefix_cache_tokens(metrics_addresses: list[str]) -> tuple[float, float]:
    """(hit tokens, looked-up tokens) summed over workers' prefix-cache counters."""
    import httpx

    hits = queries = 0.0
    for address in metrics_addresses:
        for line in httpx.get(f"http://{address}/metrics", timeout=5).text.splitlines():
            if line.startswith("pdserve_worker_prefix_cache_hits_tokens_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("pdserve_worker_prefix_cache_queries_tokens_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def _router_prefix_tokens(url: str) -> tuple[float, float]:
    import httpx

    values = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("pdserve_router_prefix_hit_tokens_total{"):
            values[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return values.get("predicted", 0.0), values.get("reported", 0.0)


def run_cluster_bench(args: argparse.Namespace) -> None:
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from cluster.etcd_server import EtcdServer
    from cluster.grpc_security import write_token_file

    log_dir = tempfile.mkdtemp(prefix="router-bench-")
    token_file = str(write_token_file(Path(log_dir) / "cluster-token"))  # as `pdserve up` does
    flags = [
        "--num-layers",
        str(args.num_layers),
        "--dtype",
        "float32",
        "--num-threads",
        "1",
        "--cluster-token-file",
        token_file,
    ]
    memory = {Role.PREFILL: args.prefill_kv_cache_memory, Role.DECODE: args.decode_kv_cache_memory}
    rng = random.Random(1)
    with EtcdServer() as etcd:
        import sys

        workers = [
            _Proc(
                [
                    sys.executable,
                    "-m",
                    "pdserve",
                    role,
                    "--etcd",
                    etcd.endpoint,
                    *flags,
                    "--kv-cache-memory",
                    memory[role],
                ],
                f"{log_dir}/{role}-{i}.log",
            )
            for i, role in enumerate([Role.PREFILL, Role.PREFILL, Role.DECODE])
        ]
        try:
            addresses = [w.wait_ready() for w in workers]
            prefill_metrics = [m for _, m in addresses[:2]]
            print(f"workers up (2 prefill + 1 decode, {args.num_layers} layers); logs in {log_dir}")
            for policy in args.policies.split(","):
                # Fresh tenants per policy: no run profits from another's cached prefixes.
                tenants = [
                    [rng.randrange(1000, 40000) for _ in range(args.system_tokens)]
                    for _ in range(args.tenants)
                ]
                requests = [
                    t + [rng.randrange(1000, 40000) for _ in range(rng.randint(16, 48))]
                    for _ in range(args.questions)
                    for t in rng.sample(tenants, len(tenants))
                ]
                router, url = _start_router(
                    etcd.endpoint,
                    policy,
                    log_dir,
                    token_file,
                    "--local-prefill-threshold",
                    "0",
                    "--local-prefill-max-tokens",
                    "0",
                )
                client = openai.OpenAI(
                    base_url=url + "/v1", api_key="x", max_retries=0, timeout=600
                )
                hits0, queries0 = _prefix_cache_tokens(prefill_metrics)
                t0 = time.perf_counter()
                with ThreadPoolExecutor(args.concurrency) as pool:
                    results = list(pool.map(lambda p: _ttft(client, p, args.max_tokens), requests))
                wall = time.perf_counter() - t0
                predicted, reported_tokens = _router_prefix_tokens(url)
                router.stop()
                hits1, queries1 = _prefix_cache_tokens(prefill_metrics)
                ttfts = [r[0] for r in results]
                reported = sum(r[2] for r in results) / sum(r[1] for r in results)
                pool = (hits1 - hits0) / max(1.0, queries1 - queries0)
                print(
                    f"{policy:>13}: prefill-pool prefix hit rate {pool:6.1%}  (usage cached "
                    f"{reported:6.1%})   TTFT p50 {pct(ttfts, 50):.3f} s   p90 "
                    f"{pct(ttfts, 90):.3f} s   ({len(requests)} requests in {wall:.1f} s; "
                    f"router predicted {predicted:.0f} cached tokens, workers reported "
                    f"{reported_tokens:.0f})"
                )
            if args.overhead_requests > 0:
                _router_overhead(etcd.endpoint, addresses[2][0], log_dir, token_file, args, rng)
        finally:
            for w in reversed(workers):
                w.stop()


def _router_overhead(
    etcd: str, decode_address: str, log_dir: str, token_file: str, args, rng
) -> None:
    """TTFT of short prompts through the router vs Generate on the decode worker directly."""
    import openai

    from cluster.grpc_auth import channel
    from cluster.grpc_security import GrpcSecurity, resolve
    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc as pb_grpc

    router, url = _start_router(etcd, "affinity", log_dir, token_file)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    auth = resolve(GrpcSecurity(cluster_token_file=token_file), {})
    stub = pb_grpc.DecodeWorkerStub(channel(decode_address, auth))
    direct, routed = [], []
    for i in range(args.overhead_requests + 5):
        prompt = [rng.randrange(1000, 40000) for _ in range(8)]  # under a block: no cache effects
        t0 = time.perf_counter()
        for _ in stub.Generate(
            pb.GenerateRequest(
                request_id=f"bench-{i}",
                prompt_token_ids=prompt,
                sampling=pb.SamplingParams(temperature=0, max_tokens=1),
            )
        ):
            break
        d = time.perf_counter() - t0
        r = _ttft(client, prompt, 1)[0]
        if i >= 5:  # warm-up
            direct.append(d)
            routed.append(r)
    router.stop()
    extra = [r - d for r, d in zip(routed, direct)]
    print(
        f"router overhead on TTFT ({len(extra)} sequential 8-token prompts): "
        f"p50 {statistics.median(extra) * 1e3:.2f} ms  p99 {pct(extra, 99) * 1e3:.2f} ms "
        f"(direct p50 {statistics.median(direct) * 1e3:.2f} ms, "
        f"routed p50 {statistics.median(routed) * 1e3:.2f} ms)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("decision", help="placement decision time (pure, no processes)")
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tenants", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=2000)
    p.set_defaults(func=bench_decision)
    p = sub.add_parser("cluster", help="multi-tenant workload over real processes, per policy")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--questions", type=int, default=12, help="questions per tenant")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument(
        "--prefill-kv-cache-memory",
        default="16MiB",
        help="per prefill worker: the default holds ~5 of 8 tenants' 1k-token prefixes "
        "(2 fp32 layers), so where each tenant goes matters",
    )
    p.add_argument("--decode-kv-cache-memory", default="64MiB")
    p.add_argument("--policies", default="affinity,round_robin,least_loaded")
    p.add_argument("--overhead-requests", type=int, default=50)
    p.set_defaults(func=run_cluster_bench)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
