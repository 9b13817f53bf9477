"""``sluice config``: check a config file, or print the reference of every key.

Usage::

    sluice config --check [--config config.toml]     # decode and validate; print the file's effective source

``--check`` runs every check ``sluice serve`` makes before it starts (:func:`shared.config_checks.check_config`):
API keys and the keys file, the worker secret, the ``api_key_env`` variables of upstream pools, model paths that
look local; not what needs a worker or the network (a hub model id, an upstream's reachability).
    sluice config --reference [--output docs/config.md]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.config import PoolConfig


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``sluice config``."""
    parser = argparse.ArgumentParser(prog="sluice config", description="Check a config file, or print the "
                                     "reference of every config key (generated from shared/config.py).")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--check", action="store_true", help="decode and validate the config; exit 1 on an error")
    action.add_argument("--reference", action="store_true", help="print every key as Markdown (docs/config.md)")
    parser.add_argument("--config", default=None, help="with --check: the file (default: $SLUICE_CONFIG or "
                        "./config.toml; built-in defaults without one)")
    parser.add_argument("--output", default=None, metavar="PATH", help="with --reference: write here, not stdout")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sluice config``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.check and args.output is not None:
        parser.error("argument --output: only with --reference (--check writes nothing)")
    if args.reference:
        from shared.config_reference import render_markdown

        text = render_markdown()
        if args.output:
            with open(args.output, "w") as file:
                file.write(text)
        else:
            sys.stdout.write(text)
        return 0
    from shared.config import ConfigError, effective_pools, load_config
    from shared.config_checks import check_config

    try:
        config = load_config(args.config)
        check_config(config)  # what serve refuses at start: the same function serve runs
    except ConfigError as exc:
        print(f"sluice config: {exc}", file=sys.stderr)
        return 1
    pools = "; ".join(_pool_summary(pool) for pool in effective_pools(config))
    print(f"config ok ({_source(args.config)}): gateway {config.gateway.host}:{config.gateway.port}; pools: {pools}")
    return 0


def _pool_summary(pool: PoolConfig) -> str:
    """One pool in the ``--check`` line: its model id, and its upstreams or its local workers and backend."""
    if pool.backend == "openai":
        return f"{pool.name} ({pool.model_name}, {len(pool.upstreams)} upstream(s), engine {pool.engine})"
    low, high = pool.min_workers, pool.max_workers
    workers = f"{low}" if low == high else f"{low}-{high}"
    return f"{pool.name} ({pool.model_name}, {workers} local worker(s), backend {pool.backend})"


if __name__ == "__main__":
    sys.exit(main())


def _source(path: str | None) -> str:
    """Name what ``load_config(path)`` read: the file, or the defaults when there is none."""
    chosen = path or os.environ.get("SLUICE_CONFIG") or "config.toml"
    return chosen if path or os.path.exists(chosen) else "no config.toml here: the defaults"
