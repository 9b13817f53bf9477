#!/usr/bin/env bash
# The GPU check, one command for one lent H100/H200 as it is (no package index), under 8 minutes:
#   0. kernel_compile python -m bench.kernel_compile: NVRTC builds the 8 kernel modules in parallel processes into
#                     CuPy's disk cache (the later stages load them), registers / spills / shared memory per kernel
#   1. kernel_tests   pytest: the CuPy kernel vs the torch reference (tests/gpu: random shapes, context 1,
#                     non-multiple lengths, shuffled block tables, 128k), the launcher, CUDA graphs, CUDA int4/int8
#   2. kernel_bench   python -m bench.kernel_bench: Llama-3-8B heads, bf16, batch {1,16,64,256} x context
#                     {512,4096,32768}: time, bytes / time, the torch reference, a d2d copy's bandwidth
#   3. engine_bench   python -m bench.engine_bench: synthetic Llama-3-8B decode tokens/s at 1, 64, 256 sequences,
#                     CUDA graphs on and off, against the weight + KV bytes roofline
#   4. gateway_e2e    python bench/gpu_e2e.py: sluice serve on the GPU with the synthetic 8B, token-id prompts
#                     through /v1/completions, 1 and 64 concurrent streams: tokens/s and TTFT
# Each stage has its own time limit and runs whatever happened before it. JSON and logs go to $OUT when it is set,
# else to bench/results/gpu/; gpu_check.json sums up. The exit status is the number of failed stages.
#
# Python: $SLUICE_PYTHON, else the machine's python3, as it is. Nothing is installed from an index: import names
# it lacks are installed (--no-deps) from the wheels in .whl/ (scripts/fetch_gpu_wheels.sh) into a folder on
# PYTHONPATH. The repository itself runs from its checkout (PYTHONPATH), uninstalled.
#
# --dry-run (on a machine without a GPU): builds a throwaway venv shaped like the lent machine (the packages of
# LENT_PACKAGES from this machine's index, torch the CPU build of the project's pin; cached under var/ by their
# list), installs the rest from .whl/ only, checks that every module a stage imports imports, and runs every stage
# with its GPU work replaced by a "skipped: no GPU" result (pytest --collect-only, the benches' --dry-run). Any
# failure (a missing package, a wrong path, a syntax error) fails the dry run. tests/scripts/test_gpu_check.py runs it;
# --prepare-dry-run only builds the venv and fetches .whl/ where missing (`make test` does, before the tests).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
PREPARE_ONLY=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  --prepare-dry-run) DRY_RUN=1; PREPARE_ONLY=1 ;;
  "") ;;
  *) echo "usage: scripts/gpu_check.sh [--dry-run | --prepare-dry-run]" >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1
SECONDS=0
log() { printf '[gpu_check %3ds] %s\n' "$SECONDS" "$*" >&2; }

# What the lent machine's python3 has of what Sluice needs (the device tool's KINDS.md, 2026-11): the dry run's
# venv gets exactly these; everything else must come from .whl/.
LENT_PACKAGES=(torch==2.13.0 numpy aiohttp transformers safetensors prometheus-client uvloop pytest pytest-timeout
               pyyaml tqdm requests)
# import name -> distribution, for every module the stages import
NEEDED_MODULES="torch:torch numpy:numpy aiohttp:aiohttp transformers:transformers safetensors:safetensors \
prometheus_client:prometheus-client uvloop:uvloop pytest:pytest msgspec:msgspec structlog:structlog redis:redis \
aiohttp_cors:aiohttp-cors gguf:gguf yaml:pyyaml tqdm:tqdm requests:requests"

if [ "$DRY_RUN" = 1 ]; then
  RESULTS_DIR="${OUT:-var/gpu-dry-run/results}"
  key=$(printf '%s\n' "${LENT_PACKAGES[@]}" "$(python3 --version 2>&1)" | sha256sum | cut -c1-12)
  VENV="var/gpu-dry-run/venv-$key"
  if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.complete" ]; then
    log "dry run: building $VENV (${LENT_PACKAGES[*]})"
    rm -rf "$VENV"
    python3 -m venv "$VENV" || exit 1
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${LENT_PACKAGES[@]}" || exit 1
    touch "$VENV/.complete"
  fi
  [ -d .whl ] || scripts/fetch_gpu_wheels.sh || exit 1
  if [ "$PREPARE_ONLY" = 1 ]; then log "dry run: $VENV and .whl/ are ready"; exit 0; fi
  PY="$VENV/bin/python"
  SITE_DIR="var/gpu-dry-run/site"
else
  RESULTS_DIR="${OUT:-bench/results/gpu}"
  PY="${SLUICE_PYTHON:-python3}"
  SITE_DIR=/tmp/sluice-gpu-site
fi
mkdir -p "$RESULTS_DIR"
case "$SITE_DIR" in /*) ;; *) SITE_DIR="$PWD/$SITE_DIR" ;; esac
export PYTHONPATH="$PWD:$SITE_DIR${PYTHONPATH:+:$PYTHONPATH}"
rm -rf "$SITE_DIR"

missing_dists() {  # the distributions of NEEDED_MODULES whose module does not import
  "$PY" - "$NEEDED_MODULES" <<'EOF'
import importlib.util
import sys

pairs = [item.split(":") for item in sys.argv[1].split()]
print(" ".join(dist for module, dist in pairs if importlib.util.find_spec(module) is None))
EOF
}

MISSING=$(missing_dists)
if [ -n "$MISSING" ]; then
  log "missing: $MISSING; installing them from .whl/"
  for dist in $MISSING; do
    # pip's status, not grep's (grep -v fails when pip printed nothing, as it does on success)
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --find-links .whl \
      --target "$SITE_DIR" "$dist" 2>&1 | { grep -v "^WARNING: Target directory" >&2 || true; }
    [ "${PIPESTATUS[0]}" = 0 ] || log "$dist is not among the wheels in .whl/ (scripts/fetch_gpu_wheels.sh)"
  done
  MISSING=$(missing_dists)
fi
CUDA_MODULE_MISSING=$("$PY" -c 'import importlib.util; print("" if importlib.util.find_spec("cupy") else "cupy")')
VERSIONS='import importlib.util, sys, torch
cupy = __import__("cupy").__version__ if importlib.util.find_spec("cupy") else None
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "cupy", cupy)'
log "python: $PY ($("$PY" -c "$VERSIONS" 2>&1))"

FAILED=0
STAGES=()
record() {  # record NAME EXIT SECONDS NOTE
  STAGES+=("{\"stage\": \"$1\", \"exit\": $2, \"seconds\": $3, \"note\": \"$4\"}")
  if [ "$2" -ne 0 ]; then FAILED=$((FAILED + 1)); fi
}
run_stage() {  # run_stage NAME LIMIT_S CMD...: tee the output to $RESULTS_DIR/NAME.log, record the exit status
  local name=$1 limit=$2 rc start=$SECONDS
  shift 2
  log "stage $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RESULTS_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  log "stage $name: exit $rc after $((SECONDS - start))s"
  record "$name" "$rc" $((SECONDS - start)) "$([ "$DRY_RUN" = 1 ] && echo 'skipped: no GPU (dry run)')"
}

if [ -n "$MISSING" ]; then
  log "still missing: $MISSING"
  record packages 1 0 "missing: $MISSING"
fi
if [ "$DRY_RUN" = 0 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader >&2 \
    || log "nvidia-smi failed"
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    log "torch sees no CUDA device: every stage will fail or skip"
  fi
  [ -z "$CUDA_MODULE_MISSING" ] || log "cupy does not import: the kernel stages will fail"
fi

GPU_TESTS=(tests/gpu tests/worker/test_cupy_paged.py tests/worker/test_partitioned_attention.py
           tests/worker/test_cuda_graphs.py tests/worker/test_quant_cuda.py)
if [ "$DRY_RUN" = 1 ]; then
  MODULES='gateway.app, worker.__main__, worker.cuda_graphs, worker.quant_cuda, worker.synthetic, sluice.cli'
  run_stage imports 60 "$PY" -c "import $MODULES"
  run_stage kernel_compile 60 "$PY" -m bench.kernel_compile --dry-run --out "$RESULTS_DIR/kernel_compile.json"
  run_stage kernel_tests 60 "$PY" -m pytest -q -p no:cacheprovider --collect-only "${GPU_TESTS[@]}"
  run_stage kernel_bench 30 "$PY" -m bench.kernel_bench --dry-run --out "$RESULTS_DIR/kernel_bench.json"
  run_stage engine_bench 30 "$PY" -m bench.engine_bench --dry-run --out "$RESULTS_DIR/engine_bench.json"
  run_stage gateway_e2e 60 "$PY" bench/gpu_e2e.py --dry-run --out "$RESULTS_DIR/gpu_e2e.json"
else
  run_stage kernel_compile 60 "$PY" -m bench.kernel_compile --out "$RESULTS_DIR/kernel_compile.json"
  run_stage kernel_tests 120 "$PY" -m pytest -q -ra -p no:cacheprovider "${GPU_TESTS[@]}"
  run_stage kernel_bench 100 "$PY" -m bench.kernel_bench --out "$RESULTS_DIR/kernel_bench.json"
  run_stage engine_bench 120 "$PY" -m bench.engine_bench --out "$RESULTS_DIR/engine_bench.json"
  run_stage gateway_e2e 110 "$PY" bench/gpu_e2e.py --out "$RESULTS_DIR/gpu_e2e.json" --streams 1,64 \
    --max-tokens 128
fi

summary=$(IFS=,; echo "${STAGES[*]}")
printf '{"python": "%s", "dry_run": %s, "failed_stages": %d, "wall_s": %d, "stages": [%s]}\n' "$PY" \
  "$([ "$DRY_RUN" = 1 ] && echo true || echo false)" "$FAILED" "$SECONDS" "$summary" \
  | tee "$RESULTS_DIR/gpu_check.json"
exit "$FAILED"
