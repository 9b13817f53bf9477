"""Typed application state of the gateway (``web.AppKey``s), shared by the app factory and the handlers."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from gateway.admission.controller import AdmissionController
from gateway.admission.caps import OutputCapper
from gateway.fleet.deep_ready import DeepReadiness
from gateway.fleet.fleet import Fleet
from gateway.metrics import Metrics
from gateway.admission.tier_counters import TierCounters
from gateway.pipeline.classify import TierResolver
from gateway.pipeline.request import RequestPipeline
from gateway.pipeline.tokenize import Tokenizer
from gateway.workers.pool import WorkerPool
from shared.config import Config


@dataclass(frozen=True)
class GatewayOptions:
    """How to run one gateway.

    Attributes:
        config: the loaded config (CLI flags already applied).
        config_path: the config file, passed on to spawned workers (None: their default resolution).
        worker_addresses: connect to these running workers (``HOST:PORT`` / ``unix:PATH``) instead of spawning.
        spawn_local_workers: spawn ``config.worker.num_local_workers`` workers (ignored when addresses are given).
        gateway_id: this gateway's id (``x-sluice-gateway``, its tier counters in Redis); "" = ``<hostname>-<pid>``.
    """

    config: Config
    config_path: str | None = None
    worker_addresses: list[str] = field(default_factory=list)
    spawn_local_workers: bool = True
    gateway_id: str = ""


OPTIONS = web.AppKey("options", GatewayOptions)
CONFIG = web.AppKey("config", Config)
METRICS = web.AppKey("metrics", Metrics)
TOKENIZER = web.AppKey("tokenizer", Tokenizer)
POOL = web.AppKey("pool", WorkerPool)
STARTED_AT = web.AppKey("started_at", float)
RESOLVER = web.AppKey("resolver", TierResolver)
ADMISSION = web.AppKey("admission", AdmissionController)
CAPPER = web.AppKey("capper", OutputCapper)
FLEET = web.AppKey("fleet", Fleet)  # pools, local and registry workers, autoscaler
PIPELINE = web.AppKey("pipeline", RequestPipeline)  # the completion request steps, for HTTP and jobs
GATEWAY_ID = web.AppKey("gateway_id", str)  # ``x-sluice-gateway`` on every response
TIER_COUNTERS = web.AppKey("tier_counters", TierCounters)  # per-tier counts of all gateways, via Redis
DEEP_READY = web.AppKey("deep_ready", DeepReadiness)  # /readyz?deep=1: every ready worker generates a token

REQUEST_ID = web.RequestKey("request_id", str)
CLIENT_REQUEST_ID = web.RequestKey("client_request_id", str)  # the client's X-Request-Id, echoed (http.middleware)
REQUEST_LOG = web.RequestKey("request_log", dict)  # fields of the request's log line, filled by the handler
