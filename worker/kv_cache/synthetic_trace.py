"""Synthetic prefix-cache traces: conversations with a chosen return probability and gap distribution, shared
system prompts and one-shot queries, for shapes of traffic the Mooncake trace does not have.

A trace is a list of :class:`~worker.kv_cache.cachesim.TraceRequest` (what ``sluice cachesim`` replays), built
from a :class:`TraceShape`::

    conversation  = [system prompt blocks (shared, optional)] + turn 1's own blocks
    next turn     = the previous prompt + the previous answer and the new message (``turn_growth_blocks``),
                    arriving a gap (exponential, lognormal or Pareto, mean ``mean_gap_s``) after the previous
                    one, with probability ``return_probability`` (else the conversation is over)
    one-shot      = a prompt of ``one_shot_blocks`` own blocks that never returns (a scan for the cache)

Block hashes are distinct integers per block of content, so two prompts share a hash exactly where they share a
prefix (the chained-hash property of a real trace). Every prompt also has a partial last block, as in Mooncake.
Conversations and one-shot queries arrive as a Poisson process; each conversation's tier comes from its first own
block, as :func:`~worker.kv_cache.cachesim.tier_of` maps Mooncake conversations.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Literal

from worker.kv_cache.cachesim import DEFAULT_TIER_MIX, TraceRequest, tier_of

GapDistribution = Literal["exponential", "lognormal", "pareto"]


@dataclass(frozen=True)
class TraceShape:
    """The knobs of a synthetic trace.

    Attributes:
        num_sessions: conversations plus one-shot queries.
        arrival_rate_per_s: sessions starting per second (Poisson arrivals).
        one_shot_fraction: share of sessions that are one-shot queries (never return), 0–1.
        one_shot_blocks: ``(min, max)`` own blocks of a one-shot query, uniform.
        return_probability: chance that a conversation has a next turn after each turn, 0–1.
        max_turns: turns of a conversation at most.
        gap: distribution of the gap between a turn and the next: ``exponential``; ``lognormal`` (σ = 1.5, heavy
            body); ``pareto`` (shape 1.5, heavy tail, infinite variance).
        mean_gap_s: mean gap between turns, seconds.
        first_turn_blocks: ``(min, max)`` own blocks of a conversation's first prompt, uniform.
        turn_growth_blocks: ``(min, max)`` blocks a later turn adds (previous answer + new message), uniform.
        num_system_prompts: distinct shared system prompts; 0 = none.
        system_prompt_blocks: blocks of each system prompt.
        system_prompt_zipf: Zipf exponent of system prompt popularity (0 = uniform).
        seed: random seed; the same shape and seed give the same trace.
    """

    num_sessions: int = 600
    arrival_rate_per_s: float = 0.5
    one_shot_fraction: float = 0.0
    one_shot_blocks: tuple[int, int] = (4, 16)
    return_probability: float = 0.5
    max_turns: int = 12
    gap: GapDistribution = "exponential"
    mean_gap_s: float = 60.0
    first_turn_blocks: tuple[int, int] = (2, 8)
    turn_growth_blocks: tuple[int, int] = (1, 3)
    num_system_prompts: int = 0
    system_prompt_blocks: int = 4
    system_prompt_zipf: float = 1.0
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError naming the first field out of range."""
        if self.num_sessions < 1 or self.arrival_rate_per_s <= 0 or self.mean_gap_s <= 0 or self.max_turns < 1:
            raise ValueError("num_sessions ≥ 1, arrival_rate_per_s > 0, mean_gap_s > 0 and max_turns ≥ 1")
        if not (0.0 <= self.one_shot_fraction <= 1.0 and 0.0 <= self.return_probability <= 1.0):
            raise ValueError("one_shot_fraction and return_probability must be in [0, 1]")
        for name in ("one_shot_blocks", "first_turn_blocks", "turn_growth_blocks"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be (min, max) with 1 ≤ min ≤ max, got {(low, high)}")
        if self.num_system_prompts < 0 or self.system_prompt_blocks < 1 or self.system_prompt_zipf < 0:
            raise ValueError("num_system_prompts ≥ 0, system_prompt_blocks ≥ 1, system_prompt_zipf ≥ 0")
        if self.gap not in ("exponential", "lognormal", "pareto"):
            raise ValueError(f"gap must be exponential, lognormal or pareto, got {self.gap!r}")


SHAPES: dict[str, TraceShape] = {
    "scan": TraceShape(one_shot_fraction=0.9, return_probability=0.2, num_system_prompts=2,
                       system_prompt_blocks=2),
    "short_gaps": TraceShape(return_probability=0.8, mean_gap_s=20.0),
    "long_gaps": TraceShape(return_probability=0.6, gap="pareto", mean_gap_s=400.0),
    "system_prompts": TraceShape(one_shot_fraction=0.7, return_probability=0.3, num_system_prompts=20,
                                 system_prompt_blocks=6, system_prompt_zipf=1.2),
    "mix": TraceShape(one_shot_fraction=0.3, return_probability=0.6, gap="lognormal", mean_gap_s=120.0,
                      num_system_prompts=8, system_prompt_blocks=4),
}


def _gap_s(rng: random.Random, gap: GapDistribution, mean_s: float) -> float:
    if gap == "exponential":
        return rng.expovariate(1.0 / mean_s)
    if gap == "lognormal":
        sigma = 1.5
        return rng.lognormvariate(math.log(mean_s) - sigma * sigma / 2, sigma)  # mean = exp(mu + sigma²/2)
    alpha = 1.5
    return mean_s * (alpha - 1) / alpha * rng.paretovariate(alpha)  # mean = x_m · α / (α − 1)


def generate(shape: TraceShape, tier_mix: tuple[tuple[str, int, int], ...] = DEFAULT_TIER_MIX) -> list[TraceRequest]:
    """Build the requests of a synthetic trace, sorted by arrival.

    Raises:
        ValueError: a field of ``shape`` out of range.
    """
    shape.check()
    rng = random.Random(shape.seed)
    next_hash = iter(range(1, 2**62))
    system_prompts = [tuple(next(next_hash) for _ in range(shape.system_prompt_blocks))
                      for _ in range(shape.num_system_prompts)]
    popularity = [1.0 / (rank + 1) ** shape.system_prompt_zipf for rank in range(shape.num_system_prompts)]
    requests: list[TraceRequest] = []
    start_s = 0.0
    for _ in range(shape.num_sessions):
        start_s += rng.expovariate(shape.arrival_rate_per_s)
        prefix = rng.choices(system_prompts, popularity)[0] if system_prompts else ()
        one_shot = rng.random() < shape.one_shot_fraction
        low, high = shape.one_shot_blocks if one_shot else shape.first_turn_blocks
        own = tuple(next(next_hash) for _ in range(rng.randint(low, high)))
        tier, priority = tier_of(own[0], tier_mix)
        hashes, arrival_s = prefix + own, start_s
        for turn in range(1 if one_shot else shape.max_turns):
            if turn > 0:
                if rng.random() >= shape.return_probability:
                    break
                arrival_s += _gap_s(rng, shape.gap, shape.mean_gap_s)
                hashes += tuple(next(next_hash) for _ in range(rng.randint(*shape.turn_growth_blocks)))
            requests.append(TraceRequest(arrival_s=arrival_s, block_hashes=hashes, last_block_partial=True,
                                         tier=tier, tier_priority=priority))
    requests.sort(key=lambda request: request.arrival_s)
    return requests


def parse_shape(text: str) -> TraceShape:
    """Parse ``NAME[:key=value,…]`` (a preset of :data:`SHAPES` with fields overridden) into a checked shape.

    Raises:
        ValueError: unknown preset or field, a value of the wrong type, a field out of range.
    """
    name, _, overrides = text.partition(":")
    if name not in SHAPES:
        raise ValueError(f"unknown synthetic shape {name!r}; valid: {', '.join(sorted(SHAPES))}")
    shape = SHAPES[name]
    types = {f.name: f.type for f in fields(TraceShape)}
    changes: dict[str, object] = {}
    for item in filter(None, (item.strip() for item in overrides.split(","))):
        key, _, value = item.partition("=")
        if key not in types:
            raise ValueError(f"unknown shape field {key!r}; valid: {', '.join(types)}")
        current = getattr(shape, key)
        try:
            if isinstance(current, tuple):
                low, high = value.split("-")
                changes[key] = (int(low), int(high))
            elif isinstance(current, str):
                changes[key] = value
            else:
                changes[key] = type(current)(value)
        except ValueError:
            raise ValueError(f"shape field {key}: bad value {value!r} (ranges are written min-max)") from None
    shape = replace(shape, **changes)
    shape.check()
    return shape


def write_jsonl(requests: list[TraceRequest], path: str | Path, block_size_tokens: int = 512) -> None:
    """Write requests as a Mooncake-format JSONL trace (``timestamp`` ms, ``input_length``, ``hash_ids``).

    Each prompt's partial last block gets its own fresh hash, as in Mooncake; :func:`~worker.kv_cache.cachesim.
    load_trace` reads the file back into the same block references.
    """
    partial_hash = max((h for request in requests for h in request.block_hashes), default=0)
    with open(path, "w", encoding="utf-8") as f:
        for request in requests:
            partial_hash += 1
            row = {"timestamp": round(request.arrival_s * 1000),
                   "input_length": len(request.block_hashes) * block_size_tokens + block_size_tokens // 2,
                   "hash_ids": [*request.block_hashes, partial_hash]}
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Write a synthetic trace as Mooncake JSONL (``python -m worker.kv_cache.synthetic_trace mix out.jsonl``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shape", help=f"NAME[:key=value,…], NAME one of {', '.join(sorted(SHAPES))}")
    parser.add_argument("out", help="JSONL file to write")
    args = parser.parse_args(argv)
    try:
        shape = parse_shape(args.shape)
    except ValueError as exc:
        parser.error(f"argument shape: {exc}")
    requests = generate(shape)
    write_jsonl(requests, args.out)
    print(f"{len(requests)} requests written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
