"""An in-process aiohttp server on loopback for tests that stand in for an engine or a gateway (a fake upstream's
``/metrics`` and ``/v1/models``, a gateway's ``/status``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve_routes(*routes: tuple[str, str, Handler]) -> tuple[str, web.AppRunner]:
    """Serve ``(method, path, handler)`` routes on 127.0.0.1 at a free port; return the base URL and the runner
    (``await runner.cleanup()`` stops it)."""
    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", runner
