"""GET /dashboard in a real browser: a real server gets a few requests (two sharing a prefix, one
whose client hangs up), headless Chromium renders the page (its script reading /v1/stats as a
person's browser would), and the rendered DOM shows every chart with one point per request or
per second of history, and tiles with the numbers /v1/stats holds. The screenshot is saved to
`test-artifacts/dashboard.png` (docs/dashboard.md shows it).

Chromium is Debian's `chromium` package; `nox -s tests` installs it when it is missing.
"""

import re
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]
ARTIFACTS = REPO / "test-artifacts"
PREFIX = "The history of the city begins with a small harbour, a market and a bridge over the river. " * 4


class Dom(HTMLParser):
    """The rendered page's charts (data-chart -> attributes, and the shapes inside) and tiles."""

    def __init__(self):
        super().__init__()
        self.charts: dict[str, dict] = {}
        self.tiles: dict[str, str] = {}
        self.hidden: set[str] = set()
        self._chart = None
        self._tile = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "svg" and "data-chart" in attrs:
            self._chart = attrs["data-chart"]
            self.charts[self._chart] = {"points": attrs.get("data-points"), "shapes": []}
        elif self._chart is not None and tag in ("circle", "rect", "polyline"):
            self.charts[self._chart]["shapes"].append((tag, attrs))
        if "data-tile" in attrs:
            self._tile = attrs["data-tile"]
            self.tiles[self._tile] = ""
            if "hidden" in attrs:
                self.hidden.add(self._tile)

    def handle_endtag(self, tag):
        if tag == "svg":
            self._chart = None
        elif self._tile is not None:
            self._tile = None

    def handle_data(self, data):
        if self._tile is not None:
            self.tiles[self._tile] += data


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "chromium is not installed (nox -s tests installs Debian's chromium package)"
    return path


def browse(url: str, *extra: str) -> str:
    command = [
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--virtual-time-budget=4000", "--window-size=1400,900", *extra, url,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(max_batch_size=4, use_chunked_prefill=True, use_prefix_caching=True)


def test_the_dashboard_renders_the_servers_statistics_in_a_real_browser(server):
    with httpx.Client(base_url=server.base_url, timeout=120.0) as client:
        for ending in ("Its people", "Its bridges"):
            body = {"model": server.model, "prompt": PREFIX + ending, "max_tokens": 6, "temperature": 0}
            assert client.post("/v1/completions", json=body).status_code == 200
        long_body = {"model": server.model, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True}
        with client.stream("POST", "/v1/completions", json={**long_body, "stream": True}) as stream:
            events = (line for line in stream.iter_lines() if line.startswith("data:"))
            next(events), next(events)  # then the client hangs up
        deadline = time.monotonic() + 60
        while len(client.get("/v1/stats").json()["requests"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    # Self-contained: nothing is loaded from anywhere but this server.
    assert not re.search(r"""(src|href)=["']https?://""", page.text)

    dom = Dom()
    dom.feed(browse(f"{server.base_url}/dashboard", "--dump-dom"))
    stats = httpx.get(f"{server.base_url}/v1/stats").json()  # idle now: what the page showed
    requests, history = stats["requests"], stats["history"]
    assert len(requests) == 3
    per_request = {"ttft": 1, "prefill_speed": 1}
    for name, lines in per_request.items():
        chart = dom.charts[name]
        assert int(chart["points"]) == len(requests), name
        assert sum(tag == "circle" for tag, _ in chart["shapes"]) == lines * len(requests), name
    bars = dom.charts["cache_match"]["shapes"]
    assert [float(a["data-value"]) for t, a in bars if a.get("data-kind") == "cached"] == [
        r["cached_tokens"] for r in requests
    ]
    assert [float(a["data-value"]) for t, a in bars if a.get("data-kind") == "prefilled"] == [
        r["prompt_tokens"] - r["cached_tokens"] for r in requests
    ]
    # History charts: one point per second of history (the page may have read one second less
    # than this later snapshot holds, never more).
    for name, series in {
        "throughput": ["generated_tokens_per_s"],
        "running_waiting": ["requests_running", "requests_waiting"],
        "cache_memory": ["prefix_cache_bytes", "prefix_cache_budget_bytes"],
    }.items():
        shown = int(dom.charts[name]["points"])
        assert shown >= 1 and len(history[series[0]]) - shown in (0, 1), name
        circles = sum(tag == "circle" for tag, _ in dom.charts[name]["shapes"])
        assert circles == shown * len(series), name
    totals = stats["totals"]
    for name in ("prompt_tokens_cached", "prompt_tokens_prefilled", "disconnects", "requests"):
        assert dom.tiles[name].strip() == str(totals[name]), name
    assert totals["disconnects"] == 1 and int(dom.tiles["prompt_tokens_cached"]) > 0
    hits = sum(r["cached_tokens"] > 0 for r in requests)
    assert dom.tiles["hit_rate"].strip() == f"{100 * hits / len(requests):.1f}%"
    assert "cancelled: 1" in dom.tiles["finish_reasons"]
    for kind, count in stats["prefix_cache_matches"].items():
        assert f"{kind}: {count}" in dom.tiles["match_kinds"]
    assert "pressure" in dom.hidden  # the cache is far below its budget (here the KV pool)
    used, pool = history["prefix_cache_bytes"][-1][1], history["kv_total_bytes"][-1][1]
    assert dom.tiles["cache_usage"].strip() == f"{100 * used / pool:.1f}%"

    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "dashboard.png"
    screenshot.unlink(missing_ok=True)
    browse(f"{server.base_url}/dashboard", f"--screenshot={screenshot}")
    assert screenshot.stat().st_size > 10_000
