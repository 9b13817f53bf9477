#!/usr/bin/env bash
# Download into .whl/ the wheels scripts/gpu_check.sh needs on the lent GPU machine and that its python3 lacks.
#
# The lent machine (the device tool's KINDS.md: Python 3.12, torch 2.11 + CUDA 13, cupy-cuda13x, numpy, aiohttp,
# transformers, safetensors, prometheus-client, uvloop, pytest, pytest-timeout, pyyaml, requests, tqdm, ...) reaches
# no package index, and a call carries at most 64 MiB. It lacks these, which Sluice imports: msgspec (protocol,
# config), structlog (logs), redis (KV tier, jobs, registry), aiohttp-cors (gateway), gguf (GGUF reader). Their own
# requirements are all on the machine. The versions are the ones the project's tests run with.
#
# Each is fetched for CPython 3.12 manylinux x86-64 (the lent machine) and, where it is not pure Python, also for
# this machine's python3 (the interpreter of `scripts/gpu_check.sh --dry-run`); gpu_check.sh installs by name with
# --find-links, so pip picks the wheel whose tags fit. Fails when the folder passes MAX_MIB.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL_DIR=.whl
MAX_MIB=40
PURE=(structlog==26.1.0 redis==8.1.0 aiohttp-cors==0.8.1 gguf==0.19.0)
BINARY=(msgspec==0.23.0)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
mkdir -p "$WHEEL_DIR"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d "$WHEEL_DIR" "${PURE[@]}" "${BINARY[@]}"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$WHEEL_DIR" "${BINARY[@]}"
total_bytes=$(du -cb "$WHEEL_DIR"/*.whl | tail -1 | cut -f1)
echo "fetch_gpu_wheels: $(ls "$WHEEL_DIR"/*.whl | wc -l) wheels, $((total_bytes / 1024)) KiB in $WHEEL_DIR" >&2
if [ "$total_bytes" -gt $((MAX_MIB * 1024 * 1024)) ]; then
  echo "fetch_gpu_wheels: $WHEEL_DIR holds more than $MAX_MIB MiB: too much to carry" >&2
  exit 1
fi
