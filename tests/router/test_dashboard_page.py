"""The dashboard never executes what it shows (issue 51, stored XSS): its code writes data only
as text (no innerHTML and the like in router/static/dashboard.js), the page has no inline
script or style, every part of it is served under a strict Content-Security-Policy with
`nosniff`, and in a real browser (Debian's chromium, when installed) markup in every field of
/dashboard/data shows as text and creates no element."""

import asyncio
import re
import shutil
import subprocess
import threading
from importlib import resources

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from cluster.net import free_port
from router.http.dashboard import ASSETS, CSP, PAGE_HEADERS, add_page_routes

XSS = '"><img src=x onerror="document.title=\'pwned\'"><script>document.title="pwned"</script>'


def _static(name: str) -> str:
    return resources.files("router").joinpath(f"static/{name}").read_text("utf-8")


def test_the_code_never_parses_data_as_html():
    js = _static("dashboard.js")
    for sink in (
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "Function(",
        "DOMParser",
        "createContextualFragment",
        "srcdoc",
        "javascript:",
    ):
        assert sink not in js, sink
    # setAttribute only with literal names: no `on*` handler and no style attribute from data.
    names = re.findall(r"setAttribute\(([^,]+),", js)
    assert names and all(
        n in ('"fill"', '"stroke"', '"stroke-width"', '"points"', "k") for n in names
    )
    attrs = re.findall(r"el\(\"\w+\", \{([^}]*)\}", js)
    assert all(not re.search(r"\bon\w+\s*:|style\s*:", a) for a in attrs), attrs
    page = _static("dashboard.html")
    assert "<script>" not in page and "<style" not in page and " style=" not in page
    assert not re.search(r"\son\w+=", page)  # no inline handlers
    assert re.search(r'<script src="dashboard/app.js" defer></script>', page)


def _page_app(data: dict) -> FastAPI:
    app = FastAPI()
    add_page_routes(app)

    @app.get("/dashboard/data")
    async def hostile() -> dict:
        return data

    return app


class _Server:
    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()))

    def __enter__(self) -> "_Server":
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the page server did not start")
            threading.Event().wait(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _hostile_data() -> dict:
    worker = {
        "worker_id": XSS,
        "role": "decode",
        "state": XSS,
        "address": XSS,
        "kv_usage": XSS,
        "total_blocks": XSS,
        "free_blocks": XSS,
        "running": XSS,
        "waiting": XSS,
        "queued_prefill_tokens": XSS,
        "prefill_tokens_per_s": XSS,
        "inflight": XSS,
        "kv_bytes": XSS,
    }
    decision = {
        "time": XSS,
        "policy": XSS,
        "reason": XSS,
        "decode": XSS,
        "prefill": XSS,
        "predicted_cached_tokens": XSS,
    }
    return {
        "time": 1.0,
        "model": XSS,
        "workers": [worker, {**worker, "role": "prefill"}],
        "requests_total": XSS,
        "running": XSS,
        "waiting": XSS,
        "decisions": {XSS: XSS},
        "prompt_tokens": 1,
        "generation_tokens": XSS,
        "prefix_hit_tokens": XSS,
        "tool_requests": XSS,
        "tool_calls": XSS,
        "reasoning_requests": XSS,
        "ttft_s": [XSS, 0.1],
        "itl_s": XSS,
        "recent_decisions": [decision],
    }


def test_every_part_of_the_page_has_the_security_headers():
    with _Server(_page_app(_hostile_data())) as s:
        for path, (_, media_type) in ASSETS.items():
            r = httpx.get(f"http://127.0.0.1:{s.port}{path}", timeout=30)
            assert r.status_code == 200 and r.headers["content-type"] == media_type, path
            for name, value in PAGE_HEADERS.items():
                assert r.headers[name] == value, (path, name)
        # A query parameter is no way into the page (routes take none).
        r = httpx.get(f"http://127.0.0.1:{s.port}/dashboard?body=<script>x</script>", timeout=30)
        assert "<script>x" not in r.text
    for directive in (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    ):
        assert directive in CSP
    assert "unsafe" not in CSP


_CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_CHROMIUM is None, reason="chromium is not installed (scripts/test.sh)")
def test_markup_in_the_data_shows_as_text_in_a_browser(tmp_path):
    with _Server(_page_app(_hostile_data())) as s:
        out = subprocess.run(
            [
                _CHROMIUM,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--virtual-time-budget=3000",
                f"--user-data-dir={tmp_path / 'profile'}",
                "--dump-dom",
                f"http://127.0.0.1:{s.port}/dashboard",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    dom = out.stdout
    assert out.returncode == 0 and "</html>" in dom, out.stderr[-2000:]
    assert "pwned" not in dom.split("</title>")[0]  # no script ran
    # The data was rendered (both pools, the decision) and every field of it as text.
    assert dom.count('<tr class="worker"') == 2, dom[-3000:]
    assert "&lt;img src=x" in dom and "&lt;script&gt;" in dom
    assert "<img" not in dom and dom.count("<script") == 1  # the page's own script alone
