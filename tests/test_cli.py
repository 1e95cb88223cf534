"""The `pdserve` command end to end (offline parts)."""

import subprocess
import sys


def _pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_answers_the_capital_of_france():
    out = _pdserve(
        "generate",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "16",
        "--kv-cache-memory",
        "64MiB",
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_help_lists_every_subcommand_without_loading_torch():
    out = _pdserve("--help")
    assert out.returncode == 0
    for command in (
        "prepare-model",
        "generate",
        "prefill",
        "decode",
        "role",
        "etcd-users",
        "router",
        "up",
        "scale",
        "status",
        "bench",
    ):
        assert command in out.stdout
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, pdserve.cli as c; c.build_parser(); "
            "print(sorted(m for m in ('torch', 'grpc', 'fastapi') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == "[]"


def test_bad_model_path_is_a_clear_error():
    out = _pdserve("generate", "--prompt", "hi", "--model", "/nonexistent/model")
    assert out.returncode == 2 and "model path does not exist" in out.stderr


def test_up_refuses_a_malformed_speculative_config_before_starting_anything():
    # the model path is checked after the config: a passing config would fail on it instead
    out = _pdserve(
        "up",
        "--model",
        "/nonexistent/model",
        "--speculative-config",
        '{"method": "eagle", "num_speculative_tokens": 2}',
    )
    assert out.returncode == 2 and "method must be one of" in out.stderr, out.stderr


def test_prefill_role_drops_the_speculative_config_with_one_warning(caplog):
    from engine.config import EngineConfig
    from pdserve.worker_main import engine_config_for_role

    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert engine_config_for_role("decode", config) is config
    with caplog.at_level("WARNING"):
        prefill = engine_config_for_role("prefill", config)
    assert prefill.speculative_config is None
    assert prefill == EngineConfig(speculative_config=None)
    [record] = caplog.records
    assert "ignoring --speculative-config" in record.getMessage()


def test_role_names_an_unreachable_worker_and_refuses_a_negative_drain_timeout():
    from cluster.net import free_port

    address = f"127.0.0.1:{free_port()}"
    out = _pdserve("role", "--worker", address, "decode", "--timeout", "3")
    assert out.returncode == 1 and f"pdserve role: {address}: UNAVAILABLE" in out.stderr
    out = _pdserve("role", "--worker", address, "decode", "--drain-timeout", "-1")
    assert out.returncode == 2 and "--drain-timeout must be >= 0" in out.stderr
    out = _pdserve("role", "--worker", address, "both")
    assert out.returncode == 2 and "invalid choice: 'both'" in out.stderr


def test_every_config_flag_of_the_service_commands_says_what_it_does():
    """Their flags come from config fields (engine.flags): a field without a docstring would be
    a flag without help."""
    import argparse

    from pdserve.cli import build_parser

    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for command in ("prefill", "decode", "router", "up", "etcd-users"):
        undocumented = [
            a.option_strings[0]
            for a in sub.choices[command]._actions
            if a.option_strings and a.dest != "help" and not a.help
        ]
        assert not undocumented, command


def test_abbreviated_flags_are_refused_so_a_secret_is_never_taken_for_a_path(capsys):
    """`--cluster-token S` is not `--cluster-token-file S`, nor `--etcd-password P`
    `--etcd-password-file P`: abbreviations are off in every subcommand (as in vLLM)."""
    import pytest

    from pdserve.cli import build_parser

    for argv in (
        ["router", "--etcd", "h:1", "--cluster-token", "s3cret-token-value"],
        ["decode", "--etcd", "h:1", "--etcd-user", "u", "--etcd-password", "pw"],
        ["up", "--cluster-token", "s3cret-token-value"],
        ["router", "--etcd", "h:1", "--max-concurrent-requests", "3"],
    ):
        with pytest.raises(SystemExit) as refused:
            build_parser().parse_args(argv)
        assert refused.value.code == 2, argv
        assert "unrecognized arguments" in capsys.readouterr().err
