"""``sluice serve``: run the gateway (aiohttp on uvloop) and the local workers it spawns.

Usage::

    sluice serve [--config config.toml] [--host 127.0.0.1] [--port 8000] [--workers N] [--reuse-port]
    sluice serve --worker-address 10.0.0.5:9100 --worker-address unix:/tmp/w.sock   # connect, don't spawn

Graceful drain: on SIGTERM (or SIGINT) the gateway stops admitting — queued and new requests get 503
``server_draining`` with ``Retry-After``, ``/readyz`` turns 503, no job is claimed and a job queued in admission goes
back to the job queue — while requests and jobs already running finish, for at most ``gateway.drain_timeout_s``;
requests still running then end with ``server_draining`` (in-band on a stream, then ``[DONE]``; a 503 before the
first byte) and jobs still running go back to the job queue without using an attempt; then it closes the listener,
cancels what is left, stops its local workers and exits 0. A second signal skips the rest of the drain (the requests
and jobs still end that way).

A config error (:func:`shared.config_checks.check_config`: every check that needs no worker and no network, as
``sluice config --check`` runs them) ends ``sluice serve`` with one line naming the key and exit status 2, before
the socket is bound; one found later, while the gateway starts, ends it the same way.

When no pool can ever serve — every pool's local workers stopped on a configuration error (a worker's exit status 2)
before any was ready, no remote worker or upstream exists and no pool scales from zero — ``sluice serve`` does not
wait on: it logs the workers' reasons, prints ``sluice serve: no pool can serve: <reason>`` and exits with status 2.
A pool that fails so while others serve, or a pool scaled to zero whose first worker (started for a request) fails
so, is reported (``/readyz``, ``/status``), its requests get a 503 naming the error, and the gateway serves on.

The listening socket is bound before anything else starts: an address already in use (or one this machine does not
have) ends ``sluice serve`` with one line naming it and exit status 1, before any worker is spawned.

Several gateway processes on one machine: start each with ``--reuse-port`` (``gateway.reuse_port``) on the same
port; the kernel spreads new connections over them (``SO_REUSEPORT``). Give them the same Redis (``[ratelimit]`` or
``[registry]``) so per-key limits and tier queue bounds hold across them.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import errno
import gc
import os
import signal
import socket
import sys
import time

import structlog
from aiohttp import web

from gateway.aio import wait_event
from gateway.app import build_app
from gateway.jobs.api import JOBS
from gateway.state import CONFIG, FLEET, GATEWAY_ID, METRICS, GatewayOptions
from shared.addresses import parse_address
from shared.config import CONFIG_ERROR_EXIT_STATUS, ConfigError, load_config, with_overrides
from shared.config_checks import check_config
from shared.errors import ErrorCode, SluiceError
from shared.logs import configure_logging

log = structlog.get_logger("sluice.gateway")

# glibc's mallopt parameter, and the size from which an allocation gets its own mapping (glibc's initial default).
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 * 1024
LISTEN_BACKLOG = 1024
SHUTDOWN_TIMEOUT_S = 2.0  # after the drain: how long aiohttp waits for handlers before cancelling them
DRAIN_POLL_INTERVAL_S = 0.05
READY_POLL_INTERVAL_S = 0.1
# Cyclic GC young-generation threshold, in tracked allocations net of frees. CPython's default (700) runs a
# collection every few requests at 32 concurrent streams, each traversing every young object of the requests in
# flight; the gateway's garbage is acyclic (refcounting frees it), so the collections found nothing. Measured with
# bench/gateway_bench.py's closed loop (3,000 requests at 32 concurrent): 700 → about 130 young collections taking
# 0.1–0.3 s of the gateway's CPU; 20,000 → none.
GC_GEN0_THRESHOLD = 20_000
SIMULATOR_WARNING = ("a worker is the roofline SIMULATOR (backend sim), not a model: it answers under the model's "
                     "name with random tokens")


def ready_url(host: str, port: int) -> str:
    """Return the URL a client on this machine uses for a gateway listening on ``host:port`` (a wildcard address
    becomes 127.0.0.1; an IPv6 address gets brackets)."""
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


async def announce_ready(app: web.Application, url: str) -> None:
    """Log ``ready at <url>`` (key ``url``) once the first worker is ready, then one warning when a ready worker is
    the roofline simulator."""
    fleet = app[FLEET]
    while not any(runtime.has_ready_worker() for runtime in fleet.runtimes.values()):
        await asyncio.sleep(READY_POLL_INTERVAL_S)
    ready = [worker for worker in fleet.worker_status() if worker.ready]
    log.info(f"ready at {url}", url=url, ready_workers=len(ready))
    simulators = [worker.name for worker in ready if worker.simulator]
    if simulators:
        log.warning("simulator_backend", workers=simulators, model=app[CONFIG].model.name, message=SIMULATOR_WARNING)


def tune_gc() -> None:
    """Tune the cyclic garbage collector for serving, once startup is done: freeze what startup made (imports, the
    tokenizer, the config: never garbage, so no later full collection traverses it again — ``gc.freeze``, as
    Instagram's "Dismissing Python Garbage Collection at Instagram", 2017, did for its web servers) and raise the
    young-generation threshold to ``GC_GEN0_THRESHOLD`` (cycles are still collected, just in larger batches)."""
    gc.freeze()
    _, gen1_threshold, gen2_threshold = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1_threshold, gen2_threshold)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sluice serve", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="config.toml (default: $SLUICE_CONFIG or ./config.toml)")
    parser.add_argument("--host", default=None, help="listen address (default: gateway.host)")
    parser.add_argument("--port", type=int, default=None, help="listen port (default: gateway.port)")
    parser.add_argument("--workers", type=int, default=None, help="local workers to spawn "
                        "(default: worker.num_local_workers)")
    parser.add_argument("--reuse-port", action="store_true", default=None,
                        help="listen with SO_REUSEPORT so several gateways share the port (default: "
                        "gateway.reuse_port)")
    parser.add_argument("--worker-address", action="append", default=[], metavar="HOST:PORT|unix:PATH",
                        help="connect to a running worker instead of spawning (repeatable; port 1-65535, a Unix "
                        "socket in a folder that exists)")
    return parser.parse_args(argv)


async def drain(app: web.Application, timeout_s: float, force: asyncio.Event) -> int:
    """Stop admitting and wait until no request and no job runs, ``timeout_s`` passed or ``force`` is set.

    Returns:
        The number of requests and jobs still running when the wait ended: each is ended with ``server_draining``
        (:meth:`Fleet.fail_requests`), which a request's handler writes during the shutdown that follows and which
        puts a job back in its queue (:meth:`gateway.jobs.runner.JobRunner._on_error`).
    """
    app[FLEET].start_draining()  # every pool's admission
    metrics, runner = app[METRICS], app[JOBS].runner
    started_s = time.monotonic()
    log.info("gateway_draining", active_requests=metrics.num_active_requests, running_jobs=runner.num_running,
             drain_timeout_s=timeout_s)
    while metrics.num_active_requests + runner.num_running > 0 and not force.is_set():
        left_s = timeout_s - (time.monotonic() - started_s)
        if left_s <= 0:
            break
        await wait_event(force, min(DRAIN_POLL_INTERVAL_S, left_s))
    active_requests, running_jobs = metrics.num_active_requests, runner.num_running
    ended = 0
    if active_requests + running_jobs > 0:
        # what still runs ends with an error its client can read (in-band on a stream, then [DONE]; a 503 before the
        # first byte) rather than a connection cut by the shutdown's cancellation, which a client cannot tell from a
        # network fault; the handlers write it within the shutdown's SHUTDOWN_TIMEOUT_S
        ended = app[FLEET].fail_requests(SluiceError(
            ErrorCode.DRAINING, f"The server is shutting down: the request did not finish within "
            f"gateway.drain_timeout_s ({timeout_s:g} s). Retry on another instance."))
    log.info("gateway_drained", active_requests=active_requests, running_jobs=running_jobs,
             ended_with_server_draining=ended, drain_s=round(time.monotonic() - started_s, 3))
    return active_requests + running_jobs


def return_large_blocks_to_the_os() -> None:
    """Keep glibc serving every allocation of :data:`MMAP_THRESHOLD_BYTES` or more from its own mapping, given back
    to the OS when freed (``mallopt(M_MMAP_THRESHOLD)``; a no-op on another C library, or when the user set
    ``MALLOC_MMAP_THRESHOLD_``). By default glibc raises the threshold to the size of the largest block freed, after
    which large request bodies and prompts are carved from the heap and their memory stays with the gateway long
    after (bench/oversized_prompt_bench.py: RSS 1.09 × its baseline 30 s after eight 600 KB prompts, 1.04 × with
    the fixed threshold)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


class ListenError(OSError):
    """The gateway cannot listen on its address; the message says which address and why, in one line."""


def bind_listeners(host: str, port: int, reuse_port: bool) -> list[socket.socket]:
    """Bind and listen on every address ``host:port`` resolves to (as ``loop.create_server`` does), non-blocking.

    Raises:
        ListenError: an address is taken, not this machine's, or not allowed; no socket stays open.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                shown = f"[{address[0]}]:{address[1]}" if family == socket.AF_INET6 else f"{address[0]}:{address[1]}"
                if exc.errno == errno.EADDRINUSE:
                    raise ListenError(f"{shown} is already in use (another sluice serve? choose another --port)") \
                        from None
                raise ListenError(f"cannot listen on {shown}: {exc.strerror}") from None
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def serve(options: GatewayOptions, listeners: list[socket.socket]) -> int:
    """Run the gateway on the bound ``listeners`` until SIGINT/SIGTERM, drain, then shut down in order (listener,
    requests, workers); or, when no pool can ever serve (:meth:`Fleet.startup_failure`), shut down at once.

    Returns:
        The exit status: 0, or :data:`~shared.config.CONFIG_ERROR_EXIT_STATUS` when no pool could serve.
    """
    config = options.config
    app = build_app(options)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    announcer: asyncio.Task[None] | None = None
    exit_status = 0
    try:
        for sock in listeners:
            await web.SockSite(runner, sock).start()
        tune_gc()
        log.info("gateway_listening", host=config.gateway.host, port=config.gateway.port, pid=os.getpid(),
                 gateway_id=app[GATEWAY_ID], reuse_port=config.gateway.reuse_port,
                 model=app[FLEET].default.config.model_name)  # the first pool's served name
        announcer = asyncio.create_task(announce_ready(app, ready_url(config.gateway.host, config.gateway.port)))
        stop, force = asyncio.Event(), asyncio.Event()

        def on_signal() -> None:
            (force if stop.is_set() else stop).set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        fleet = app[FLEET]
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(fleet.unservable.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        if stop.is_set():
            await drain(app, config.gateway.drain_timeout_s, force)
        else:
            log.error("gateway_cannot_serve", reason=fleet.unservable_reason)
            print(f"sluice serve: no pool can serve: {fleet.unservable_reason}", file=sys.stderr)
            exit_status = CONFIG_ERROR_EXIT_STATUS
        log.info("gateway_stopping")
    finally:
        if announcer is not None:
            announcer.cancel()
        await runner.cleanup()
    return exit_status


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
        if args.reuse_port is not None:
            gateway["reuse_port"] = args.reuse_port
        worker = {} if args.workers is None else {"num_local_workers": args.workers}
        config = with_overrides(config, gateway=gateway, worker=worker)
        for address in args.worker_address:
            parse_address(address, "--worker-address")
        check_config(config)  # keys, keys file, secret, upstream tokens, model paths: before starting anything
    except ConfigError as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 2
    config_path = os.path.abspath(args.config) if args.config else None
    options = GatewayOptions(config=config, config_path=config_path, worker_addresses=args.worker_address)
    try:
        listeners = bind_listeners(config.gateway.host, config.gateway.port, config.gateway.reuse_port)
    except ListenError as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 1
    return_large_blocks_to_the_os()
    try:
        import uvloop
    except ImportError:
        run = asyncio.run
    else:
        run = uvloop.run
    try:
        return run(serve(options, listeners))
    except ConfigError as exc:  # a check only the running gateway can make: still one line, not a traceback
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
