"""The operator's status page: ``GET /`` and ``GET /dashboard`` serve one static HTML page.

The page (``gateway/http/static/dashboard.html`` with its ``dashboard.js`` and ``dashboard.css``, no build step, no
CDN: it works offline) polls ``/status`` every second and draws pressure, per-tier queues, workers, jobs and
charts of the last minutes in the browser. Assets are served from ``/dashboard/static/``; the page refers to
them and to ``status`` by relative URLs, so it works under both routes.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC_DIR = Path(__file__).resolve().parent / "static"
PAGE_PATH = STATIC_DIR / "dashboard.html"
STATIC_PREFIX = "/dashboard/static"
_NO_CACHE = {"Cache-Control": "no-cache"}


async def page(request: web.Request) -> web.FileResponse:
    """``GET /`` and ``GET /dashboard``: the status page (its file is sent without blocking the loop)."""
    return web.FileResponse(PAGE_PATH, headers={**_NO_CACHE, "Content-Type": "text/html; charset=utf-8"})


async def to_page(request: web.Request) -> web.StreamResponse:
    """``GET /dashboard/``: a permanent redirect to ``/dashboard`` (served there, the page's relative asset paths
    would point under ``/dashboard/dashboard/``)."""
    raise web.HTTPPermanentRedirect("/dashboard")


def add_routes(router: web.UrlDispatcher) -> None:
    """Register the page at ``/`` and ``/dashboard`` (``/dashboard/`` redirects there) and its assets under
    :data:`STATIC_PREFIX`."""
    router.add_get("/", page)
    router.add_get("/dashboard", page)
    router.add_get("/dashboard/", to_page)
    router.add_static(STATIC_PREFIX, STATIC_DIR, append_version=False)
