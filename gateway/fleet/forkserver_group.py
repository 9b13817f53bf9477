"""Imported by the worker fork server alone, as its first preload module (:class:`gateway.fleet.spawn.WorkerSpawner`):
moves the fork server into a process group of its own, and with it every worker it forks.

A signal sent to the gateway's whole process group — Ctrl-C in a terminal (SIGINT), ``kill -TERM -- -<pgid>``, a
supervisor that signals the group — then reaches the gateway alone: it drains (the requests in flight on its
workers finish, within ``gateway.drain_timeout_s``) and stops its workers itself. With the workers in the gateway's
group they stopped at once, and every request in flight failed with 502 ``worker_failed``. Workers still die with the
gateway (:mod:`gateway.fleet.spawn`: the gateway's sentinel, ``PR_SET_PDEATHSIG``). An exec'd worker gets the same
process group of its own from :func:`gateway.fleet.spawn.start_exec_worker`.

Importing this module anywhere but in the fork server would move that process out of its group: nothing else
imports it.
"""

import os

os.setpgrp()
