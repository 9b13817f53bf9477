"""The status page (``GET /``, ``GET /dashboard``) in a real headless Chromium against a real gateway.

A ``sluice serve`` with one sim worker runs two jobs, then takes a mixed-tier load (some of it rejected) while
Chromium, driven over the Chrome DevTools Protocol, shows the page. Then:

- under load: a screenshot is taken (to the test's temporary folder; ``SLUICE_DASHBOARD_SCREENSHOT=1`` writes it
  over ``bench/results/dashboard.png``, the one the repository keeps); every section is filled (Jobs shows the two
  succeeded jobs), the sim worker is labelled SIMULATOR, the charts have points; counters and static numbers on
  the page lie between two ``/status`` fetched just before and just after the page's own refresh; the admitted
  rate agrees with the test's own samples;
- once idle: every number on the page (gauges too) lies between two such ``/status`` snapshots, and every number
  ``/status`` carries is on the page, with visible text that matches its ``data-value``.

Chromium is Debian's ``chromium`` (``make chromium`` installs it); the test installs it itself where missing and
skips only when that is impossible.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import REPO_ROOT
from tests.gateway.sim_gateway import MODEL_NAME, sim_gateway

SCREENSHOT_PATH = REPO_ROOT / "bench" / "results" / "dashboard.png"
WINDOW_WIDTH_PX, WINDOW_HEIGHT_PX = 1400, 1000
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_INSTALL_TIMEOUT_S = 900.0
DEVTOOLS_TIMEOUT_S = 30.0
LOAD_CLIENTS_PER_TIER = {"vip": 1, "standard": 3, "free": 3, "batch": 2}
LOAD_WARMUP_S = 6.0
PAGE_UNDER_LOAD_S = 14.0
IDLE_TIMEOUT_S = 30.0
RATE_WINDOW_S = 10.0  # dashboard.js RATE_WINDOW_S


# ----------------------------------------------------------------------------------------------- chromium


def find_or_install_chromium() -> str | None:
    """Return a Chromium binary: on PATH, or installed from Debian's ``chromium`` package; None if impossible."""
    for name in CHROMIUM_NAMES:
        if path := shutil.which(name):
            return path
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run("apt-get update -qq && apt-get install -y -qq chromium", shell=True, env=env,
                       capture_output=True, timeout=CHROMIUM_INSTALL_TIMEOUT_S, check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    return shutil.which("chromium")


class DevToolsPage:
    """One Chromium page driven over the Chrome DevTools Protocol (commands by id over its websocket)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)

    async def send(self, method: str, **params: Any) -> dict:
        """Send one command and return its result (events that arrive meanwhile are dropped)."""
        command_id = next(self._ids)
        await self._ws.send_json({"id": command_id, "method": method, "params": params})
        while True:
            message = await self._ws.receive_json(timeout=DEVTOOLS_TIMEOUT_S)
            if message.get("id") == command_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    async def evaluate(self, expression: str) -> Any:
        """Evaluate a JS expression in the page (promises awaited) and return its JSON value."""
        result = await self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"JS error: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float) -> Any:
        """Evaluate ``expression`` until it is truthy; return its value."""
        deadline = time.monotonic() + timeout_s
        while not (value := await self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"page never satisfied {expression!r}")
            await asyncio.sleep(0.2)
        return value


@contextlib.asynccontextmanager
async def chromium_page(binary: str, workdir: Path) -> AsyncIterator[DevToolsPage]:
    """Start headless Chromium with a fresh profile and yield its first page over the DevTools protocol."""
    profile = workdir / "chromium-profile"
    log_path = workdir / "chromium.log"
    args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-port=0",
            f"--window-size={WINDOW_WIDTH_PX},{WINDOW_HEIGHT_PX}", "about:blank"]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + DEVTOOLS_TIMEOUT_S
        while not (port_file.exists() and port_file.read_text().strip()):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"chromium did not open its DevTools port:\n{log_path.read_text(errors='replace')}")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
                targets = await response.json()
            page_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
            async with session.ws_connect(page_url, max_msg_size=0) as ws:
                yield DevToolsPage(ws)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ----------------------------------------------------------------------------------------------- load


async def _client_loop(session: aiohttp.ClientSession, base_url: str, tier: str, index: int,
                       stop: asyncio.Event, outcomes: dict[int, int]) -> None:
    """Send chat completions of ``tier`` back to back until ``stop`` is set; count response statuses."""
    for turn in itertools.count():
        if stop.is_set():
            return
        body = {"model": MODEL_NAME, "max_tokens": 96, "stream": turn % 2 == 0,
                "messages": [{"role": "user", "content": f"Client {tier}-{index}, turn {turn}: tell me about rivers."}]}
        async with session.post(f"{base_url}/v1/chat/completions", json=body,
                                headers={"x-sluice-tier": tier}) as response:
            await response.read()
            outcomes[response.status] = outcomes.get(response.status, 0) + 1
            if response.status != 200:
                await asyncio.sleep(0.3)


@contextlib.asynccontextmanager
async def mixed_tier_load(base_url: str) -> AsyncIterator[dict[int, int]]:
    """Run :data:`LOAD_CLIENTS_PER_TIER` closed-loop clients while the block runs; yield status → count."""
    stop = asyncio.Event()
    outcomes: dict[int, int] = {}
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(_client_loop(session, base_url, tier, i, stop, outcomes))
                 for tier, count in LOAD_CLIENTS_PER_TIER.items() for i in range(count)]
        try:
            yield outcomes
        finally:
            stop.set()
            done, pending = await asyncio.wait(tasks, timeout=60)
            for task in pending:
                task.cancel()
            for task in done:
                if task.exception() is not None:
                    raise task.exception()


NUM_JOBS = 2
JOBS_TIMEOUT_S = 60.0


async def run_jobs(session: aiohttp.ClientSession, base_url: str, num_jobs: int) -> None:
    """Submit ``num_jobs`` small jobs (``POST /v1/jobs``) and wait until every one succeeded."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Name a tea."}], "max_tokens": 4}
    job_ids = []
    for _ in range(num_jobs):
        async with session.post(f"{base_url}/v1/jobs", json=body) as response:
            assert response.status == 202, await response.text()
            job_ids.append((await response.json())["id"])
    deadline = time.monotonic() + JOBS_TIMEOUT_S
    for job_id in job_ids:
        while True:
            async with session.get(f"{base_url}/v1/jobs/{job_id}") as response:
                job = await response.json()
            if job["status"] == "succeeded":
                break
            assert job["status"] in ("queued", "running") and time.monotonic() < deadline, job
            await asyncio.sleep(0.2)


async def get_status(session: aiohttp.ClientSession, base_url: str) -> dict:
    async with session.get(f"{base_url}/status") as response:
        assert response.status == 200
        return await response.json()


# ----------------------------------------------------------------------------------------------- page vs /status

STATIC, COUNTER, GAUGE = "static", "counter", "gauge"


def expected_fields(status: dict) -> dict[str, tuple[str, Any]]:
    """Map every ``data-field`` the page must show for this ``/status`` to (kind, value).

    Kinds: ``static`` (must equal), ``counter`` (never decreases), ``gauge`` (anything). Rates are not here: they
    are the page's own computation, checked separately.
    """
    fields: dict[str, tuple[str, Any]] = {
        "model": (STATIC, status["model"]),
        "uptime_s": (COUNTER, status["uptime_s"]),
        "active_requests": (GAUGE, status["active_requests"]),
    }
    pressure = status["pressure"]
    fields.update({
        "pressure.level": (GAUGE, pressure["level"]),
        "pressure.in_level_s": (GAUGE, pressure["in_level_s"]),
        "pressure.kv_used_fraction": (GAUGE, pressure["kv_used_fraction"]),
        "pressure.queue_wait_s": (GAUGE, pressure["queue_wait_s"]),
        "pressure.num_transitions": (COUNTER, pressure["num_transitions"]),
    })
    tiers = status["admission"]["tiers"]
    for name, tier in tiers.items():
        prefix = f"tier.{name}."
        fields.update({
            prefix + "priority": (STATIC, tier["priority"]),
            prefix + "queue_capacity": (STATIC, tier["queue_capacity"]),
            prefix + "queue_depth": (GAUGE, tier["queue_depth"]),
            prefix + "oldest_wait_s": (GAUGE, tier["oldest_wait_s"]),
            prefix + "in_flight": (GAUGE, tier["in_flight"]),
            prefix + "admitted": (COUNTER, tier["admitted"]),
            prefix + "rejected": (COUNTER, sum(tier["rejected"].values())),
            prefix + "cancelled": (COUNTER, tier["cancelled"]),
        })
        if tier.get("predicted_wait_s") is not None:
            fields[prefix + "predicted_wait_s"] = (GAUGE, tier["predicted_wait_s"])
        if "deferred" in tier:
            deferred = tier["deferred"]
            fields[prefix + "deferred"] = (COUNTER, sum(deferred.values()) if isinstance(deferred, dict) else deferred)
    fields["totals.queue_depth"] = (GAUGE, sum(t["queue_depth"] for t in tiers.values()))
    for worker in status["workers"]:
        prefix = f"worker.{worker['name']}."
        capacity = worker["capacity"]
        fields.update({
            prefix + "backend": (STATIC, worker["backend"]),
            prefix + "simulator": (STATIC, worker["simulator"]),
            prefix + "ready": (GAUGE, worker["ready"]),
            prefix + "breaker": (GAUGE, worker["breaker"]["state"]),
            prefix + "in_flight": (GAUGE, worker["in_flight"]),
            prefix + "device": (STATIC, worker["hello"]["device"]),
            prefix + "kv_total_blocks": (STATIC, capacity["total_kv_blocks"]),
            prefix + "kv_used_blocks": (GAUGE, capacity["used_kv_blocks"]),
            prefix + "kv_cached_blocks": (GAUGE, capacity["cached_kv_blocks"]),
            prefix + "kv_usage": (GAUGE, capacity["used_kv_blocks"] / capacity["total_kv_blocks"]),
            prefix + "prefix_hit_rate": (GAUGE, capacity["prefix_hit_rate"]),
            prefix + "decode_tokens_per_s": (GAUGE, capacity["decode_tokens_per_s"]),
            prefix + "prefill_tokens_per_s": (GAUGE, capacity["prefill_tokens_per_s"]),
            prefix + "running": (GAUGE, capacity["num_running"]),
            prefix + "waiting": (GAUGE, capacity["num_waiting"]),
            prefix + "preemptions": (COUNTER, capacity["num_preemptions"]),
        })
        if worker.get("pool") is not None:
            fields[prefix + "pool"] = (STATIC, worker["pool"])
        if worker.get("state") is not None:
            fields[prefix + "state"] = (GAUGE, worker["state"])
    for key, value in _job_counts(status).items():
        fields[f"jobs.{key}"] = (GAUGE, value)
    return fields


def _job_counts(status: dict) -> dict[str, float]:
    jobs = status.get("jobs")
    if not isinstance(jobs, dict):
        return {}
    source = {**jobs, **jobs["counts"]} if isinstance(jobs.get("counts"), dict) else jobs
    return {re.sub(r"^num_", "", k): v for k, v in source.items() if isinstance(v, (int, float))
            and not isinstance(v, bool)}


def _page_value(raw: str, expected: Any) -> Any:
    """Decode a ``data-value`` attribute to the type of the ``/status`` value it shows."""
    if isinstance(expected, bool):
        return raw == "true"
    if isinstance(expected, (int, float)):
        return float(raw)
    return raw


def _between(value: float, a: float, b: float) -> bool:
    slack = 1e-9 + 1e-6 * max(abs(a), abs(b))
    return min(a, b) - slack <= value <= max(a, b) + slack


def compare_page(dom: dict[str, dict], before: dict, after: dict, kinds: set[str]) -> list[str]:
    """Return every mismatch between the page's fields and two ``/status`` taken around its refresh.

    Args:
        dom: data-field → {"value": data-value or None when missing, "text": visible text}.
        before, after: ``/status`` fetched just before and just after the page fetched its own.
        kinds: which kinds of field to compare (all of them must be on the page either way).
    """
    problems: list[str] = []
    expected_before, expected_after = expected_fields(before), expected_fields(after)
    for name, (kind, value_before) in expected_before.items():
        if name not in expected_after:
            continue  # appeared or vanished between the two snapshots (e.g. a predicted wait once measured)
        if name not in dom or dom[name]["value"] is None:
            problems.append(f"{name}: not on the page")
            continue
        if kind not in kinds:
            continue
        value_after = expected_after[name][1]
        page = _page_value(dom[name]["value"], value_before)
        if isinstance(value_before, (int, float)) and not isinstance(value_before, bool):
            if kind == COUNTER and not value_before <= value_after:
                problems.append(f"{name}: counter went down in /status ({value_before} → {value_after})")
            if not _between(page, value_before, value_after):
                problems.append(f"{name}: page shows {page}, /status {value_before} then {value_after}")
        elif page not in (value_before, value_after):
            problems.append(f"{name}: page shows {page!r}, /status {value_before!r} then {value_after!r}")
    rate_fields = {n for n in dom if n.endswith("_per_s") and (n.startswith("tier.") or n.startswith("totals."))}
    unchecked = {n for n, f in dom.items() if f["value"] is not None} - set(expected_before) - rate_fields
    unchecked -= {"poll.state"}
    if unchecked:
        problems.append(f"numbers on the page that /status does not carry: {sorted(unchecked)}")
    return problems


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def text_mismatches(dom: dict[str, dict]) -> list[str]:
    """Return fields whose visible text does not show their ``data-value`` (rounded as displayed)."""
    problems = []
    for name, f in dom.items():
        raw, text = f["value"], f["text"]
        if raw is None or name in ("uptime_s", "model", "poll.state"):
            continue
        try:
            value = float(raw)
        except ValueError:
            continue  # a string or boolean field
        match = _NUMBER.search(text)
        if match is None:
            problems.append(f"{name}: text {text!r} shows no number for {raw}")
            continue
        shown_text = match.group().replace(",", "")
        shown = float(shown_text)
        decimals = len(shown_text.split(".")[1]) if "." in shown_text else 0
        target = value * 100 if text.strip().endswith("%") else value
        if abs(shown - target) > 0.5 * 10 ** -decimals + 1e-9:
            problems.append(f"{name}: text {text!r} but value {raw}")
    return problems


READ_FIELDS_JS = """
Object.fromEntries(Array.from(document.querySelectorAll('[data-field]')).map((e) => [
  e.dataset.field,
  {value: e.dataset.missing === 'true' || e.dataset.value === undefined || e.dataset.value === ''
          ? null : e.dataset.value,
   text: e.textContent}]))
"""


async def snapshot_page(page: DevToolsPage, session: aiohttp.ClientSession, base_url: str) -> tuple[dict, dict, dict]:
    """Fetch /status, make the page refresh once, read its fields, fetch /status again."""
    before = await get_status(session, base_url)
    assert await page.evaluate("window.sluiceDashboard.refresh().then((s) => s !== null)")
    dom = await page.evaluate(READ_FIELDS_JS)
    after = await get_status(session, base_url)
    return before, dom, after


def _admitted_total(status: dict) -> int:
    return sum(t["admitted"] for t in status["admission"]["tiers"].values())


def _rate_over_window(samples: list[tuple[float, int]], end_s: float) -> float:
    """Counter rate over [end_s − RATE_WINDOW_S, end_s] from (uptime_s, total) samples, by linear interpolation."""
    def at(t_s: float) -> float:
        for (t0, v0), (t1, v1) in itertools.pairwise(samples):
            if t0 <= t_s <= t1:
                return v0 + (v1 - v0) * (t_s - t0) / (t1 - t0) if t1 > t0 else v1
        return samples[-1][1] if t_s > samples[-1][0] else samples[0][1]
    return (at(end_s) - at(end_s - RATE_WINDOW_S)) / RATE_WINDOW_S


# ----------------------------------------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def chromium() -> str:
    binary = find_or_install_chromium()
    if binary is None:
        pytest.skip("no Chromium on PATH and Debian's chromium package cannot be installed here "
                    "(needs root and apt-get; `make chromium` installs it)")
    return binary


@pytest.fixture(scope="module")
def sim_server(tmp_path_factory):
    with sim_gateway(tmp_path_factory.mktemp("dashboard_server")) as server:
        yield server


async def test_page_routes_serve_the_status_page(sim_server):
    async with aiohttp.ClientSession() as session:
        for path in ("/", "/dashboard"):
            async with session.get(sim_server.base_url + path) as response:
                assert response.status == 200
                assert response.content_type == "text/html"
                html = await response.text()
                assert 'src="dashboard/static/dashboard.js"' in html
                assert "http://" not in html and "https://" not in html, "the page must work offline (no CDN)"
        for asset, content_type in (("dashboard.js", "application/javascript"), ("dashboard.css", "text/css")):
            async with session.get(f"{sim_server.base_url}/dashboard/static/{asset}") as response:
                assert response.status == 200
                assert response.content_type == content_type
                assert "http://" not in await response.text()
        async with session.get(sim_server.base_url + "/dashboard/static/nope.js") as response:
            assert response.status == 404
        async with session.get(sim_server.base_url + "/dashboard/", allow_redirects=False) as response:
            assert (response.status, response.headers.get("Location")) == (308, "/dashboard"), await response.text()


async def test_status_page_matches_status_in_headless_chromium(sim_server, chromium, tmp_path):
    base_url = sim_server.base_url
    async with aiohttp.ClientSession() as session, chromium_page(chromium, tmp_path) as page:
        await page.send("Emulation.setDeviceMetricsOverride", width=WINDOW_WIDTH_PX, height=WINDOW_HEIGHT_PX,
                        deviceScaleFactor=1, mobile=False)
        samples: list[tuple[float, int]] = []
        await run_jobs(session, base_url, NUM_JOBS)
        async with mixed_tier_load(base_url) as outcomes:
            await asyncio.sleep(LOAD_WARMUP_S)
            await page.send("Page.navigate", url=base_url + "/")
            await page.wait_for("window.sluiceDashboard && window.sluiceDashboard.state.lastStatus !== null", 20)
            deadline = time.monotonic() + PAGE_UNDER_LOAD_S
            while time.monotonic() < deadline:
                status = await get_status(session, base_url)
                samples.append((status["uptime_s"], _admitted_total(status)))
                await asyncio.sleep(0.5)
            await page.evaluate("window.sluiceDashboard.stop()")
            before, dom_busy, after = await snapshot_page(page, session, base_url)
            samples.append((after["uptime_s"], _admitted_total(after)))
            screenshot = await _screenshot(page)
            charts = await page.evaluate(
                "Array.from(document.querySelectorAll('canvas')).map((c) => ({chart: c.dataset.chart, "
                "series: Number(c.dataset.series || 0), points: Number(c.dataset.points || 0)}))")
            sections = await page.evaluate(
                "Object.fromEntries(['pressure', 'tiers', 'workers', 'jobs'].map((id) => "
                "[id, document.querySelector('#' + id + ' .empty') === null]))")
            simulator_badges = await page.evaluate(
                "Array.from(document.querySelectorAll('.worker .badge.sim')).map((e) => e.textContent)")
            sim_banner_shown = await page.evaluate("!document.getElementById('sim-banner').hidden")
            page_time_s = await page.evaluate("window.sluiceDashboard.state.lastStatus.uptime_s")
        screenshot_path = SCREENSHOT_PATH if os.environ.get("SLUICE_DASHBOARD_SCREENSHOT") == "1" else (
            tmp_path / "dashboard.png")  # a test run leaves the tracked file alone
        screenshot_path.parent.mkdir(parents=True, exist_ok=True)
        screenshot_path.write_bytes(screenshot)
        assert screenshot_path.stat().st_size > 10_000  # a real page, not an empty image

        # The load was real: answered, queued and rejected requests.
        assert outcomes.get(200, 0) >= 10, outcomes
        assert sum(n for code, n in outcomes.items() if code in (429, 503)) >= 1, outcomes
        busy = after
        assert _admitted_total(busy) > 0
        assert any(sum(t["rejected"].values()) for t in busy["admission"]["tiers"].values())

        # Every section filled, the simulator labelled, every chart drawn from several polls.
        assert _job_counts(busy)["succeeded"] >= NUM_JOBS
        assert sections == {"pressure": True, "tiers": True, "workers": True, "jobs": True}, sections
        assert float(dom_busy["jobs.succeeded"]["value"]) >= NUM_JOBS
        assert simulator_badges == ["SIMULATOR"] and sim_banner_shown
        for chart in charts:
            assert chart["series"] >= 1 and chart["points"] >= 5, charts

        # Under load, counters and static numbers on the page lie between /status just before and just after.
        problems = compare_page(dom_busy, before, after, {STATIC, COUNTER}) + text_mismatches(dom_busy)
        assert not problems, "\n".join(problems)
        # The page's admitted rate (its own 10 s window) agrees with the test's samples of /status.
        page_rate = float(dom_busy["totals.admitted_per_s"]["value"])
        test_rate = _rate_over_window(samples, page_time_s)
        assert test_rate > 0
        assert math.isclose(page_rate, test_rate, rel_tol=0.3, abs_tol=0.5), (page_rate, test_rate)

        # Idle: every number, gauges included, matches /status.
        await _wait_idle(session, base_url)
        before, dom_idle, after = await snapshot_page(page, session, base_url)
        problems = compare_page(dom_idle, before, after, {STATIC, COUNTER, GAUGE}) + text_mismatches(dom_idle)
        assert not problems, "\n".join(problems)
        assert float(dom_idle[f"worker.{busy['workers'][0]['name']}.prefix_hit_rate"]["value"]) >= 0

    assert screenshot[:8] == b"\x89PNG\r\n\x1a\n"
    width_px, height_px = int.from_bytes(screenshot[16:20], "big"), int.from_bytes(screenshot[20:24], "big")
    assert width_px == WINDOW_WIDTH_PX and height_px >= WINDOW_HEIGHT_PX


async def _screenshot(page: DevToolsPage) -> bytes:
    """Capture the whole page (at least the window) as PNG bytes."""
    height_px = await page.evaluate("document.documentElement.scrollHeight")
    await page.send("Emulation.setDeviceMetricsOverride", width=WINDOW_WIDTH_PX,
                    height=max(WINDOW_HEIGHT_PX, int(height_px)), deviceScaleFactor=1, mobile=False)
    result = await page.send("Page.captureScreenshot", format="png")
    await page.send("Emulation.setDeviceMetricsOverride", width=WINDOW_WIDTH_PX, height=WINDOW_HEIGHT_PX,
                    deviceScaleFactor=1, mobile=False)
    return base64.b64decode(result["data"])


async def _wait_idle(session: aiohttp.ClientSession, base_url: str) -> None:
    """Wait until no request is active or queued and the worker holds no KV block."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        status = await get_status(session, base_url)
        idle = (status["active_requests"] == 0
                and all(t["queue_depth"] == 0 and t["in_flight"] == 0 for t in status["admission"]["tiers"].values())
                and all(w["capacity"]["used_kv_blocks"] == 0 and w["capacity"]["num_running"] == 0
                        for w in status["workers"]))
        if idle:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"gateway not idle after {IDLE_TIMEOUT_S} s: {json.dumps(status)[:2000]}")
        await asyncio.sleep(0.2)


def test_expected_fields_and_text_checks_catch_mismatches():
    """The comparison itself: a wrong number, a missing one, an unverified one and a mis-rounded text fail."""
    status = {"model": "m", "uptime_s": 10.0, "active_requests": 1,
              "pressure": {"level": "normal", "in_level_s": 1.0, "kv_used_fraction": 0.5, "queue_wait_s": 0.0,
                           "num_transitions": 0},
              "admission": {"tiers": {"vip": {"priority": 3, "queue_capacity": 8, "queue_depth": 2,
                                              "oldest_wait_s": 0.5, "in_flight": 1, "admitted": 5,
                                              "rejected": {"queue_full": 2}, "cancelled": 0,
                                              "predicted_wait_s": None}}},
              "workers": []}
    later = {**status, "uptime_s": 11.0}
    dom = {name: {"value": str(value).lower() if isinstance(value, bool) else str(value), "text": str(value)}
           for name, (_, value) in expected_fields(status).items()}
    assert compare_page(dom, status, later, {STATIC, COUNTER, GAUGE}) == []
    bad = {**dom, "tier.vip.admitted": {"value": "7", "text": "7"}, "stray.number": {"value": "1", "text": "1"}}
    del bad["tier.vip.queue_depth"]
    problems = compare_page(bad, status, later, {STATIC, COUNTER, GAUGE})
    assert any(p.startswith("tier.vip.admitted") for p in problems)
    assert any(p.startswith("tier.vip.queue_depth: not on the page") for p in problems)
    assert any("stray.number" in p for p in problems)
    assert text_mismatches({"x": {"value": "0.1234", "text": "12.3%"}}) == []
    assert text_mismatches({"x": {"value": "0.1234", "text": "12.9%"}}) != []
    assert text_mismatches({"x": {"value": "1234.5", "text": "1,234.50 tok/s"}}) == []
