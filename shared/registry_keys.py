"""The Redis keys of the worker registry, shared by the workers that write it and the gateways that read it.

=================================  ======  =================================================================
key                                type    content
=================================  ======  =================================================================
``<prefix>:worker:<worker id>``    hash    the ``Hello`` fields, ``address`` (where gateways connect),
                                           ``incarnation`` (pid and start time), ``host``, ``pid``; expires
                                           after ``HASH_TTL_FACTOR`` heartbeat TTLs without a heartbeat
``<prefix>:alive:<worker id>``     string  "1" with a TTL of ``heartbeat_ttl_s``, refreshed every
                                           ``heartbeat_interval_s``: the worker is alive while it exists
``<prefix>:workers``               set     the worker ids (the index gateways scan)
``<prefix>:events``                pubsub  ``join <worker id>`` / ``leave <worker id>`` (a hint to rescan now)
=================================  ======  =================================================================
"""

from __future__ import annotations

# The hash outlives the alive key by this factor, so a gateway can still read who died.
HASH_TTL_FACTOR = 10


def registry_keys(key_prefix: str, worker_id: str) -> tuple[str, str]:
    """Return the (hash key, alive key) of ``worker_id``."""
    return f"{key_prefix}:worker:{worker_id}", f"{key_prefix}:alive:{worker_id}"


def index_key(key_prefix: str) -> str:
    """Return the key of the set of registered worker ids."""
    return f"{key_prefix}:workers"


def events_channel(key_prefix: str) -> str:
    """Return the pubsub channel of join/leave hints."""
    return f"{key_prefix}:events"
