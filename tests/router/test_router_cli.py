"""`pdserve router`: cheap to import, every config field has a flag, help is true to the code."""

import dataclasses
import subprocess
import sys
from ipaddress import ip_network
from pathlib import Path

import pytest

from cluster.etcd_security import EtcdSecurity
from cluster.grpc_security import GrpcSecurity
from engine.config import LoRAModule
from engine.flags import to_argv
from pdserve.cli import build_parser, main
from router.cli import config_from_args
from router.config import LimitsConfig, PlacementConfig, RouterConfig
from router.endpoint_picker.config import EndpointPickerConfig
from router.http.allowed_hosts import HostRule

REPO = Path(__file__).resolve().parents[2]


# The engine's torch-free config modules the router's flags and config come from.
ENGINE_CONFIG_MODULES = {
    "engine",
    "engine.checks",
    "engine.flags",
    "engine.config",
    "engine.spec_decode",
    "engine.spec_decode.config",
}


def test_importing_the_cli_loads_no_heavy_stack():
    code = (
        "import sys, router.cli; heavy = [m for m in sys.modules if m.split('.')[0] in "
        f"('grpc', 'fastapi', 'uvicorn', 'torch', 'aetcd') or (m.split('.')[0] == 'engine' "
        f"and m not in {sorted(ENGINE_CONFIG_MODULES)})]; assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_flags_reach_the_config():
    args = build_parser().parse_args(
        [
            "router",
            "--etcd",
            "h:1",
            "--cluster",
            "c",
            "--port",
            "9",
            "--policy",
            "round_robin",
            "--api-key",
            "k",
            "--prefix-weight",
            "2",
            "--load-weight",
            "3",
            "--load-scale",
            "4",
            "--kv-weight",
            "5",
            "--local-prefill-threshold",
            "6",
            "--local-prefill-max-tokens",
            "10",
            "--itl-slo-ms",
            "100",
            "--prefill-queue-limit",
            "7",
            "--default-prefill-rate",
            "8",
            "--max-waiting-per-worker",
            "9",
            "--queue-timeout",
            "1.5",
            "--max-queued-requests",
            "11",
            "--max-retries",
            "2",
            "--stale-after",
            "3.5",
            "--max-migrations",
            "5",
            "--first-token-timeout",
            "7.5",
            "--stall-timeout",
            "9.5",
            "--max-model-len",
            "100",
            "--served-model-name",
            "m",
            "--max-n",
            "4",
            "--host",
            "0.0.0.0",
            "--allowed-hosts",
            "llm.example, [::1]:8443",
            "--model",
            "/some/dir",
            "--generation-config",
            "vllm",
            "--enable-lora",
            "--lora-modules",
            "a=/x",
            "b=/y",
            "--lora-weight",
            "0.25",
            "--lora-load-time",
            "0.5",
            "--no-kv-pull",
            "--default-kv-pull-rate",
            "300",
            "--default-kv-pull-overhead",
            "0.02",
            "--default-kv-promote-time",
            "0.002",
            "--enable-dev-endpoints",
            "--api-key-file",
            "/keys",
            "--admin-api-key",
            "a1",
            "a2",
            "--admin-api-key-file",
            "/admin",
            "--enable-prompt-tokens-details",
            "--cache-salt-from-api-key",
            "--max-request-body-bytes",
            "2MiB",
            "--request-header-timeout",
            "1",
            "--request-body-timeout",
            "2",
            "--limit-concurrency",
            "3",
            "--timeout-keep-alive",
            "4",
            "--max-prompt-chars",
            "5",
            "--max-prompts-per-request",
            "6",
            "--max-choices-per-request",
            "7",
            "--max-stop-strings",
            "8",
            "--max-bad-words",
            "9",
            "--max-logit-bias",
            "10",
            "--max-grammar-bytes",
            "11",
            "--grammar-compile-timeout",
            "12",
            "--grammar-compile-processes",
            "13",
            "--tokenizer-threads",
            "14",
            "--max-concurrent-requests-per-key",
            "15",
            "--max-tokens-per-minute-per-key",
            "16",
            "--grammar-compile-wait",
            "17",
            "--max-grammar-repetitions",
            "18",
            "--max-compile-seconds-per-minute-per-key",
            "19",
            "--allowed-worker-cidrs",
            "10.0.0.0/8",
            "::1",
            "--etcd-user",
            "u",
            "--etcd-password-file",
            "/pw",
            "--etcd-ca",
            "/ca",
            "--etcd-cert",
            "/c",
            "--etcd-key",
            "/k",
            "--cluster-token-file",
            "/t",
            "--tls-cert",
            "/tc",
            "--tls-key",
            "/tk",
            "--tls-ca",
            "/ta",
            "--tls-server-name",
            "w",
            "--enable-response-store",
            "--response-store-max-entries",
            "17",
            "--response-store-max-bytes",
            "1MiB",
            "--chat-template",
            "/t.jinja",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--tool-parser-plugin",
            "/p.py",
            "--reasoning-parser",
            "qwen3",
            "--endpoint-picker-port",
            "9002",
            "--endpoint-picker-endpoint",
            "10.0.0.7:9",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.placement == PlacementConfig(
        policy="round_robin",
        prefix_weight=2,
        load_weight=3,
        kv_weight=5,
        load_scale=4,
        local_prefill_threshold=6,
        local_prefill_max_tokens=10,
        itl_slo_ms=100,
        prefill_queue_limit=7,
        default_prefill_rate=8,
        max_waiting_per_worker=9,
        lora_weight=0.25,
        lora_load_s=0.5,
        kv_pull=False,
        default_kv_pull_rate=300,
        default_kv_pull_overhead_s=0.02,
        default_kv_promote_s=0.002,
    )
    assert cfg.limits == LimitsConfig(
        max_request_body_bytes=2 << 20,
        request_header_timeout_s=1,
        request_body_timeout_s=2,
        limit_concurrency=3,
        timeout_keep_alive_s=4,
        max_prompt_chars=5,
        max_prompts_per_request=6,
        max_choices_per_request=7,
        max_stop_strings=8,
        max_bad_words=9,
        max_logit_bias=10,
        max_grammar_bytes=11,
        grammar_compile_timeout_s=12,
        grammar_compile_processes=13,
        tokenizer_threads=14,
        max_concurrent_requests_per_key=15,
        max_tokens_per_minute_per_key=16,
        grammar_compile_wait_s=17,
        max_grammar_repetitions=18,
        max_compile_seconds_per_minute_per_key=19,
    )
    assert cfg.etcd_security == EtcdSecurity(
        "u", "/pw", etcd_ca="/ca", etcd_cert="/c", etcd_key="/k"
    )
    assert cfg.grpc_security == GrpcSecurity("/t", "/tc", "/tk", "/ta", "w")
    assert cfg.endpoint_picker == EndpointPickerConfig(9002, "10.0.0.7:9")
    assert cfg.allowed_worker_cidrs == (ip_network("10.0.0.0/8"), ip_network("::1/128"))
    assert cfg.enable_lora and cfg.enable_dev_endpoints
    assert cfg.allowed_hosts == (HostRule("llm.example"), HostRule("::1", 8443))
    assert cfg.lora_modules == (LoRAModule("a", "/x"), LoRAModule("b", "/y"))
    assert (cfg.api_key_file, cfg.admin_api_key, cfg.admin_api_key_file) == (
        "/keys",
        ("a1", "a2"),
        "/admin",
    )
    assert cfg.enable_prompt_tokens_details and cfg.cache_salt_from_api_key
    assert (
        cfg.enable_response_store,
        cfg.response_store_max_entries,
        cfg.response_store_max_bytes,
    ) == (True, 17, 1 << 20)
    assert (
        cfg.chat.chat_template,
        cfg.chat.enable_auto_tool_choice,
        cfg.chat.tool_call_parser,
        cfg.chat.tool_parser_plugin,
        cfg.chat.reasoning_parser,
    ) == ("/t.jinja", True, "hermes", "/p.py", "qwen3")
    assert (
        cfg.etcd,
        cfg.cluster,
        cfg.port,
        cfg.api_key,
        cfg.queue_timeout_s,
        cfg.max_queued_requests,
        cfg.max_retries,
        cfg.stale_after_s,
        cfg.max_model_len,
        cfg.served_model_name,
        cfg.max_n,
        cfg.generation_config,
        cfg.max_migrations,
        cfg.first_token_timeout_s,
        cfg.stall_timeout_s,
    ) == ("h:1", "c", 9, ("k",), 1.5, 11, 2, 3.5, 100, "m", 4, "vllm", 5, 7.5, 9.5)
    # Defaults on the command line are the dataclasses' defaults.
    default = config_from_args(build_parser().parse_args(["router", "--etcd", "h:1"]))
    assert default == RouterConfig(etcd="h:1")
    # Every field has a flag: each one above moved its field off the default.
    for f in dataclasses.fields(RouterConfig):
        if f.name not in ("etcd", "placement", "limits", "etcd_security", "grpc_security"):
            assert getattr(cfg, f.name) != getattr(default, f.name), f.name
    for f in dataclasses.fields(PlacementConfig):
        assert getattr(cfg.placement, f.name) != getattr(default.placement, f.name), f.name
    for nested, config_class in (("etcd_security", EtcdSecurity), ("grpc_security", GrpcSecurity)):
        for f in dataclasses.fields(config_class):
            assert getattr(getattr(cfg, nested), f.name) != getattr(
                getattr(default, nested), f.name
            ), (nested, f.name)
    for f in dataclasses.fields(LimitsConfig):
        assert getattr(cfg.limits, f.name) != getattr(default.limits, f.name), f.name
    # ... and the flags that reproduce a config give it back.
    assert config_from_args(build_parser().parse_args(["router", *to_argv(cfg)])) == cfg


def test_help_and_bad_values(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["router", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--etcd",
        "--policy",
        "--api-key",
        "--local-prefill-threshold",
        "--queue-timeout",
        "--endpoint-picker-port",
        "--endpoint-picker-endpoint",
    ):
        assert flag in out
    assert main(["router", "--etcd", "h:1", "--load-scale", "0"]) == 2
    assert "--load-scale: load_scale must be > 0, got 0.0" in capsys.readouterr().err
    assert main(["router", "--etcd", "h:1", "--lora-modules", "nopath"]) == 2
    assert "--lora-modules: lora_modules must be name=path, got 'nopath'" in capsys.readouterr().err
    assert main(["router", "--etcd", "h:1", "--endpoint-picker-endpoint", "router"]) == 2
    assert "--endpoint-picker-endpoint: endpoint must be IP:PORT" in capsys.readouterr().err
    assert (
        main(["router", "--etcd", "h:1", "--host", "0.0.0.0", "--endpoint-picker-port", "9002"])
        == 2
    )
    assert "needs --endpoint-picker-endpoint when --host is a wildcard" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["router"])  # --etcd is required
