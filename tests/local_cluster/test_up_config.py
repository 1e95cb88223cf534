"""`pdserve up`'s flags -> UpConfig -> the workers' and the router's command lines, checked by
parsing those command lines with the workers' and the router's own parsers (no processes)."""

import argparse
import dataclasses
import os
from dataclasses import dataclass
from ipaddress import ip_network
from pathlib import Path

import pytest

from cluster.chat_config import ChatConfig
from cluster.etcd_security import EtcdSecurity
from cluster.roles import ROLES, Role
from engine.config import EngineConfig, LoRAModule
from engine.flags import add_flags, from_args, option, to_argv
from local_cluster.config import UpConfig
from local_cluster.supervisor import Supervisor
from local_cluster.up import router_flags
from pdserve.cli import build_parser
from router.cli import config_from_args as router_config
from router.config import PlacementConfig, RouterConfig
from worker_runtime.args import WorkerConfig

ETCD = "127.0.0.1:1"
ENGINE = EngineConfig(
    model="/m",
    dtype="float32",
    device="cpu",
    block_size=32,
    kv_cache_memory=3 << 20,
    gpu_memory_utilization=0.5,
    max_model_len=512,
    max_num_seqs=4,
    max_num_batched_tokens=256,
    enable_prefix_caching=False,
    long_prefill_token_threshold=64,
    attention_backend="torch",
    num_layers=2,
    seed=7,
    generation_config="vllm",
    enforce_eager=True,
    speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    kv_cache_dtype="int8",
    enable_sleep_mode=True,
    worker_extension_cls="m:C",
    enable_lora=True,
    max_loras=2,
    max_lora_rank=8,
    max_cpu_loras=3,
    lora_modules=("a=/x", "b=/y"),
    max_grammar_bytes=4096,
    grammar_compile_timeout_s=2.5,
    grammar_compile_processes=2,
    grammar_compile_wait_s=3.5,
    max_grammar_repetitions=77,
)
ENGINES = [
    ENGINE,
    dataclasses.replace(
        ENGINE,
        enable_chunked_prefill=False,
        long_prefill_token_threshold=0,
        enable_prefix_caching=True,
        kv_offloading_size=1 << 20,
        kv_offloading_path="/nonexistent-tier",
    ),
    EngineConfig(
        model="/m", tensor_parallel_size=2, enable_expert_parallel=True, distributed_timeout_s=7.0
    ),
    EngineConfig(model="/m", device="cuda", cuda_graph_sizes=(1, 8)),
]
"""Between them, every EngineConfig field off its default (the threshold needs chunked
prefill on, the KV offloading tier prefix caching; tensor parallelism refuses LoRA, sleep
mode and offloading, so it has its own; CUDA graph sizes need graphs: not with enforce_eager)."""


def parse_up(*flags: str) -> UpConfig:
    return from_args(UpConfig, build_parser().parse_args(["up", *flags]))


def supervisor(config: UpConfig) -> Supervisor:
    return Supervisor(config, ETCD, Path("/nonexistent-logs"))


def started(cmd: list[str]) -> tuple[WorkerConfig, EngineConfig]:
    """The configs a worker command line gives, parsed as `pdserve <role>` parses it."""
    args = build_parser().parse_args(cmd)
    return from_args(WorkerConfig, args, role=cmd[0]), EngineConfig.from_args(args)


def test_every_engine_flag_of_up_reaches_the_workers_of_both_roles():
    default = EngineConfig()
    assert not [
        f.name
        for f in dataclasses.fields(EngineConfig)
        if all(getattr(e, f.name) == getattr(default, f.name) for e in ENGINES)
    ]
    for engine in ENGINES:
        up = UpConfig(engine=engine, prefill=1)
        config = parse_up(*to_argv(up), "--cluster", "c", "--num-threads", "3")
        assert config.engine == engine
        for role in ROLES:
            cmd = supervisor(config).worker_command(role)
            assert cmd[0] == role
            worker, got = started(cmd)
            # With enable_sleep_mode or enable_lora on, the cluster calls the admin RPCs.
            assert worker == WorkerConfig(
                role=role,
                etcd=ETCD,
                cluster="c",
                num_threads=3,
                enable_admin_rpcs=engine.enable_sleep_mode or engine.enable_lora,
                allowed_model_paths=("/m", *(m.path for m in engine.lora_modules)),
            )
            # Prefill workers never speculate: they are not even given the flag.
            want = (
                engine
                if role == Role.DECODE
                else dataclasses.replace(engine, speculative_config=None)
            )
            assert got == want
            assert ("--speculative-config" in cmd) == (
                role == Role.DECODE and engine.speculative_config is not None
            )


def test_defaults_are_not_passed_and_threads_are_shared_out():
    sup = supervisor(parse_up("--cluster", "c"))
    for role in ROLES:
        sup.add_slot(role, spawn=lambda: None)
    threads = str(max(1, (os.cpu_count() or 2) // 2))  # cores / workers
    assert sup.worker_command(Role.DECODE) == [
        "decode",
        "--etcd",
        ETCD,
        "--cluster",
        "c",
        "--num-threads",
        threads,
        "--allowed-model-paths",
        str(Path("default").absolute()),  # `up` resolves the model first (its folder then)
    ]


@pytest.mark.parametrize(
    "flags, admin",
    [
        ((), False),
        (("--planner",), True),
        (("--enable-sleep-mode",), True),
        (("--enable-lora",), True),
        (("--worker-arg=--enable-admin-rpcs",), True),
    ],
)
def test_workers_serve_admin_rpcs_only_when_the_cluster_calls_them(flags, admin):
    cmd = supervisor(parse_up(*flags)).worker_command(Role.PREFILL)
    worker, _ = started(cmd)
    assert worker.enable_admin_rpcs is admin


def test_workers_may_read_only_the_model_and_adapter_directories(tmp_path):
    """Without roots a worker reads any adapter or weights path a caller names (issue 51):
    `up` confines its workers to the model's directory, the adapters' and the ones given."""
    gguf = tmp_path / "models" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    config = parse_up(
        "--model",
        str(gguf),
        "--enable-lora",
        "--lora-modules",
        f"sql={tmp_path / 'adapters' / 'sql'}",
        "--allowed-model-paths",
        "more",
    )
    want = (str(gguf.parent), str(tmp_path / "adapters" / "sql"), str(Path("more").absolute()))
    assert config.model_roots == want
    for role in ROLES:
        worker, _ = started(supervisor(config).worker_command(role))
        assert worker.allowed_model_paths == want
    hf = parse_up("--model", str(tmp_path))
    assert hf.model_roots == (str(tmp_path),)
    # A --worker-arg comes later, so it still wins.
    cmd = supervisor(parse_up("--worker-arg=--allowed-model-paths=/x")).worker_command(Role.DECODE)
    assert started(cmd)[0].allowed_model_paths == ("/x",)


def test_generate_api_key_makes_a_0600_key_file_for_the_router(tmp_path):
    from local_cluster.up import client_key

    assert client_key(parse_up(), tmp_path) == parse_up()  # opt-in: nothing made
    assert not (tmp_path / "api-key").exists()
    config = client_key(parse_up("--generate-api-key"), tmp_path)
    made = tmp_path / "api-key"
    assert config.api_key_file == str(made) and made.stat().st_mode & 0o777 == 0o600
    key = made.read_text().strip()
    argv = router_flags(config, ETCD, 9000)
    assert key not in " ".join(argv)  # by file, never on the command line
    router = router_config(build_parser().parse_args(["router", *argv]))
    assert router.api_key_file == str(made)
    from router.http.auth import Keys, resolve_keys

    assert resolve_keys(router, {}) == Keys.of([key])  # long enough, not a placeholder
    with pytest.raises(ValueError, match="is exclusive with --api-key-file"):
        parse_up("--generate-api-key", "--api-key-file", "k.txt")


def test_worker_args_then_role_args_come_last_so_they_win():
    config = parse_up(
        "--kv-cache-dtype",
        "int8",
        "--worker-arg=--kv-cache-dtype=fp8",
        "--worker-arg=--dtype=float32",
        "--decode-arg=--kv-cache-dtype=auto",
        "--prefill-arg=--kv-timeout=5",
    )
    sup = supervisor(config)
    decode, prefill = sup.worker_command(Role.DECODE), sup.worker_command(Role.PREFILL)
    assert decode[-3:] == ["--kv-cache-dtype=fp8", "--dtype=float32", "--kv-cache-dtype=auto"]
    assert started(decode)[1].kv_cache_dtype == "auto"
    assert prefill[-3:] == ["--kv-cache-dtype=fp8", "--dtype=float32", "--kv-timeout=5"]
    worker, engine = started(prefill)
    assert (engine.kv_cache_dtype, engine.dtype, worker.kv_timeout_s) == ("fp8", "float32", 5.0)


def test_a_new_engine_flag_reaches_up_and_its_workers_without_an_edit_in_local_cluster():
    @dataclass(frozen=True)
    class NewEngineConfig(EngineConfig):
        new_knob: int = 0
        """A flag local_cluster has never heard of."""

    @dataclass(frozen=True)
    class NewUpConfig(UpConfig):
        engine: NewEngineConfig = option(default_factory=NewEngineConfig, group="engine")

    up_parser = argparse.ArgumentParser()
    add_flags(up_parser, NewUpConfig)
    config = from_args(NewUpConfig, up_parser.parse_args(["--new-knob", "7", "--seed", "3"]))
    assert config.engine == NewEngineConfig(new_knob=7, seed=3)
    worker_parser = argparse.ArgumentParser()
    add_flags(worker_parser, WorkerConfig)
    add_flags(worker_parser, NewEngineConfig)
    for role in ROLES:
        cmd = supervisor(config).worker_command(role)
        assert cmd[cmd.index("--new-knob") + 1] == "7"
        assert from_args(NewEngineConfig, worker_parser.parse_args(cmd[1:])) == config.engine


def test_the_router_gets_the_cluster_the_model_and_what_the_engine_flags_ask_of_it():
    def router(config: UpConfig) -> RouterConfig:
        return router_config(
            build_parser().parse_args(["router", *router_flags(config, ETCD, 9000)])
        )

    loopback = (ip_network("127.0.0.0/8"), ip_network("::1/128"))
    assert router(parse_up()) == RouterConfig(etcd=ETCD, port=9000, allowed_worker_cidrs=loopback)
    config = parse_up(
        "--cluster",
        "c",
        "--host",
        "0.0.0.0",
        "--model",
        "/m",
        "--enable-lora",
        "--lora-modules",
        "a=/x",
        "--max-loras",
        "2",
        "--enable-sleep-mode",
        "--router-arg=--policy=round_robin",
    )
    assert router(config) == RouterConfig(
        etcd=ETCD,
        cluster="c",
        host="0.0.0.0",
        port=9000,
        model="/m",
        enable_lora=True,
        lora_modules=(LoRAModule("a", "/x"),),
        enable_dev_endpoints=True,
        placement=PlacementConfig(policy="round_robin"),
        allowed_worker_cidrs=loopback,
    )
    wide = parse_up("--router-arg=--allowed-worker-cidrs", "--router-arg=10.0.0.0/8")
    assert router(wide).allowed_worker_cidrs == (ip_network("10.0.0.0/8"),)  # a later flag wins
    assert router(parse_up("--enable-lora")).enable_lora
    limited = router(
        parse_up("--grammar-compile-timeout", "2.5", "--max-grammar-bytes", "4KiB")
    ).limits
    assert (limited.grammar_compile_timeout_s, limited.max_grammar_bytes) == (2.5, 4096)
    assert router(parse_up("--grammar-compile-timeout", "0")).limits.grammar_compile_timeout_s == 10
    assert router(parse_up("--max-grammar-repetitions", "50")).limits.max_grammar_repetitions == 50
    keyed = router(parse_up("--api-key-file", "k.txt", "--admin-api-key-file", "/a.txt"))
    assert (keyed.api_key_file, keyed.admin_api_key_file) == (
        str(Path("k.txt").resolve()),
        "/a.txt",
    )
    assert keyed.api_key == ()  # the key itself is never on the router's command line
    chat = router(
        parse_up(
            "--chat-template",
            "examples/tool_chat_template_chatml.jinja",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
        )
    ).chat
    assert chat == ChatConfig(
        chat_template=str(Path("examples/tool_chat_template_chatml.jinja").resolve()),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
    )


def test_bad_up_flags_are_refused_by_name_before_anything_starts(capsys):
    from pdserve.cli import main

    for flags, message in [
        (["--lora-modules", "a=/x"], "--lora-modules: lora_modules needs enable_lora"),
        (["--restart-window", "0"], "--restart-window: window must be > 0, got 0.0"),
        (["--decode", "-1"], "--decode: decode must be >= 0, got -1"),
        (
            ["--enable-auto-tool-choice"],
            "--enable-auto-tool-choice: enable_auto_tool_choice needs --tool-call-parser",
        ),
        (["--kv-cache-memory", "0"], "--kv-cache-memory: kv_cache_memory must be > 0, got 0"),
        (["--router-arg=--api-key=secret"], "--router-arg: router_args --api-key would put a key"),
        (["--router-arg=--admin-api-key"], "--router-arg: router_args --admin-api-key would put"),
        (["--etcd-user", "u"], "--etcd-user apply to an etcd given with --etcd"),
        (
            ["--etcd", ETCD, "--etcd-password-file", "p"],
            "--etcd-password-file: etcd_password_file needs --etcd-user",
        ),
        (["--etcd", ETCD, "--etcd-key", "k"], "--etcd-key: etcd_key needs --etcd-cert"),
        (
            ["--etcd", ETCD, "--etcd-cert", "c", "--etcd-key", "k"],
            "--etcd-cert: etcd_cert needs --etcd-ca",
        ),
        (["--etcd", ETCD, "--etcd-user", ""], "--etcd-user: etcd_user must not be empty"),
        (
            ["--etcd", ETCD, "--etcd-user", "u"],
            "--etcd-user u needs its password: --etcd-password-file or PDSERVE_ETCD_PASSWORD",
        ),
    ]:
        assert main(["up", *flags]) == 2
        assert f"pdserve up: error: {message}" in capsys.readouterr().err


def test_the_etcd_users_reach_the_workers_and_the_router_as_paths():
    """`up` hands its workers one etcd user and its router another, as flags naming 0600
    password files (never the password); with --etcd, the given flags go to every process,
    and without it they are refused by name (its own etcd has generated users)."""
    worker, router = (
        EtcdSecurity("w", "/run/w.password"),
        EtcdSecurity("r", "/run/r.password", etcd_ca="/ca.pem"),
    )
    sup = Supervisor(parse_up(), ETCD, Path("/nonexistent-logs"), worker, router)
    for role in ROLES:
        assert started(sup.worker_command(role))[0].etcd_security == worker
    flags = router_flags(sup.config, ETCD, 9000, router)
    parsed = router_config(build_parser().parse_args(["router", *flags]))
    assert parsed.etcd_security == router
    given = parse_up("--etcd", ETCD, "--etcd-user", "u", "--etcd-password-file", "p")
    assert given.etcd_security == EtcdSecurity("u", "p")


def test_the_cluster_token_reaches_every_worker_and_the_router_as_a_file(tmp_path, monkeypatch):
    from cluster.grpc_security import TOKEN_ENV, GrpcSecurity
    from local_cluster.up import cluster_security

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    # No token given: `up` makes one for this cluster, 0600, in its run directory.
    config, auth = cluster_security(parse_up(), tmp_path)
    made = tmp_path / "cluster-token"
    assert config.grpc_security == GrpcSecurity(cluster_token_file=str(made))
    assert made.stat().st_mode & 0o777 == 0o600
    assert auth.token == made.read_text().strip() and len(auth.token) >= 32
    for role in ROLES:
        cmd = supervisor(config).worker_command(role)
        assert started(cmd)[0].grpc_security == config.grpc_security
        assert auth.token not in " ".join(cmd)
    router = router_config(build_parser().parse_args(["router", *router_flags(config, ETCD, 9000)]))
    assert router.grpc_security == config.grpc_security

    # The user's file (and TLS files), by absolute path; no token is made.
    user = tmp_path / "mine"
    user.write_text("user-token-0123456789abcdef\n")
    pem = {}
    for name in ("cert", "key", "ca"):
        pem[name] = tmp_path / f"{name}.pem"
        pem[name].write_text(f"-----BEGIN {name}-----\n")
    given = parse_up(
        "--cluster-token-file",
        os.path.relpath(user),
        "--tls-server-name",
        "w",
        *(a for n, p in pem.items() for a in (f"--tls-{n}", os.path.relpath(p))),
    )
    config, auth = cluster_security(given, tmp_path / "unused")
    assert config.grpc_security == GrpcSecurity(
        cluster_token_file=str(user),
        tls_cert=str(pem["cert"]),
        tls_key=str(pem["key"]),
        tls_ca=str(pem["ca"]),
        tls_server_name="w",
    )
    assert auth.token == "user-token-0123456789abcdef" and auth.tls.server_name == "w"
    cmd = supervisor(config).worker_command(Role.DECODE)
    assert started(cmd)[0].grpc_security == config.grpc_security
    # PDSERVE_CLUSTER_TOKEN in `up`'s environment: the children inherit it; no file is made.
    monkeypatch.setenv(TOKEN_ENV, "env-token-0123456789abcdef")
    config, auth = cluster_security(parse_up(), tmp_path / "unused")
    assert config.grpc_security == GrpcSecurity() and auth.source == TOKEN_ENV
    assert not (tmp_path / "unused").exists()


def test_a_bad_cluster_token_file_stops_up_before_anything_starts(tmp_path, capsys):
    from pdserve.cli import main

    empty = tmp_path / "token"
    empty.write_text("")
    assert main(["up", "--cluster-token-file", str(empty)]) == 2
    assert (
        f"pdserve up: error: --cluster-token-file {empty}: the file is empty"
        in capsys.readouterr().err
    )


def test_up_starts_prefill_workers_at_tensor_parallel_size_2_when_asked():
    assert parse_up("-tp", "2", "--prefill", "1").prefill == 1  # KV moves between any sizes
    assert parse_up("-tp", "2", "--prefill", "0").engine.tensor_parallel_size == 2
    assert parse_up("-tp", "2").prefill == 0  # the default at tensor parallelism


@pytest.mark.parametrize(
    "cores,flags,prefill",
    [
        (2, [], 0),  # a small host: one colocated decode worker with both cores
        (1, [], 0),
        (4, [], 1),
        (2, ["--planner"], 1),  # the planner moves workers between the roles: one of each
        (2, ["--prefill", "1"], 1),  # given: kept
        (8, ["--prefill", "0"], 0),
    ],
)
def test_the_default_prefill_pool_follows_the_hosts_cores(monkeypatch, cores, flags, prefill):
    from local_cluster import config as up_config

    monkeypatch.setattr(up_config, "host_cores", lambda: cores)
    up = parse_up(*flags)
    assert (up.prefill, up.decode) == (prefill, 1)
    assert dataclasses.replace(up, port=0).prefill == prefill  # resolved once, kept
