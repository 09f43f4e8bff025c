#!/usr/bin/env bash
# Start the draft server: the one way operators run it. First run creates .venv and installs what serving
# needs (scripts/ensure_venv.sh); later runs reuse it. Works offline: the Hugging Face hub is never contacted.
#
#   ./serve.sh                                  # model/ on 127.0.0.1:8000
#   PORT=9000 MAX_BATCH_SIZE=32 ./serve.sh       # settings come from environment variables
#   ./serve.sh --log-level debug                # extra arguments go to server.py as they are
#
# Environment -> server.py flag (unset or empty: the server's default; see `python server.py --help`):
#   MODEL_DIR -> --model-dir (default ./model, relative to the repository)   HOST -> --host   PORT -> --port
#   MAX_BATCH_SIZE -> --max-batch-size   MAX_WAIT_MS -> --max-wait-ms   REGROUP_WAIT_MS -> --regroup-wait-ms
#   MAX_QUEUE -> --max-queue
#   MAX_DRAFT_TOKENS -> --max-draft-tokens   MIN_CONFIDENCE -> --min-confidence   LOOKUP_MIN_MATCH -> --lookup-min-match
#   CACHE_SLOTS -> --cache-slots   MAX_CONTEXT -> --max-context
#   DEVICE -> --device   DTYPE -> --dtype   WEIGHTS -> --weights   THREADS -> --threads
#   INT4_KERNEL -> --int4-kernel (auto, int4pack, int4-bf16dot, dense-bf16, dense-fp32)
#   ATTENTION_KERNEL -> --attention-kernel (auto, query-kernel, torch)
#   COMPILE -> --compile (auto, on, off; also 1 = on, 0 = off)   BATCH_BUCKETS -> --batch-buckets (e.g. 1,2,4,8,16)
#   API_KEY_FILE -> --api-key-file   MAX_BODY_BYTES -> --max-body-bytes   LOG_LEVEL -> --log-level
#   QUEUE_DEADLINE_S -> --queue-deadline-s   DRAIN_SECONDS -> --drain-seconds
#   ACCESS_LOG=1 -> --access-log   SKIP_INTEGRITY_CHECK=1 -> --skip-integrity-check (development only)
#
# Scaling out (docs/scaling.md); either variable installs the 'scale' extra (vllm-router) on first use:
#   REPLICAS=N          N servers on 127.0.0.1:REPLICA_BASE_PORT.. (default PORT+1..) and, on HOST:PORT, vllm-router
#                       hashing the X-Session-ID header (scripts/replicas.py); every setting above goes to each replica
#   WORKER_URLS="URL …" only the router, on HOST:PORT, over servers already running elsewhere (space or comma separated)
#   ROUTER_METRICS_PORT the router's Prometheus port (default: the port after the last replica's; router only: PORT+1)
#   ROUTER_ARGS         extra vllm-router flags (one shell-quoted string)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
scale_out=0
if [[ -n "${REPLICAS:-}" || -n "${WORKER_URLS:-}" ]]; then
    scale_out=1
    fail() { echo "serve.sh: $1" >&2; exit 2; }
    if [[ -n "${REPLICAS:-}" && -n "${WORKER_URLS:-}" ]]; then
        fail "set REPLICAS (servers here) or WORKER_URLS (servers elsewhere), not both"
    fi
    if [[ -n "${REPLICAS:-}" && ! "$REPLICAS" =~ ^[1-9][0-9]*$ ]]; then
        fail "REPLICAS=$REPLICAS: must be a whole number >= 1 (unset it for one server without a router)"
    fi
    if [[ -n "${API_KEY_FILE:-}" ]]; then
        fail "API_KEY_FILE with REPLICAS/WORKER_URLS: vllm-router neither checks client keys nor forwards the Authorization header; authenticate at a gateway in front (docs/scaling.md)"
    fi
    "$repo/scripts/ensure_venv.sh" scale
else
    "$repo/scripts/ensure_venv.sh"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if [[ $scale_out == 1 ]]; then
    router=(--host "${HOST:-127.0.0.1}" --port "${PORT:-8000}" --router-args "${ROUTER_ARGS:-}")
    if [[ -n "${ROUTER_METRICS_PORT:-}" ]]; then router+=(--metrics-port "$ROUTER_METRICS_PORT"); fi
    if [[ -n "${WORKER_URLS:-}" ]]; then
        read -r -a urls <<< "${WORKER_URLS//,/ }"
        exec "$repo/.venv/bin/python" "$repo/scripts/replicas.py" --worker-urls "${urls[@]}" "${router[@]}" "$@"
    fi
    if [[ -n "${REPLICA_BASE_PORT:-}" ]]; then router+=(--replica-base-port "$REPLICA_BASE_PORT"); fi
    unset HOST PORT  # the router's; each replica gets a loopback port from scripts/replicas.py
fi

args=(--model-dir "${MODEL_DIR:-$repo/model}")
add_flag() {  # add_flag FLAG VALUE: pass FLAG only when VALUE is set
    if [[ -n "$2" ]]; then args+=("$1" "$2"); fi
}
add_flag --host "${HOST:-}"
add_flag --port "${PORT:-}"
add_flag --max-batch-size "${MAX_BATCH_SIZE:-}"
add_flag --max-wait-ms "${MAX_WAIT_MS:-}"
add_flag --regroup-wait-ms "${REGROUP_WAIT_MS:-}"
add_flag --max-queue "${MAX_QUEUE:-}"
add_flag --max-draft-tokens "${MAX_DRAFT_TOKENS:-}"
add_flag --min-confidence "${MIN_CONFIDENCE:-}"
add_flag --lookup-min-match "${LOOKUP_MIN_MATCH:-}"
add_flag --cache-slots "${CACHE_SLOTS:-}"
add_flag --max-context "${MAX_CONTEXT:-}"
add_flag --device "${DEVICE:-}"
add_flag --dtype "${DTYPE:-}"
add_flag --weights "${WEIGHTS:-}"
add_flag --int4-kernel "${INT4_KERNEL:-}"
add_flag --attention-kernel "${ATTENTION_KERNEL:-}"
add_flag --threads "${THREADS:-}"
case "${COMPILE:-}" in 1) add_flag --compile on ;; 0) add_flag --compile off ;; *) add_flag --compile "${COMPILE:-}" ;; esac
add_flag --batch-buckets "${BATCH_BUCKETS:-}"
add_flag --api-key-file "${API_KEY_FILE:-}"
add_flag --max-body-bytes "${MAX_BODY_BYTES:-}"
add_flag --log-level "${LOG_LEVEL:-}"
add_flag --queue-deadline-s "${QUEUE_DEADLINE_S:-}"
add_flag --drain-seconds "${DRAIN_SECONDS:-}"
if [[ "${ACCESS_LOG:-0}" == 1 ]]; then args+=(--access-log); fi
if [[ "${SKIP_INTEGRITY_CHECK:-0}" == 1 ]]; then args+=(--skip-integrity-check); fi

if [[ $scale_out == 1 ]]; then
    exec "$repo/.venv/bin/python" "$repo/scripts/replicas.py" --replicas "$REPLICAS" "${router[@]}" -- "${args[@]}" "$@"
fi
exec "$repo/.venv/bin/python" "$repo/server.py" "${args[@]}" "$@"
