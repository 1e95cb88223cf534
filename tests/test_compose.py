"""compose/: the file is valid for docker-compose (no engine runs here, so `config` is the
check) and has the topology the README promises."""
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

COMPOSE = Path(__file__).resolve().parents[1] / "compose"


def _config() -> dict:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (scripts/test.sh installs Debian's as root)")
    quiet = subprocess.run([exe, "-f", "docker-compose.yml", "config", "-q"], cwd=COMPOSE,
                           capture_output=True, text=True)
    assert quiet.returncode == 0, quiet.stderr
    full = subprocess.run([exe, "-f", "docker-compose.yml", "config"], cwd=COMPOSE,
                          capture_output=True, text=True, check=True)
    return yaml.safe_load(full.stdout)


def test_compose_file_is_valid_and_only_the_router_is_published():
    services = _config()["services"]
    assert set(services) == {"etcd", "router", "prefill", "decode"}
    assert [name for name, s in services.items() if s.get("ports")] == ["router"]
    for name in ("prefill", "decode"):  # scalable: no fixed names or host ports
        s = services[name]
        assert "container_name" not in s and "healthcheck" in s
        assert services[name]["networks"] == {"pdnet": None} or set(services[name]["networks"]) == {"pdnet"}
        assert f"pdserve {name}" in " ".join(s["command"])
    assert "router" in " ".join(services["router"]["command"])


def test_dockerfile_runs_as_non_root_and_prepares_the_model_at_build():
    text = (COMPOSE / "Dockerfile").read_text()
    assert text.splitlines()[0].startswith("#") and "FROM python:3.11-slim" in text
    user_at = text.index("USER pdserve")
    assert text.index("RUN pdserve prepare-model") > user_at  # the model belongs to that user
