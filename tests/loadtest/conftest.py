"""A real ``sluice serve`` with two sim (roofline SIMULATOR) workers, for the load-test end-to-end tests.

The default tier is the top one (``vip``) so that the replayer and locust can pick any tier with the
``x-sluice-tier`` header (which only lowers). ``sim.time_scale = 2`` makes the simulated H200 twice slower so
queues form at request rates this 2-core machine can drive.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import SluiceServer, sluice_serve

SIM_CONFIG = """
default_tier = "vip"

[worker]
num_local_workers = 2
backend = "sim"

[sim]
time_scale = 2.0
"""
START_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def sim_server(tmp_path_factory) -> Iterator[SluiceServer]:
    with sluice_serve(tmp_path_factory.mktemp("sim_server"), SIM_CONFIG, START_TIMEOUT_S, min_ready_workers=2) as server:
        yield server
