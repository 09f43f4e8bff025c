#!/usr/bin/env bash
# One replica against two behind the router: for each REPLICAS value, start `REPLICAS=N ./serve.sh` on
# loopback, run evidence/bench/bench_server.py against the router, stop it, next. Reads the model package
# (MODEL_DIR, default model/); writes one bench JSON per run into OUT_DIR and the serve.sh logs beside them.
#
#   scripts/bench_replicas.sh                       # REPLICAS 1 and 2, 16 and 64 clients, CACHE_SLOTS=48
#   CACHE_SLOTS=96 REPLICA_COUNTS="1" scripts/bench_replicas.sh --no-session-id
#
# Environment: REPLICA_COUNTS (default "1 2"), CONCURRENCY (default "16 64"), REQUESTS (timed requests per
# level, default 256), CACHE_SLOTS (per replica, default 48), PORT (the router's, default 18400), OUT_DIR
# (default bench-replicas/ in the current directory), MODEL_DIR, plus any serve.sh setting. Extra
# arguments go to bench_server.py. Runs under `nice -n 10`: the figures are for a shared machine, so
# compare rows of one run, not runs of different days.
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 0
fi
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
port="${PORT:-18400}"
out="${OUT_DIR:-bench-replicas}"
read -r -a counts <<< "${REPLICA_COUNTS:-1 2}"
read -r -a levels <<< "${CONCURRENCY:-16 64}"
for value in "${counts[@]}" "${levels[@]}" "${REQUESTS:-256}" "${CACHE_SLOTS:-48}" "$port"; do
    if [[ ! "$value" =~ ^[1-9][0-9]*$ ]]; then
        echo "bench_replicas: '$value' is not a whole number >= 1 (REPLICA_COUNTS, CONCURRENCY, REQUESTS, CACHE_SLOTS, PORT)" >&2
        exit 2
    fi
done
mkdir -p "$out"
serve_pid=""
stop_serve() {
    if [[ -n "$serve_pid" ]] && kill -0 "$serve_pid" 2>/dev/null; then
        kill -TERM "$serve_pid"
        wait "$serve_pid" || true
    fi
    serve_pid=""
}
trap stop_serve EXIT
trap 'exit 130' INT TERM

for replicas in "${counts[@]}"; do
    log="$out/serve-replicas$replicas.log"
    REPLICAS="$replicas" PORT="$port" CACHE_SLOTS="${CACHE_SLOTS:-48}" nice -n 10 "$repo/serve.sh" > "$log" 2>&1 &
    serve_pid=$!
    until grep -q "replicas: serving on" "$log"; do
        if ! kill -0 "$serve_pid" 2>/dev/null; then
            echo "bench_replicas: REPLICAS=$replicas ./serve.sh did not start; see $log" >&2
            exit 1
        fi
        sleep 1
    done
    echo "== REPLICAS=$replicas, CACHE_SLOTS=${CACHE_SLOTS:-48} per replica"
    nice -n 10 "$repo/.venv/bin/python" "$repo/evidence/bench/bench_server.py" --url "http://127.0.0.1:$port" \
        --concurrency "${levels[@]}" --requests "${REQUESTS:-256}" --timeout 600 --json "$out/replicas$replicas.json" "$@"
    stop_serve
done
