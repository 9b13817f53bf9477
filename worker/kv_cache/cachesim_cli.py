"""``sluice cachesim``: the command line of the prefix-cache simulator (:mod:`worker.kv_cache.cachesim`).

    sluice cachesim TRACE [--policy lru,adaptive] [--capacity-fractions 0.05,0.1,0.25] [--split] [--json OUT]
    sluice cachesim --synthetic mix:return_probability=0.8 [...]

``--split`` replays the two halves of the trace by time apart (each from a cold cache) and reports both: the first
half is the one to choose parameters on, the second the one to quote. ``--synthetic`` replays a generated trace
(:mod:`worker.kv_cache.synthetic_trace`) instead of a file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from shared.argtypes import POSITIVE_INT
from worker.kv_cache.cachesim import (
    DEFAULT_FRACTIONS,
    DEFAULT_TTL_S_BY_TIER,
    TraceRequest,
    compare,
    format_table,
    load_trace,
    plot,
    split_by_time,
    trace_stats,
)
from worker.kv_cache.eviction import make_policy, policy_names
from worker.kv_cache.synthetic_trace import SHAPES, generate, parse_shape


def _parse_fractions(text: str) -> tuple[float, ...]:
    """argparse type: ``0.05,0.1`` -> (0.05, 0.1), each fraction in (0, 1]."""
    fractions = []
    for item in filter(None, (item.strip() for item in text.split(","))):
        try:
            fraction = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers in (0, 1], got {item!r}") from None
        if not 0.0 < fraction <= 1.0:  # NaN fails this too
            raise argparse.ArgumentTypeError(f"each fraction must be in (0, 1], got {item}")
        fractions.append(fraction)
    if not fractions:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in (0, 1], got {text!r}")
    return tuple(fractions)


def _parse_tier_mix(text: str) -> tuple[tuple[str, int, int], ...]:
    """argparse type: ``vip:2:20,standard:1:60,free:0:20`` -> ((name, priority, percent), …).

    Names are distinct and non-empty, priority and percent integers, percents ≥ 0 and summing to 100.
    """
    mix: list[tuple[str, int, int]] = []
    for item in text.split(","):
        name, *numbers = item.strip().split(":")
        try:
            if len(numbers) != 2 or not name:
                raise ValueError
            priority, percent = int(numbers[0]), int(numbers[1])
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"entry {item!r}: expected name:priority:percent with integers (e.g. vip:2:20)") from None
        if percent < 0:
            raise argparse.ArgumentTypeError(f"entry {item!r}: percent must be ≥ 0")
        if any(name == other for other, _, _ in mix):
            raise argparse.ArgumentTypeError(f"tier {name!r} is given twice")
        mix.append((name, priority, percent))
    total = sum(percent for _, _, percent in mix)
    if total != 100:
        raise argparse.ArgumentTypeError(f"percents must sum to 100, got {total} in {text!r}")
    return tuple(mix)


def _parse_policies(text: str) -> tuple[str, ...]:
    """argparse type: ``lru,sluice`` -> ("lru", "sluice"); every name must be a known policy."""
    names = tuple(filter(None, (name.strip() for name in text.split(","))))
    if not names:
        raise argparse.ArgumentTypeError(f"expected policy names, got {text!r}; valid: {', '.join(policy_names())}")
    for name in names:
        try:
            make_policy(name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice cachesim", description=__doc__.split("\n")[0])
    parser.add_argument("trace", nargs="?", default=None,
                        help="Mooncake JSONL trace: one {timestamp (ms), input_length, hash_ids} per line "
                             "(or --synthetic)")
    parser.add_argument("--synthetic", default=None, metavar="SHAPE[:key=value,…]",
                        help=f"replay a generated trace instead: one of {', '.join(sorted(SHAPES))}, fields "
                             "overridden as key=value (ranges as min-max), e.g. mix:seed=3,return_probability=0.8")
    parser.add_argument("--split", action="store_true",
                        help="replay the first and second half of the trace (by time) apart; quote the second")
    parser.add_argument("--policy", type=_parse_policies, nargs="+", action="extend", default=None,
                        metavar="NAME",
                        help="eviction policies to compare, space- or comma-separated, repeatable "
                             f"(default: all of {', '.join(policy_names())})")
    capacity = parser.add_mutually_exclusive_group()
    capacity.add_argument("--capacity-blocks", type=POSITIVE_INT, action="append", default=None, metavar="N",
                          help="pool size in blocks (≥ 1), repeatable")
    capacity.add_argument("--capacity-fractions", type=_parse_fractions, default=None, metavar="F,F,…",
                          help="pool sizes as fractions in (0, 1] of the trace's distinct blocks "
                               f"(default {','.join(str(f) for f in DEFAULT_FRACTIONS)})")
    parser.add_argument("--block-size-tokens", type=POSITIVE_INT, default=512, metavar="N",
                        help="tokens per trace block, ≥ 1 (default %(default)s, Mooncake's)")
    parser.add_argument("--keep-first-block", action="store_true",
                        help="keep hash_ids[0] even when every request shares it")
    parser.add_argument("--tier-mix", type=_parse_tier_mix, default="vip:2:20,standard:1:60,free:0:20",
                        metavar="NAME:PRIORITY:PERCENT,…",
                        help="tiers conversations are hashed into; percents sum to 100 (default %(default)s)")
    parser.add_argument("--max-requests", type=POSITIVE_INT, default=None, metavar="N",
                        help="read only the first N requests of the trace (≥ 1; default all); those left with no "
                        "full block once the shared first block is dropped are not replayed, so the count printed "
                        "may be lower")
    parser.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the results as JSON here")
    parser.add_argument("--plot", dest="plot_out", default=None, metavar="OUT", help="write a PNG plot here")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``sluice cachesim``; return the exit status.

    Raises:
        SystemExit: 2 with an argparse usage error naming the argument, for a bad option or an unreadable or
            malformed trace (checked before any simulation runs).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    policies = list(dict.fromkeys(name for names in args.policy or [policy_names()] for name in names))
    for option, out_path in (("--json", args.json_out), ("--plot", args.plot_out)):
        if out_path and not Path(out_path).resolve().parent.is_dir():
            parser.error(f"argument {option}: no such directory {Path(out_path).resolve().parent}")
    if args.plot_out and importlib.util.find_spec("matplotlib") is None:
        parser.error("argument --plot: the plot needs matplotlib: pip install 'sluice[sim]'")
    if (args.trace is None) == (args.synthetic is None):
        parser.error("argument trace: give a trace file or --synthetic SHAPE (one of them)")
    if args.synthetic is not None:
        try:
            requests = generate(parse_shape(args.synthetic), args.tier_mix)[:args.max_requests]
        except ValueError as exc:
            parser.error(f"argument --synthetic: {exc}")
        source = f"synthetic:{args.synthetic}"
    else:
        requests = _load_or_exit(parser, args)
        source = str(args.trace)
    if not requests:
        parser.error(f"argument trace: {source} holds no request with a full block of {args.block_size_tokens} "
                     "tokens")
    parts = dict(zip(("first_half", "second_half"), split_by_time(requests))) if args.split else {"all": requests}
    report: dict = {"trace": source, "tier_mix": [list(t) for t in args.tier_mix],
                    "ttl_s_by_tier": DEFAULT_TTL_S_BY_TIER, "belady": "MIN with bypass over the block reference stream"}
    for part, part_requests in parts.items():
        if not part_requests:
            parser.error(f"argument --split: the {part.replace('_', ' ')} of {source} holds no request")
        stats, runs = _run(part_requests, policies, args)
        if args.split:
            role = "choose parameters on this one" if part == "first_half" else "quote this one"
            print(f"{part.replace('_', ' ')} ({role}):")
            report[part] = {**stats, "runs": runs}
        else:
            report.update(stats, runs=runs)
        print(f"{stats['num_requests']} requests, {stats['num_block_refs']} block refs, "
              f"{stats['num_distinct_blocks']} distinct blocks; compulsory bound "
              f"{stats['compulsory_bound_hit_rate']:.4f}")
        print(format_table(runs))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.plot_out:
        runs = report["second_half"]["runs"] if args.split else report["runs"]
        plot(runs, args.plot_out, title="second half of the trace" if args.split else "prefix cache hit rate")
    return 0


def _load_or_exit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[TraceRequest]:
    try:
        return load_trace(args.trace, args.block_size_tokens, not args.keep_first_block, args.tier_mix,
                          args.max_requests)
    except OSError as exc:
        parser.error(f"argument trace: {exc.strerror or exc}: {args.trace}")
    except ValueError as exc:
        parser.error(f"argument trace: {exc}")


def _run(requests: Sequence[TraceRequest], policies: list[str], args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """Replay ``requests`` at the capacities the arguments ask for; return (trace stats, runs)."""
    stats = trace_stats(requests)
    if args.capacity_blocks:
        capacities = args.capacity_blocks
    else:
        fractions = args.capacity_fractions or DEFAULT_FRACTIONS
        capacities = [max(1, int(f * stats["num_distinct_blocks"])) for f in fractions]
    return stats, compare(requests, capacities, policies)


if __name__ == "__main__":
    sys.exit(main())
