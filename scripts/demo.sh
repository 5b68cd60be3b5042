#!/usr/bin/env bash
# The demo: a real redis-server, the dispatcher simulator with its fake inference gateway, and
# `processor run` on examples/batch/demo.jsonl in async mode. Everything runs on 127.0.0.1 and
# stops when the script ends.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

ensure_redis
cargo build --quiet --bin processor --bin async-dispatcher-sim
bin=target/debug

work=$(mktemp -d -t batch-demo-XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

redis_port=$(free_port)
start_redis "$redis_port" "$work"
pids+=("$REDIS_PID")
echo "redis://127.0.0.1:$redis_port" > "$work/redis-url"
export PROCESSOR_REDIS_URL_FILE="$work/redis-url"

gateway_port=$(free_port)
"$bin/async-dispatcher-sim" gateway --listen "127.0.0.1:$gateway_port" --latency 20ms \
  > "$work/gateway.log" 2>&1 &
pids+=($!)
wait_http "$gateway_port"

# The dispatcher gets its queues from the processor's own config: one source of truth.
"$bin/processor" queues --config examples/config/demo.yaml --json \
  --igw-base-url "http://127.0.0.1:$gateway_port" > "$work/queues.json"
"$bin/async-dispatcher-sim" --redis.url "redis://127.0.0.1:$redis_port" \
  --redis.ss.queues-config-file "$work/queues.json" \
  --redis.ss.poll-interval-ms 100 --redis.ss.batch-size 20 \
  > "$work/dispatcher.log" 2>&1 &
pids+=($!)

echo "== processor run (async mode, through the dispatcher simulator)"
status=0
"$bin/processor" run --config examples/config/demo.yaml --input examples/batch/demo.jsonl \
  --output-dir "$work/out" --completion-window 10m > "$work/batch.stdout" || status=$?

echo
echo "== $work/out/output.jsonl (first 3 of $(wc -l < "$work/out/output.jsonl") lines)"
head -n 3 "$work/out/output.jsonl"
echo
echo "== $work/out/error.jsonl ($(wc -l < "$work/out/error.jsonl") lines)"
head -n 3 "$work/out/error.jsonl"
echo
echo "== $work/out/batch.json"
cat "$work/out/batch.json"
echo "processor exit code: $status (files kept in $work)"
exit "$status"
