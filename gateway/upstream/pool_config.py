"""Build the :class:`~gateway.upstream.client.UpstreamClient` of one upstream URL of a ``backend = "openai"`` pool."""

from __future__ import annotations

from collections.abc import Callable

from gateway.upstream.client import UpstreamClient
from gateway.workers.breaker import CircuitBreaker
from shared.config import Config, PoolConfig, effective_tiers
from shared.config_checks import upstream_api_key
from shared.protocol import Capacity


def make_upstream_client(pool: PoolConfig, url: str, name: str, config: Config,
                         on_capacity: Callable[[str, Capacity], None], breaker: CircuitBreaker) -> UpstreamClient:
    """Return the client of upstream ``url`` of ``pool`` (started by the fleet with the other remote workers)."""
    index = next((i for i, configured in enumerate(config.pools) if configured.name == pool.name), None)
    key = f"pools[{index}]" if index is not None else f"pool '{pool.name}'"
    return UpstreamClient(url, name, engine=pool.engine, model=pool.upstream_model or pool.model_name,
                          max_concurrency=pool.max_concurrency, kv_capacity_tokens=pool.kv_capacity_tokens,
                          max_model_len_tokens=config.model.max_model_len_tokens,
                          metrics_interval_s=pool.metrics_interval_s, api_key=upstream_api_key(pool),
                          on_capacity=on_capacity, breaker=breaker,
                          top_tier_priority=(max(tier.priority for tier in effective_tiers(config))
                                             if config.admission.enabled else 0),
                          model_key=f"{key}.upstream_model")
