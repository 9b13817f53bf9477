"""``sluice worker``: load the model, size the KV pool, and serve gateways over TCP or a Unix socket.

Usage::

    sluice worker --listen 127.0.0.1:9100 [--config config.toml] [--backend cpu|cuda|sim]
    sluice worker --listen unix:/tmp/sluice-worker.sock
    SLUICE_WORKER__SECRET=… sluice worker --listen 0.0.0.0:9100 --advertise 10.0.0.5:9100 \
        --registry redis://10.0.0.1:6379/0

A worker listening beyond loopback needs the shared secret (``worker.secret``, ``worker.secret_file`` or
``SLUICE_WORKER__SECRET``) unless started with ``--insecure-no-secret``.

A malformed ``--listen`` or ``--advertise`` (:func:`shared.addresses.parse_address`: a port outside 1-65535, no
port, a Unix socket in a folder that does not exist) ends it with one line naming the option and exit status 2; an
address it cannot bind (in use, not this machine's) with one line and exit status 1; both before the model loads.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import atexit
import errno
import os
from pathlib import Path
import signal
import socket
import sys
import time
import uuid

import structlog

from shared.addresses import TcpAddress, parse_address
from shared.auth import is_loopback_listen, load_secret
from shared.config import (
    CONFIG_ERROR_EXIT_STATUS,
    Config,
    ConfigError,
    check_kv_disk_cache_dir,
    load_config,
    resolve_model_path,
    validate_worker_config,
    with_overrides,
)
from shared.logs import configure_logging
from shared.model_files import content_key
from shared.protocol import Capacity, Hello

log = structlog.get_logger("sluice.worker")

SIMULATOR_WARNING = ("worker.backend = \"sim\": this worker is the roofline SIMULATOR, not a model; it answers "
                     "under the model's name with random tokens, timed as the simulated GPU would run them")

GIB = 1024**3


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sluice worker", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT (port 1-65535) or unix:PATH (in a folder "
                        "that exists)")
    parser.add_argument("--config", default=None, help="config.toml (default: $SLUICE_CONFIG or ./config.toml)")
    parser.add_argument("--backend", choices=["auto", "cpu", "cuda", "sim"], default=None)
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--registry", default=None, help="redis://… URL: register in the worker registry")
    parser.add_argument("--advertise", default=None, help="HOST:PORT gateways connect to (default: --listen)")
    parser.add_argument("--insecure-no-secret", action="store_true",
                        help="listen beyond loopback without a shared secret: anyone who reaches the port can "
                        "generate, abort and drain (worker.allow_insecure)")
    parser.add_argument("--exit-reason-file", default=None, metavar="PATH",
                        help="on a configuration error, also write its one-line reason here (the gateway that "
                        "spawned this worker reads it)")
    return parser.parse_args(argv)


def config_error_exit(reason: str, exit_reason_path: str | None) -> int:
    """Report a configuration error: print ``sluice worker: <reason>`` on stderr, write ``reason`` to
    ``exit_reason_path`` when given, and return :data:`~shared.config.CONFIG_ERROR_EXIT_STATUS` (the exit status
    after which a gateway does not restart this worker)."""
    print(f"sluice worker: {reason}", file=sys.stderr)
    if exit_reason_path:
        try:
            Path(exit_reason_path).write_text(reason + "\n")
        except OSError as exc:
            print(f"sluice worker: cannot write --exit-reason-file {exit_reason_path}: {exc}", file=sys.stderr)
    return CONFIG_ERROR_EXIT_STATUS


#: Exit status when ``--listen`` cannot be bound (in use, not this machine's, not allowed), as ``sluice serve``'s.
LISTEN_ERROR_EXIT_STATUS = 1


def listen_error(listen: str, exc: OSError) -> str:
    """Return the one-line reason ``--listen`` cannot be bound."""
    if exc.errno == errno.EADDRINUSE:
        return f"--listen {listen} is already in use (another worker? choose another port)"
    return f"cannot listen on {listen}: {exc.strerror or exc}"


def probe_listen(address: TcpAddress) -> None:
    """Bind every address ``host:port`` resolves to, as the worker will, and close the sockets again: a port in use
    or a host that is not this machine's is found before the model loads, not after.

    Raises:
        OSError: the bind's error (``socket.gaierror`` for a host that does not resolve).
    """
    infos = socket.getaddrinfo(address.host or "127.0.0.1", address.port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    for family, kind, proto, _, sockaddr in dict.fromkeys(infos):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's start_server
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)


def check_num_kv_blocks(num_blocks: int, kv_cache_key: str, kv_cache_gib: float, block_size_tokens: int,
                        bytes_per_block: int) -> None:
    """Check that the KV pool holds at least 2 blocks (the scheduler needs one to grow a sequence into).

    Args:
        num_blocks: blocks that fit in the pool.
        kv_cache_key: the key that sized the pool (``worker.kv_cache_gib``, ``sim.kv_cache_gib``).
        kv_cache_gib: its value, GiB.
        block_size_tokens: ``worker.block_size_tokens``.
        bytes_per_block: bytes of one block for this model (all layers, K and V).

    Raises:
        ConfigError: fewer than 2 blocks; the message names both keys and what fixes it.
    """
    if num_blocks >= 2:
        return
    raise ConfigError(
        f"{kv_cache_key} = {kv_cache_gib:g} holds fewer than 2 KV blocks of worker.block_size_tokens = "
        f"{block_size_tokens} tokens ({bytes_per_block} bytes each for this model; it holds {num_blocks}): raise "
        f"{kv_cache_key} to at least {2 * bytes_per_block / GIB:.3g} or lower worker.block_size_tokens")


def kv_model_id(config: Config, weights_mode: str) -> str:
    """Return the name under which this worker's KV blocks are shared (the Redis tier's keys): the served model's
    name, the weights it runs (``int4`` / ``int8`` / a dtype: the same checkpoint quantized otherwise computes other
    K/V) and which weights those are (a synthetic model's shape; a file's name and the first 16 hex digits of its
    content hash, :func:`shared.model_files.content_key`, which loading it computed already; a folder's name and the
    size in bytes of its safetensors files), so two checkpoints served under one name are not mixed up, e.g.
    ``SmolLM2-135M-Instruct:int4:SmolLM2-135M-Instruct.Q4_1.gguf-<16 hex>``."""
    if config.model.synthetic:
        source = f"synthetic-{config.model.synthetic}"
    else:
        path = Path(resolve_model_path(config.model))
        if path.is_dir():
            source = f"{path.name}-{sum(f.stat().st_size for f in path.glob('*.safetensors'))}"
        else:
            source = f"{path.name}-{content_key(str(path))[:16]}"
    return f"{config.model.name}:{weights_mode or 'dense'}:{source}"


def physical_cores() -> int:
    """Return the physical cores this process may run on (hyperthread siblings counted once)."""
    allowed = os.sched_getaffinity(0)
    cores = set()
    for cpu in allowed:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def capture_decode_graphs(model, kv_cache, wc, max_model_len_tokens: int, pad_block_id: int):
    """Capture the decode CUDA graphs (``worker.cuda_graphs``); log their capture time and memory.

    Returns:
        The :class:`worker.cuda_graphs.DecodeGraphs`, or None (eager decode) when the attention backend is not
        ``cupy`` (the torch backend's decode shapes follow the contexts) or capture failed (logged).
    """
    from worker.cuda_graphs import DecodeGraphs

    attention_name = getattr(model.attention, "name", "")
    if attention_name != "cupy":
        log.warning("cuda_graphs_off", reason=f"attention backend {attention_name!r}: graphs need 'cupy'")
        return None
    max_model_len = min(max_model_len_tokens, model.spec.max_position_embeddings)
    graphs = DecodeGraphs(model, kv_cache, wc.block_size_tokens, wc.max_num_seqs, max_model_len, pad_block_id)
    try:
        report = graphs.capture()
    except Exception as exc:  # noqa: BLE001 - a failed capture costs speed, not correctness: run eagerly
        log.exception("cuda_graphs_capture_failed", error=str(exc))
        return None
    log.info("cuda_graphs_captured", buckets=list(report.sizes), capture_s=round(report.capture_s, 2),
             memory_mib=round(report.memory_bytes / 2**20, 1))
    return graphs


def _build_torch_runner(config: Config, backend: str):
    """Load the model on ``backend`` (``cpu`` or ``cuda``), allocate the KV pool and return
    ``(ModelRunner, ModelSpec, num_blocks, device name, attention backend name, OffloadChain, weights mode)``.

    Raises:
        ConfigError: the model cannot be loaded as configured, or the KV pool holds fewer than 2 blocks.
    """
    import torch

    from worker.kv_cache.offload.chain import build_offload_chain
    from worker.model import load_model
    from worker.model_runner import ModelRunner

    wc = config.worker
    device = torch.device("cuda" if backend == "cuda" else "cpu")
    if backend == "cpu":
        torch.set_num_threads(wc.num_threads if wc.num_threads > 0 else physical_cores())
    dtype_name = config.model.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    weights_mode = config.model.weights
    if device.type == "cuda" and weights_mode not in ("int4", "int8"):
        weights_mode = ""  # a GPU runs dense weights in dtype unless asked for int4 / int8
    if weights_mode == "auto" and config.model.dtype != "auto":
        weights_mode = ""  # an explicit dtype keeps a folder (or a GGUF file) dense in that dtype
    load_start_s = time.perf_counter()
    try:
        if config.model.synthetic:
            from worker.synthetic import build_synthetic_model, synthetic_spec

            mode = weights_mode if weights_mode not in ("", "auto") else dtype_name
            model = build_synthetic_model(synthetic_spec(config.model.synthetic), mode, device,
                                          attention_backend=wc.attention_backend)
        else:
            model = load_model(resolve_model_path(config.model), getattr(torch, dtype_name), device,
                               attention_backend=wc.attention_backend, weights_mode=weights_mode)
    except ValueError as exc:
        raise ConfigError(f"model (weights = {config.model.weights!r}, synthetic = "
                          f"{config.model.synthetic!r}): {exc}") from exc
    log.info("model_loaded", weights=model.weights_mode, dtype=str(model.dtype),
             threads=torch.get_num_threads(), load_s=round(time.perf_counter() - load_start_s, 3))
    dtype = model.dtype
    dtype_name = str(dtype).removeprefix("torch.")
    spec = model.spec
    bytes_per_block = model.kv_cache_bytes_per_block(wc.block_size_tokens, dtype)
    num_blocks = int(wc.kv_cache_gib * GIB // bytes_per_block)
    check_num_kv_blocks(num_blocks, "worker.kv_cache_gib", wc.kv_cache_gib, wc.block_size_tokens, bytes_per_block)
    use_graphs = device.type == "cuda" and wc.cuda_graphs
    # with CUDA graphs, one spare block (id num_blocks) takes the padding rows' K/V writes
    kv_cache = model.allocate_kv_cache(num_blocks + int(use_graphs), wc.block_size_tokens)
    decode_graphs = None
    if use_graphs:
        decode_graphs = capture_decode_graphs(model, kv_cache, wc, config.model.max_model_len_tokens, num_blocks)
    runner = ModelRunner(model, kv_cache, wc.block_size_tokens, device, decode_graphs)
    offload = build_offload_chain(config.kv, runner.block_io, kv_model_id(config, model.weights_mode), dtype_name)
    atexit.register(offload.close)  # the disk tier's folder
    attention_name = getattr(model.attention, "name", type(model.attention).__name__)
    return runner, spec, num_blocks, str(device), attention_name, offload, model.weights_mode


def build_worker(config: Config, worker_id: str, secret: bytes | None = None):
    """Load the model (or the simulator), size the KV pool and return a ready :class:`WorkerServer`.

    The simulator never imports torch (seconds of a cold start for nothing it uses). ``secret``: the shared secret
    every gateway connection must prove (None: none)."""
    from worker.engine import Engine
    from worker.kv_cache.manager import KVCacheManager
    from worker.scheduler import Scheduler
    from worker.server import WorkerServer

    wc = config.worker
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    backend = wc.backend
    if backend == "auto":
        import torch

        backend = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "sim":
        from worker.backends.sim import build_sim_runner

        runner, spec, num_blocks, device_name, attention_name = build_sim_runner(config)
        check_num_kv_blocks(num_blocks, "sim.kv_cache_gib", config.sim.kv_cache_gib, wc.block_size_tokens,
                            config.sim.kv_bytes_per_token * wc.block_size_tokens)
        weights = "sim"
        offload = block_copier = None  # the simulator has no KV tensor to move
        log.warning("simulator_backend", worker_id=worker_id, model=config.model.name, device=device_name,
                    message=SIMULATOR_WARNING)
    else:
        # Everything that runs torch operators runs on the engine thread: an OpenMP team started by a second thread
        # (the main one, here) makes libgomp count more threads than cores and throttle its spin-wait, and every
        # parallel region of the engine's steps then pays a futex wake-up (measured on 2 cores: 1 stream 31 ms a
        # step loaded on the main thread, 15 ms loaded on the engine thread).
        runner, spec, num_blocks, device_name, attention_name, offload, weights = executor.submit(
            _build_torch_runner, config, backend).result()
        block_copier = runner.block_io.copy_block_prefix
    max_model_len = min(config.model.max_model_len_tokens, spec.max_position_embeddings)
    levels = (config.pressure.elevated, config.pressure.critical)
    kv_manager = KVCacheManager(
        num_blocks, wc.block_size_tokens, enable_prefix_caching=wc.enable_prefix_caching,
        eviction_policy=config.kv.eviction_policy, config=config.kv, offload=offload,
        pressure_thresholds=tuple((lv.enter_kv_used_fraction, lv.leave_kv_used_fraction) for lv in levels),
        block_copier=block_copier,
    )
    scheduler = Scheduler(kv_manager, wc.max_num_seqs, wc.max_num_batched_tokens, max_model_len)
    engine = Engine(scheduler, runner, spec.eos_token_ids)
    hello = Hello(
        worker_id=worker_id,
        model_id=config.model.name,
        backend=backend,
        device=device_name,
        block_size_tokens=wc.block_size_tokens,
        num_kv_blocks=num_blocks,
        kv_capacity_tokens=num_blocks * wc.block_size_tokens,
        max_num_seqs=wc.max_num_seqs,
        max_model_len_tokens=max_model_len,
        attention_backend=attention_name,
        weights=weights,
    )

    def capacity() -> Capacity:
        stats = scheduler.stats()
        return Capacity(
            free_kv_blocks=stats.num_free_blocks,
            total_kv_blocks=stats.num_total_blocks,
            used_kv_blocks=stats.num_used_blocks,
            cached_kv_blocks=stats.num_cached_blocks,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            decode_tokens_per_s=engine.decode_tokens_per_s(),
            prefill_tokens_per_s=engine.prefill_tokens_per_s(),
            prefix_hit_rate=engine.prefix_hit_rate(),
            num_preemptions=stats.num_preemptions,
            pressure=kv_manager.pressure,  # the level retention applies: [pressure.*] thresholds, hysteresis
            kv_stats=engine.kv_stats(),
            sequence_decode_tokens_per_s=engine.sequence_decode_tokens_per_s(),
            sequence_prefill_tokens_per_s=engine.sequence_prefill_tokens_per_s(),
            busy_tokens_per_s=engine.busy_tokens_per_s(),
        )

    return WorkerServer(
        engine,
        hello,
        capacity,
        max_model_len,
        capacity_interval_s=wc.capacity_interval_s,
        secret=secret,
        executor=executor,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sluice worker``; returns the exit status."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    configure_logging(sys.stdout)
    try:
        listen = parse_address(args.listen, "--listen")
        if args.advertise is not None:
            parse_address(args.advertise, "--advertise")
        config = load_config(args.config)
        if args.backend:
            config = with_overrides(config, worker={"backend": args.backend})
        validate_worker_config(config)
        if config.worker.backend != "sim":  # the simulator has no KV tensor to offload
            check_kv_disk_cache_dir(config.kv)
        secret = load_secret(config.worker)
    except ConfigError as exc:
        return config_error_exit(str(exc), args.exit_reason_file)
    advertise = None
    if args.registry:
        from worker.registry import WorkerRegistration, resolve_advertise

        try:
            advertise = resolve_advertise(args.listen, args.advertise)
        except ConfigError as exc:
            return config_error_exit(str(exc), args.exit_reason_file)
    allow_insecure = args.insecure_no_secret or config.worker.allow_insecure
    if secret is None and not is_loopback_listen(args.listen):
        if not allow_insecure:
            return config_error_exit(f"--listen {args.listen} is reachable from other machines and no shared "
                                     "secret is set: set worker.secret_file (or SLUICE_WORKER__SECRET), or pass "
                                     "--insecure-no-secret", args.exit_reason_file)
        log.warning("worker_insecure_no_secret", listen=args.listen,
                    note="anyone who reaches this port can generate, abort and drain")
    if isinstance(listen, TcpAddress):
        try:
            probe_listen(listen)
        except OSError as exc:
            print(f"sluice worker: {listen_error(args.listen, exc)}", file=sys.stderr)
            return LISTEN_ERROR_EXIT_STATUS
    worker_id = args.worker_id or f"worker-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        server = build_worker(config, worker_id, secret)
    except ConfigError as exc:
        return config_error_exit(str(exc), args.exit_reason_file)

    async def run() -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await server.start(args.listen)
        except OSError as exc:  # taken since the probe, or a Unix socket path that cannot be bound
            print(f"sluice worker: {listen_error(args.listen, exc)}", file=sys.stderr)
            await server.close()
            return LISTEN_ERROR_EXIT_STATUS
        registration = None
        if advertise is not None:
            registration = WorkerRegistration.from_url(args.registry, server.hello, advertise, config.registry)
            await registration.start()
        await stop.wait()
        log.info("worker_stopping", worker_id=worker_id)
        if registration is not None:
            await registration.close()
        await server.close()
        return 0

    try:
        import uvloop
    except ImportError:
        return asyncio.run(run())
    return uvloop.run(run())


if __name__ == "__main__":
    sys.exit(main())
