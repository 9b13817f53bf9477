"""The gateway's instructions per streamed chat request, counted by callgrind: an A/B measure that the machine's noise
does not move.

CPU seconds per request on this shared 2-core VM move by tens of percent between minutes (and by 2-3x between
days: :mod:`bench.gateway_ab`'s docstring), so a change of a few percent on the hot path cannot be told from noise by
timing. ``valgrind --tool=callgrind`` counts the instructions the gateway process executes in user space instead: two
runs of one checkout agree within about 2-3% (what differs is how many requests' events land in one loop turn), and
two checkouts are compared by running this once from each (``--checkout``). System calls run in the kernel and are not
counted, so this says nothing of the write calls that are a third of the gateway's CPU time
(:mod:`bench.gateway_bench` measures time).

Setup as :mod:`bench.gateway_bench` (two local sim workers, admission on, a streamed chat request with 8 output
tokens, 32 concurrent in a closed loop from two client processes); only the gateway process runs under valgrind
(``--instr-atstart=no``: instrumented from the measured phase on, so it starts in seconds; its workers are separate
processes, not traced). Phases: ``--warmup-requests`` uncounted; ``--requests`` counted; then ``--idle-s`` seconds of no
load, counted too, so the background work (capacity reports, timers: about 3M instructions/s) can be subtracted from
the load phase, which under valgrind lasts about 50x longer than natively.

Reported: ``instructions_per_request`` (all of the load phase ÷ requests) and ``net_instructions_per_request`` (less
the idle rate × the load phase's wall time). Needs ``valgrind`` and ``callgrind_control`` (Debian's valgrind).

    .venv/bin/python -m bench.gateway_instructions [--checkout /tmp/base] [--requests 300] [--out X.json]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import mt_bench_prompts, write_result
from bench.gateway_ab import commit_of
from bench.gateway_bench import CONFIG, MODEL, run_client
from tests.support.server import REPO_ROOT, SluiceProcess


class CallgrindGateway(SluiceProcess):
    """``sluice serve`` under ``valgrind --tool=callgrind``, instrumentation off until :meth:`start_counting`.

    Args:
        dump_dir: where callgrind writes its dumps (``callgrind.<pid>.<n>``).
        (the rest as :class:`~tests.support.server.SluiceProcess`)
    """

    def __init__(self, config_text: str, dump_dir: Path, **kwargs) -> None:
        super().__init__(config_text, **kwargs)
        self.dump_dir = dump_dir

    def argv(self) -> list[str]:
        return ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                f"--callgrind-out-file={self.dump_dir}/callgrind.%p", *super().argv()]

    def _control(self, *options: str) -> None:
        subprocess.run(["callgrind_control", *options, str(self.process.pid)], check=True, capture_output=True)

    def start_counting(self) -> None:
        """Instrument from now on (counters start at 0)."""
        self._control("--instr=on")

    def zero(self) -> None:
        self._control("--zero")

    def dump(self) -> int:
        """Write the counts since the last dump or zeroing and return their instruction total."""
        before = set(self.dump_dir.glob("callgrind.*.*"))
        self._control("--dump")
        for _ in range(100):
            new = set(self.dump_dir.glob("callgrind.*.*")) - before
            if new:
                return instructions_in(new.pop())
            time.sleep(0.1)
        raise RuntimeError(f"callgrind wrote no dump in {self.dump_dir}")


def instructions_in(dump: Path) -> int:
    """Return the total of a callgrind dump (its ``summary:`` or ``totals:`` line), instructions."""
    for _ in range(50):  # callgrind_control returns before the file is complete
        for line in dump.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
        time.sleep(0.1)
    raise RuntimeError(f"no totals in {dump}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkout", default=str(REPO_ROOT), help="whose gateway code runs (e.g. a git worktree)")
    parser.add_argument("--requests", type=int, default=300, help="counted requests")
    parser.add_argument("--warmup-requests", type=int, default=100)
    parser.add_argument("--idle-s", type=float, default=10.0, help="seconds of no load counted for the background")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", default="gateway_instructions",
                        help="result name under bench/results/, or a path ending in .json")
    args = parser.parse_args()

    checkout = Path(args.checkout).resolve()
    prompts = mt_bench_prompts(80)
    with tempfile.TemporaryDirectory(prefix="sluice-callgrind-") as dump_dir:
        gateway = CallgrindGateway(CONFIG.format(model=MODEL, workers=2, time_scale=0.2), Path(dump_dir),
                                   min_ready_workers=2, code_root=checkout)
        with gateway:
            run_client(gateway.base_url, prompts, 2, args.concurrency, args.warmup_requests, None, 600.0)
            gateway.start_counting()
            started_s = time.perf_counter()
            load = run_client(gateway.base_url, prompts, 2, args.concurrency, args.requests, None, 1800.0)
            load_wall_s = time.perf_counter() - started_s
            load_instructions = gateway.dump()
            gateway.zero()
            idle_started_s = time.perf_counter()
            time.sleep(args.idle_s)
            idle_instructions = gateway.dump()
            idle_wall_s = time.perf_counter() - idle_started_s
    num_ok = len(load["results"])
    if num_ok == 0:
        sys.exit(f"no request succeeded: {load['errors'][:3]}")
    idle_per_s = idle_instructions / idle_wall_s
    write_result(args.out, {
        "bench": "gateway_instructions",
        "checkout": str(checkout),
        "commit": commit_of(checkout),
        "requests_ok": num_ok, "requests_failed": len(load["errors"]),
        "load_wall_s": round(load_wall_s, 2),
        "instructions_per_request": round(load_instructions / num_ok),
        "idle_instructions_per_s": round(idle_per_s),
        "net_instructions_per_request": round((load_instructions - idle_per_s * load_wall_s) / num_ok),
        "config": {"workers": 2, "concurrency": args.concurrency, "requests": args.requests,
                   "warmup_requests": args.warmup_requests, "idle_s": args.idle_s},
    })


if __name__ == "__main__":
    main()
