"""A real ``sluice serve`` with one local **sim** worker (the roofline simulator), for tests of the operational
surface (status page, Grafana dashboard) that need live ``/status`` and ``/metrics`` but no model forward pass.

Each test module starts its own (module-scoped fixture) with ``tests/conftest.py``'s :func:`sluice_serve`, as the
session server is started: the same process handling and shutdown check (no worker outlives the gateway).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from tests.conftest import SluiceServer, sluice_serve

SIM_SERVER_START_TIMEOUT_S = 180.0
MODEL_NAME = "SmolLM2-135M-Instruct"

# A small simulated KV pool (0.25 GiB at 128 KiB per token = 128 blocks of 16 tokens) and 4 running sequences at
# most, so a handful of concurrent clients fills the KV pool, queues in admission and, in the ``free`` tier (queue
# of 1, 30 requests per minute), gets rejected.
SIM_GATEWAY_CONFIG = f"""
[model]
name = "{MODEL_NAME}"

[gateway]
max_tokens_cap = 256
default_max_tokens = 64

[worker]
num_local_workers = 1
backend = "sim"
max_num_seqs = 4
capacity_interval_s = 0.25

[sim]
kv_cache_gib = 0.25

[[tiers]]
name = "vip"
priority = 3
queue_capacity = 64
queue_timeout_s = 30.0

[[tiers]]
name = "standard"
priority = 2
queue_capacity = 64
queue_timeout_s = 30.0

[[tiers]]
name = "free"
priority = 1
queue_capacity = 1
queue_timeout_s = 30.0
rpm_limit = 30

[[tiers]]
name = "batch"
priority = 0
queue_capacity = 64
queue_timeout_s = 60.0
"""


def sim_gateway(workdir: Path, config_text: str = SIM_GATEWAY_CONFIG) -> contextlib.AbstractContextManager[SluiceServer]:
    """Run ``sluice serve`` with ``config_text`` (default :data:`SIM_GATEWAY_CONFIG`) in ``workdir`` until the block
    exits; see :func:`tests.conftest.sluice_serve`."""
    return sluice_serve(workdir, config_text, SIM_SERVER_START_TIMEOUT_S, poll_interval_s=0.3)
