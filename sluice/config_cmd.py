"""``sluice config``: check a config file, or print the reference of every key.

Usage::

    sluice config --check [--config config.toml]     # decode and validate; print the file's effective source
    sluice config --reference [--output docs/config.md]
"""

from __future__ import annotations

import argparse
import sys


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
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.reference:
        from shared.config_reference import render_markdown

        text = render_markdown()
        if args.output:
            with open(args.output, "w") as file:
                file.write(text)
        else:
            sys.stdout.write(text)
        return 0
    from shared.config import ConfigError, load_config, validate_admission_config, validate_pool_config

    try:
        config = load_config(args.config)
        validate_admission_config(config)
        validate_pool_config(config)
    except ConfigError as exc:
        print(f"sluice config: {exc}", file=sys.stderr)
        return 1
    print(f"config ok: model {config.model.name}, gateway {config.gateway.host}:{config.gateway.port}, "
          f"{config.worker.num_local_workers} local worker(s), backend {config.worker.backend}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
