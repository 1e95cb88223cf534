"""compose/: the file is valid for docker-compose (no engine runs here, so `config` is the
check) and has the topology the README promises; the router publishes on the host's loopback
only and gets its API key from PDSERVE_API_KEY, and the router and every worker the cluster
token from PDSERVE_CLUSTER_TOKEN; etcd runs with users, made by the one-shot etcd-users
service before the router and the workers start, each of which gets its own etcd user and
password from the environment (compose refuses to start without any of these)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

COMPOSE = Path(__file__).resolve().parents[1] / "compose"
TEST_KEY = "compose-test-key-0123456789"
TEST_TOKEN = "compose-test-cluster-token-0123456789"
ETCD_PASSWORDS = {
    "PDSERVE_ETCD_ROOT_PASSWORD": "compose-test-etcd-root-0123456789",
    "PDSERVE_ETCD_WORKER_PASSWORD": "compose-test-etcd-worker-0123456789",
    "PDSERVE_ETCD_ROUTER_PASSWORD": "compose-test-etcd-router-0123456789",
}
GRAFANA_PASSWORD = "compose-test-grafana-0123456789"
SECRETS = (
    "PDSERVE_API_KEY",
    "PDSERVE_CLUSTER_TOKEN",
    "PDSERVE_GRAFANA_ADMIN_PASSWORD",
    "PDSERVE_SUBNET",
    *ETCD_PASSWORDS,
)


def _compose(
    *args: str,
    key: str | None = TEST_KEY,
    token: str | None = TEST_TOKEN,
    grafana: str | None = GRAFANA_PASSWORD,
    **etcd_passwords: str | None,
) -> subprocess.CompletedProcess:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (scripts/test.sh installs Debian's as root)")
    env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    given = {
        "PDSERVE_API_KEY": key,
        "PDSERVE_CLUSTER_TOKEN": token,
        "PDSERVE_GRAFANA_ADMIN_PASSWORD": grafana,
        **ETCD_PASSWORDS,
        **etcd_passwords,
    }
    env.update({name: value for name, value in given.items() if value is not None})
    return subprocess.run(
        [exe, "-f", "docker-compose.yml", *args],
        cwd=COMPOSE,
        env=env,
        capture_output=True,
        text=True,
    )


def _config() -> dict:
    quiet = _compose("config", "-q")
    assert quiet.returncode == 0, quiet.stderr
    full = _compose("config")
    assert full.returncode == 0, full.stderr
    return yaml.safe_load(full.stdout)


def _host_ip(port) -> str | None:
    return port.get("host_ip") if isinstance(port, dict) else port.split(":")[0]


def test_router_on_loopback_with_its_key_from_the_environment():
    """Before: a keyless router published on every interface ("8000:8000")."""
    router = _config()["services"]["router"]
    [port] = router["ports"]
    assert _host_ip(port) == "127.0.0.1"
    assert router["environment"]["PDSERVE_API_KEY"] == TEST_KEY  # the router reads it itself
    assert not any("api-key" in a or TEST_KEY in a for a in router["command"])
    for empty in (None, ""):
        refused = _compose("config", "-q", key=empty)
        assert refused.returncode != 0 and "set PDSERVE_API_KEY" in refused.stderr, refused.stderr


def test_the_router_and_every_worker_get_the_cluster_token_from_the_environment():
    services = _config()["services"]
    for name in ("router", "prefill", "decode"):
        assert services[name]["environment"]["PDSERVE_CLUSTER_TOKEN"] == TEST_TOKEN
        assert not any("cluster-token" in a or TEST_TOKEN in a for a in services[name]["command"])
    for empty in (None, ""):
        refused = _compose("config", "-q", token=empty)
        assert refused.returncode != 0 and "set PDSERVE_CLUSTER_TOKEN" in refused.stderr, (
            refused.stderr
        )


def _argv(service: dict) -> str:
    command = service.get("command", [])
    return command if isinstance(command, str) else " ".join(command)


def test_etcd_users_runs_once_etcd_is_healthy_and_before_the_router_and_workers():
    services = _config()["services"]
    init = services["etcd-users"]
    assert init["command"][:2] == ["pdserve", "etcd-users"]
    assert "--etcd etcd:2379 --cluster default" in _argv(init)
    assert init["depends_on"] == {"etcd": {"condition": "service_healthy"}}
    assert init.get("restart") == "no"  # one-shot: not restarted after it exits 0
    assert init["environment"] == ETCD_PASSWORDS  # root's password reaches it alone
    for name in ("router", "prefill", "decode"):
        assert services[name]["depends_on"] == {
            "etcd-users": {"condition": "service_completed_successfully"}
        }, name
    assert "--bcrypt-cost=10" in services["etcd"]["command"]  # etcd's default, for your passwords


def test_the_router_and_every_worker_get_their_own_etcd_user_from_the_environment():
    services = _config()["services"]
    users = {
        "router": ("pdserve-router", "PDSERVE_ETCD_ROUTER_PASSWORD"),
        "prefill": ("pdserve-worker", "PDSERVE_ETCD_WORKER_PASSWORD"),
        "decode": ("pdserve-worker", "PDSERVE_ETCD_WORKER_PASSWORD"),
    }
    for name, (user, variable) in users.items():
        env = services[name]["environment"]
        assert f"--etcd-user {user}" in _argv(services[name]), name
        assert env["PDSERVE_ETCD_PASSWORD"] == ETCD_PASSWORDS[variable], name
        assert not set(ETCD_PASSWORDS) & set(env), name  # no one else's password
    for name, service in services.items():  # no password on a command line
        argv = _argv(service) + json.dumps(service.get("healthcheck", {}))
        assert "password" not in argv.lower(), name
        assert not any(p in argv for p in ETCD_PASSWORDS.values()), name
    for variable in ETCD_PASSWORDS:
        for empty in (None, ""):
            refused = _compose("config", "-q", **{variable: empty})
            assert refused.returncode != 0 and f"set {variable}" in refused.stderr, refused.stderr


def test_the_etcd_healthcheck_passes_on_an_etcd_with_auth_on(tmp_path):
    """The healthcheck's own command, pointed at an etcd with users: /health needs none."""
    from cluster.etcd_auth import etcd_users
    from cluster.etcd_server import EtcdServer

    [kind, python, flag, code] = _config()["services"]["etcd"]["healthcheck"]["test"]
    assert (kind, python, flag) == ("CMD", "python", "-c") and "127.0.0.1:2379" in code
    with EtcdServer(auth=etcd_users("default", tmp_path).auth) as etcd:
        probe = subprocess.run(
            [sys.executable, "-c", code.replace("127.0.0.1:2379", etcd.endpoint)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert probe.returncode == 0, probe.stderr
    stopped = subprocess.run(
        [sys.executable, "-c", code.replace("127.0.0.1:2379", etcd.endpoint)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert stopped.returncode != 0


def test_compose_file_is_valid_and_only_the_router_is_published():
    services = _config()["services"]
    assert set(services) == {
        "etcd",
        "etcd-users",
        "router",
        "prefill",
        "decode",
        "prometheus",
        "grafana",
    }
    assert sorted(name for name, s in services.items() if s.get("ports")) == ["grafana", "router"]
    [grafana_port] = services["grafana"]["ports"]  # on the host's loopback only
    assert _host_ip(grafana_port) == "127.0.0.1"
    for name in ("prefill", "decode"):  # scalable: no fixed names or host ports
        s = services[name]
        assert "container_name" not in s and "healthcheck" in s
        assert services[name]["networks"] == {"pdnet": None} or set(services[name]["networks"]) == {
            "pdnet"
        }
        assert f"pdserve {name}" in " ".join(s["command"])
    assert "router" in " ".join(services["router"]["command"])
    # speculative decoding: decode workers only, from SPECULATIVE_CONFIG (empty: off)
    assert '--speculative-config "$$SPECULATIVE_CONFIG"' in " ".join(services["decode"]["command"])
    assert services["decode"]["environment"]["SPECULATIVE_CONFIG"] == ""
    assert "speculative" not in " ".join(services["prefill"]["command"])
    # tensor parallelism: decode workers only (prefill workers refuse it until KV moves
    # between tensor-parallel workers), from DECODE_TENSOR_PARALLEL_SIZE (default 1)
    assert '--tensor-parallel-size "$$DECODE_TENSOR_PARALLEL_SIZE"' in " ".join(
        services["decode"]["command"]
    )
    assert services["decode"]["environment"]["DECODE_TENSOR_PARALLEL_SIZE"] == "1"
    assert "tensor-parallel" not in " ".join(services["prefill"]["command"])
    # the KV cache format: one per cluster, both roles, from KV_CACHE_DTYPE (default auto)
    for name in ("prefill", "decode"):
        assert '--kv-cache-dtype "$$KV_CACHE_DTYPE"' in " ".join(services[name]["command"])
        assert services[name]["environment"]["KV_CACHE_DTYPE"] == "auto"


def test_dockerfile_runs_as_non_root_and_prepares_the_model_at_build():
    text = (COMPOSE / "Dockerfile").read_text()
    assert text.splitlines()[0].startswith("#") and "FROM python:3.11-slim" in text
    user_at = text.index("USER pdserve")
    assert text.index("RUN pdserve prepare-model") > user_at  # the model belongs to that user


def test_prometheus_scrapes_every_process_by_dns_on_the_service_names():
    services = _config()["services"]
    prom = services["prometheus"]
    assert "pdnet" in prom["networks"] and not prom.get("ports")
    assert any("prometheus.yml" in str(v) for v in prom["volumes"])
    config = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    jobs = {}
    for job in config["scrape_configs"]:
        [sd] = job["dns_sd_configs"]
        assert sd["type"] == "A" and not job.get("static_configs")
        for name in sd["names"]:
            jobs[name] = sd["port"]
    assert jobs == {"router": 8000, "prefill": 9100, "decode": 9100}
    for name in ("prefill", "decode"):  # the port the workers serve /metrics on
        assert f"--metrics-port {jobs[name]}" in " ".join(services[name]["command"])
    assert '"--port", "8000"' in json.dumps(services["router"]["command"])


def test_grafana_is_provisioned_with_the_datasource_and_dashboard():
    grafana = _config()["services"]["grafana"]
    mounts = {
        str(v).split(":")[-2] if isinstance(v, str) else v["target"] for v in grafana["volumes"]
    }
    assert {"/etc/grafana/provisioning", "/var/lib/grafana/dashboards"} <= mounts
    prov = COMPOSE / "grafana" / "provisioning"
    [ds] = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    [provider] = yaml.safe_load((prov / "dashboards" / "pdserve.yml").read_text())["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    dash = json.loads((COMPOSE / "grafana" / "dashboards" / "pdserve.json").read_text())
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == ds["uid"] and panel["targets"]


# PromQL words that are not metric names (functions are recognised by the "(" after them).
_PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
}


def _metric_names(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        word, rest = m.group(), expr[m.end() :].lstrip()
        if rest.startswith("(") or word in _PROMQL_WORDS or re.fullmatch(r"[0-9.e]+", word):
            continue
        names.add(word)
    return names


def test_dashboard_queries_use_only_metrics_the_code_exports():
    from metrics_catalog import exported, series_names

    known = set().union(*(series_names(t) for t in exported().values()))
    dash = json.loads((COMPOSE / "grafana" / "dashboards" / "pdserve.json").read_text())
    titles = {p["title"] for p in dash["panels"]}
    assert {
        "Request rate",
        "TTFT percentiles",
        "ITL percentiles",
        "KV cache usage per worker",
        "Prefix cache hit rate",
        "KV transfer throughput",
        "Routing decisions",
        "Pool sizes",
    } <= titles
    used = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            names = _metric_names(target["expr"])
            assert names, target["expr"]
            assert names <= known, (panel["title"], names - known)
            used |= names
    assert any(n.startswith("vllm:") for n in used) and any(n.startswith("pdserve_") for n in used)


def test_grafana_has_no_default_admin_password():
    """Before: Grafana's admin/admin on the host's loopback."""
    grafana = _config()["services"]["grafana"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == GRAFANA_PASSWORD
    for empty in (None, ""):
        refused = _compose("config", "-q", grafana=empty)
        assert refused.returncode != 0, refused.stderr
        assert "set PDSERVE_GRAFANA_ADMIN_PASSWORD" in refused.stderr, refused.stderr


def test_the_router_trusts_registrations_only_from_the_workers_network():
    """The workers' network has a fixed subnet, and the router's --allowed-worker-cidrs is it:
    a registration naming an address elsewhere gets no channel carrying the token."""
    config = _config()
    [subnet] = [c["subnet"] for c in config["networks"]["pdnet"]["ipam"]["config"]]
    router = config["services"]["router"]["command"]
    assert router[router.index("--allowed-worker-cidrs") + 1] == subnet == "172.29.0.0/16"
    env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    exe = shutil.which("docker-compose")
    other = subprocess.run(
        [exe, "-f", "docker-compose.yml", "config"],
        cwd=COMPOSE,
        env={
            **env,
            "PDSERVE_API_KEY": TEST_KEY,
            "PDSERVE_CLUSTER_TOKEN": TEST_TOKEN,
            "PDSERVE_GRAFANA_ADMIN_PASSWORD": GRAFANA_PASSWORD,
            "PDSERVE_SUBNET": "10.77.0.0/24",
            **ETCD_PASSWORDS,
        },
        capture_output=True,
        text=True,
    )
    assert other.returncode == 0, other.stderr
    moved = yaml.safe_load(other.stdout)
    command = moved["services"]["router"]["command"]
    assert command[command.index("--allowed-worker-cidrs") + 1] == "10.77.0.0/24"
    assert moved["networks"]["pdnet"]["ipam"]["config"] == [{"subnet": "10.77.0.0/24"}]
