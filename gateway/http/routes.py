"""The gateway's routes: the OpenAI endpoints, the operational ones, the status page; CORS when configured.
(The job, file and batch routes are added by ``gateway.jobs``.)"""

from __future__ import annotations

from aiohttp import web

from gateway.http import dashboard
from gateway.http.completions import chat_completions, completions
from gateway.http.operations import favicon, healthz, metrics, model, models, readyz, status


def add_routes(app: web.Application, cors_allow_origins: tuple[str, ...] = ()) -> None:
    """Add every HTTP route of the gateway to ``app`` (CORS for ``cors_allow_origins`` when given)."""
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)  # ids such as org/name hold a slash
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/health", healthz)  # vLLM's and TGI's path: a drop-in for their health checks
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/favicon.ico", favicon)
    dashboard.add_routes(app.router)  # GET / and /dashboard: the status page


def setup_cors(app: web.Application, origins: tuple[str, ...]) -> None:
    """Answer CORS preflights and add CORS headers on every route for ``origins`` (``aiohttp_cors``): any method
    and request header, every response header exposed (``Retry-After``, ``x-sluice-*``), no credentials."""
    import aiohttp_cors

    options = aiohttp_cors.ResourceOptions(allow_credentials=False, expose_headers="*", allow_headers="*",
                                           allow_methods="*")
    cors = aiohttp_cors.setup(app, defaults={origin: options for origin in origins})
    for route in list(app.router.routes()):
        if route.method != "HEAD":  # aiohttp adds HEAD beside GET; the GET route's preflight covers the resource
            cors.add(route)
