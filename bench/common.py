"""Helpers shared by the benchmarks: start a real ``sluice serve``, read prompts, percentiles."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

from tests.support.server import SluiceProcess, free_port  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


async def sse_chunks(response) -> AsyncIterator[dict]:
    """Yield each ``data:`` chunk of an OpenAI SSE stream (an aiohttp response) as a dict, ``[DONE]`` left out."""
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def percentile(values: list[float], q: float) -> float:
    """Return the ``q``-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def mt_bench_prompts(limit: int) -> list[str]:
    """First-turn MT-Bench prompts (../shared/data), falling back to the test fixture copy."""
    path = SHARED_DATA / "mt_bench" / "question.jsonl"
    if path.exists():
        prompts = [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]
    else:
        prompts = [p["prompt"] for p in json.loads((REPO_ROOT / "tests/fixtures/mt_bench_prompts.json").read_text())]
    return [prompts[i % len(prompts)] for i in range(limit)]


@contextlib.contextmanager
def sluice_server(config_text: str, env: dict[str, str] | None = None, start_timeout_s: float = 600.0):
    """Run ``sluice serve`` with ``config_text`` on a free port; yield its base URL; stop it afterwards."""
    with SluiceProcess(config_text, env=env, min_ready_workers=0, start_timeout_s=start_timeout_s,
                       inherit_sluice_env=True) as server:
        yield server.base_url


def write_result(name: str, result: dict) -> Path:
    """Write ``result`` as JSON to bench/results/<name>.json, or to ``name`` itself when it ends in ``.json`` (a
    path, e.g. ``--out /tmp/run1.json``), and print it."""
    path = Path(name) if name.endswith(".json") else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return path
