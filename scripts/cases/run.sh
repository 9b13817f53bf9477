#!/usr/bin/env bash
# Replay the behaviour cases (../shared/cases/gateway_cases.jsonl) against a Sluice gateway started here with
# scripts/cases/config.toml, and write the report to bench/results/cases_report.json (`make cases`).
#
#   bash scripts/cases/run.sh                       # every case (about half an hour on 2 CPU cores)
#   bash scripts/cases/run.sh --only BC06,BC26      # extra arguments go to case_runner.py
#   CASES_OUT=var/cases/report.json bash scripts/cases/run.sh --only BC29
#
# The gateway (and its worker) is stopped on every exit path; its log is var/cases/serve.log. The exit status is
# case_runner.py's: 1 when a case FAILs.
set -euo pipefail

cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
CONFIG=scripts/cases/config.toml
VALUES=scripts/cases/values.json
SHARED=${SHARED:-../shared}
OUT=${CASES_OUT:-bench/results/cases_report.json}
PORT=$("$PY" -c "import tomllib; print(tomllib.load(open('$CONFIG', 'rb'))['gateway']['port'])")
BASE_URL="http://127.0.0.1:$PORT"
READY_TIMEOUT_S=${READY_TIMEOUT_S:-300}

if curl -s -o /dev/null "$BASE_URL/healthz"; then
    echo "cases: something already listens on port $PORT; stop it first" >&2
    exit 2
fi

mkdir -p var/cases "$(dirname "$OUT")"
rm -f var/cases/jobs.sqlite3*  # a fresh job store (config: jobs.sqlite_path)
# SLUICE_* overrides of the caller's environment would silently change the numbers values.json relies on.
unset_sluice=()
for name in $(compgen -e); do
    if [[ $name == SLUICE_* ]]; then
        unset_sluice+=(-u "$name")
    fi
done
env "${unset_sluice[@]}" setsid "$PY" -m sluice.cli serve --config "$CONFIG" >var/cases/serve.log 2>&1 &
GATEWAY_PID=$!

stop_gateway() {
    if kill -0 "$GATEWAY_PID" 2>/dev/null; then
        kill -TERM "$GATEWAY_PID" 2>/dev/null || true
        for _ in $(seq 1 150); do
            kill -0 "$GATEWAY_PID" 2>/dev/null || break
            sleep 0.2
        done
        # still there after 30 s (or a worker outlived it): kill its whole session, which holds only the gateway
        # and the workers it spawned
        kill -KILL -- "-$GATEWAY_PID" 2>/dev/null || true
    fi
    wait "$GATEWAY_PID" 2>/dev/null || true
}
trap stop_gateway EXIT
trap 'exit 130' INT TERM

for _ in $(seq 1 "$READY_TIMEOUT_S"); do
    if ! kill -0 "$GATEWAY_PID" 2>/dev/null; then
        echo "cases: the gateway exited; log:" >&2
        tail -n 30 var/cases/serve.log >&2
        exit 2
    fi
    curl -sf -o /dev/null "$BASE_URL/readyz" && break
    sleep 1
done
if ! curl -sf -o /dev/null "$BASE_URL/readyz"; then
    echo "cases: the gateway was not ready after $READY_TIMEOUT_S s; log: var/cases/serve.log" >&2
    exit 2
fi

"$PY" "$SHARED/tools/case_runner.py" --values "$VALUES" --cases "$SHARED/cases/gateway_cases.jsonl" \
    --out "$OUT" "$@"
