"""``sluice serve``: run the gateway (aiohttp on uvloop) and the local workers it spawns.

Usage::

    sluice serve [--config config.toml] [--host 127.0.0.1] [--port 8000] [--workers N]
    sluice serve --worker-address 10.0.0.5:9100 --worker-address unix:/tmp/w.sock   # connect, don't spawn
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import structlog
from aiohttp import web

from gateway.app import build_app
from gateway.state import GatewayOptions
from shared.config import ConfigError, load_config, with_overrides

log = structlog.get_logger("sluice.gateway")

SHUTDOWN_TIMEOUT_S = 10.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sluice serve", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="config.toml (default: $SLUICE_CONFIG or ./config.toml)")
    parser.add_argument("--host", default=None, help="listen address (default: gateway.host)")
    parser.add_argument("--port", type=int, default=None, help="listen port (default: gateway.port)")
    parser.add_argument("--workers", type=int, default=None, help="local workers to spawn "
                        "(default: worker.num_local_workers)")
    parser.add_argument("--worker-address", action="append", default=[], metavar="HOST:PORT|unix:PATH",
                        help="connect to a running worker instead of spawning (repeatable)")
    return parser.parse_args(argv)


def configure_logging() -> None:
    """structlog JSON lines on stderr (one per request; never prompt text)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    structlog.configure(
        processors=[structlog.processors.TimeStamper(fmt="iso"), structlog.processors.add_log_level,
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


async def serve(options: GatewayOptions) -> None:
    """Run the gateway until SIGINT/SIGTERM, then shut down in order (listener, requests, workers)."""
    config = options.config
    app = build_app(options)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.gateway.host, config.gateway.port, backlog=1024)
        await site.start()
        log.info("gateway_listening", host=config.gateway.host, port=config.gateway.port, pid=os.getpid(),
                 model=config.model.name)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("gateway_stopping")
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sluice serve``; returns the exit status."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    configure_logging()
    try:
        config = load_config(args.config)
        gateway: dict = {}
        if args.host is not None:
            gateway["host"] = args.host
        if args.port is not None:
            gateway["port"] = args.port
        worker = {} if args.workers is None else {"num_local_workers": args.workers}
        config = with_overrides(config, gateway=gateway, worker=worker)
    except ConfigError as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 2
    config_path = os.path.abspath(args.config) if args.config else None
    options = GatewayOptions(config=config, config_path=config_path, worker_addresses=args.worker_address)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(options))
    else:
        uvloop.run(serve(options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
