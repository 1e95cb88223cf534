"""GET /dashboard, the live cluster page, in a real headless browser (Debian's chromium;
scripts/test.sh installs it when missing): against the session cluster it lists both
workers with their roles, and after a completion its request counter has grown. A
screenshot is written under tmp_path."""

import asyncio
import html
import re
import shutil
import subprocess

import httpx
import pytest
from openai_cluster import KEY, MODEL

from router.http.dashboard import DashboardData

pytestmark = pytest.mark.slow

_CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--virtual-time-budget=3000",
]


def _chromium(tmp_path, *args: str) -> str:
    if _CHROMIUM is None:
        pytest.skip(
            "chromium is not installed (scripts/test.sh installs Debian's chromium "
            "when run as root)"
        )
    profile = tmp_path / "chromium-profile"
    out = subprocess.run(
        [_CHROMIUM, *_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split("<script>")[0]  # the rendered document, not the page's own code


async def _worker_ids(e2e) -> dict[str, str]:
    return {w.worker_id: w.role for w in await e2e.workers()}


def _rows(dom: str) -> dict[str, str]:
    return {
        html.unescape(wid): role
        for wid, role in re.findall(
            r'<tr class="worker" data-worker-id="([^"]*)" data-role="([^"]*)"', dom
        )
    }


def _requests(dom: str) -> int:
    return int(re.search(r'id="requests-total">(\d+)<', dom).group(1))


def test_dashboard_in_browser(e2e, client, tmp_path):
    workers = asyncio.run(_worker_ids(e2e))
    assert sorted(workers.values()) == ["decode", "prefill"]
    # The page holds no data and needs no key; its data needs the API key (the cluster has no
    # admin key) and matches its schema.
    page = httpx.get(e2e.url + "/dashboard", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text  # no CDN
    assert httpx.get(e2e.url + "/dashboard/data", timeout=30).status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    data = DashboardData.model_validate(
        httpx.get(e2e.url + "/dashboard/data", headers=auth, timeout=30).json()
    )
    assert {w.worker_id: w.role for w in data.workers} == workers

    keyless = _chromium(tmp_path, "--dump-dom", e2e.url + "/dashboard")
    assert "(HTTP 401)" in keyless and not _rows(keyless)  # the page asks for the key
    url = e2e.url + "/dashboard#key=" + KEY  # the fragment never reaches the server
    before = _chromium(tmp_path, "--dump-dom", url)
    assert _rows(before) == workers, before[-3000:]
    for worker_id, role in workers.items():
        assert f"<td>{html.escape(worker_id)}</td><td>{role}</td>" in before
    count = _requests(before)

    out = client.completions.create(model=MODEL, prompt="The dashboard", max_tokens=3)
    assert out.usage.completion_tokens == 3
    after = _chromium(tmp_path, "--dump-dom", url)
    assert _requests(after) > count
    assert _rows(after) == workers
    assert re.search(r'data-reason="[a-z_]+">', after)  # a routing decision is listed
    # KV transfer throughput comes from the workers' own /metrics: both have moved KV bytes
    # (the completion was prefilled remotely) and the page has the column.
    data = DashboardData.model_validate(
        httpx.get(e2e.url + "/dashboard/data", headers=auth, timeout=30).json()
    )
    assert all(w.kv_bytes is not None and w.kv_bytes > 0 for w in data.workers), data.workers
    assert "KV transfer MB/s" in after

    shot = tmp_path / "dashboard.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,800", url)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 1000
    print(f"dashboard screenshot: {shot}")
