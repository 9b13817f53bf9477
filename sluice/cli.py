"""The ``sluice`` command: ``serve`` (gateway + local workers), ``worker``, and tools.

Each subcommand imports its own package lazily, so ``sluice worker`` never imports aiohttp and ``sluice serve``
never imports torch.
"""

from __future__ import annotations

import sys

_SUBCOMMANDS = {  # name: (module, function, what it does)
    "serve": ("gateway.__main__", "main", "run the gateway and its local workers (the server)"),
    "worker": ("worker.__main__", "main", "run one worker on its own (a model, or the sim backend)"),
    "replay": ("loadtest.replay", "main", "replay a request trace against a gateway and report TTFT per tier"),
    "plan": ("sluice.plan", "main", "capacity planner: workers needed for a trace or rate and TTFT SLOs"),
    "cachesim": ("worker.kv_cache.cachesim_cli", "main", "KV eviction policies against Belady on a trace"),
    "config": ("sluice.config_cmd", "main", "check a config file, or print the reference of every key"),
}


def usage() -> str:
    """Return ``sluice --help``: the commands, one line each."""
    width = max(map(len, _SUBCOMMANDS))
    lines = ["usage: sluice <command> [options]   (sluice <command> --help for its options)", "",
             "An OpenAI-compatible gateway for chat models when GPUs are scarce.", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, _, summary) in _SUBCOMMANDS.items()]
    lines += ["", "options:", "  -h, --help     show this help", "  --version      print the version"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``sluice <subcommand> [args…]``; return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from sluice import __version__

        print(f"sluice {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in _SUBCOMMANDS:
        print(f"sluice: unknown command {name!r}; valid: {', '.join(_SUBCOMMANDS)} (sluice --help)",
              file=sys.stderr)
        return 2
    import importlib

    module_name, func_name, _ = _SUBCOMMANDS[name]
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
