"""``make bench``: run every benchmark that this machine can run, each in its own process; JSON out.

Each benchmark writes its own ``bench/results/<name>.json``; this writes ``bench/results/summary.json`` with the
exit status and wall time of each. GPU-only benchmarks are skipped without CUDA, and say so.
Run a subset: ``python -m bench.run_all serving cachesim``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from bench.common import REPO_ROOT, RESULTS_DIR

# name -> (module, needs_gpu)
BENCHMARKS: dict[str, tuple[str, bool]] = {
    "serving": ("bench.serving_bench", False),
    "cachesim": ("bench.cachesim_bench", False),
    "kv_reload": ("bench.kv_reload_bench", False),
    "replay": ("bench.replay_bench", False),
    "plan_check": ("bench.plan_check", False),
    "jobs": ("bench.jobs_bench", False),
    "autoscale": ("bench.autoscale_bench", False),
    "kernel": ("bench.kernel_bench", True),
}


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> int:
    names = list(argv if argv is not None else sys.argv[1:]) or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; valid: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    has_cuda = _cuda_available()
    summary: dict[str, dict] = {}
    for name in names:
        module, needs_gpu = BENCHMARKS[name]
        module_path = REPO_ROOT / (module.replace(".", "/") + ".py")
        if not module_path.exists():
            summary[name] = {"status": "missing", "module": module}
            continue
        if needs_gpu and not has_cuda:
            summary[name] = {"status": "skipped", "reason": "needs CUDA; run scripts/gpu_check.sh on a GPU"}
            continue
        print(f"== bench {name} ({module})", flush=True)
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", module], cwd=REPO_ROOT)
        summary[name] = {"status": "ok" if proc.returncode == 0 else "failed", "exit_code": proc.returncode,
                         "wall_s": round(time.monotonic() - start, 1)}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0 if all(v["status"] in ("ok", "skipped") for v in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
