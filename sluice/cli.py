"""The ``sluice`` command: ``serve`` (gateway + local workers), ``worker``, and tools.

Each subcommand imports its own package lazily, so ``sluice worker`` never imports aiohttp and ``sluice serve``
never imports torch.
"""

from __future__ import annotations

import sys

_SUBCOMMANDS = {
    "serve": ("gateway.__main__", "main"),
    "worker": ("worker.__main__", "main"),
    "cachesim": ("worker.kv_cache.cachesim_cli", "main"),
    "replay": ("loadtest.replay", "main"),
    "plan": ("sluice.plan", "main"),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``sluice <subcommand> [args…]``; return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: sluice {" + ",".join(sorted(_SUBCOMMANDS)) + "} [options]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in _SUBCOMMANDS:
        print(f"sluice: unknown subcommand {name!r}; valid: {', '.join(sorted(_SUBCOMMANDS))}", file=sys.stderr)
        return 2
    import importlib

    module_name, func_name = _SUBCOMMANDS[name]
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
