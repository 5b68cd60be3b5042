#!/usr/bin/env bash
# The demo: a real redis-server, the dispatcher simulator with its fake inference gateway, and
# `processor serve`; examples/batch/demo.jsonl goes through the service's OpenAI-style Batch API
# with curl (upload, create the batch, poll it), then the batch and its output file are shown.
# Everything runs on 127.0.0.1 and stops when the script ends.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

ensure_redis
ensure_tools curl jq
# A first build compiles every dependency: about 10 minutes on a fresh 2-core machine, seconds
# after. Say so, and let cargo show its progress (its bar on a terminal, a line per crate else).
echo "== building processor and async-dispatcher-sim (cargo build; the first time takes about" \
  "10 minutes on 2 cores, later runs seconds)" >&2
cargo build --bin processor --bin async-dispatcher-sim
bin=target/debug
config=examples/config/serve.yaml

work=$(mktemp -d -t batch-demo-XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

start_redis "$work"
redis_port=$REDIS_PORT
pids+=("$REDIS_PID")
echo "redis://127.0.0.1:$redis_port" > "$work/redis-url"
export PROCESSOR_REDIS_URL_FILE="$work/redis-url"
export PROCESSOR_WORK_DIR="$work/jobs"

# Port 0: the gateway binds a free port and prints it.
"$bin/async-dispatcher-sim" gateway --listen 127.0.0.1:0 --latency 20ms \
  > "$work/gateway.log" 2>&1 &
pids+=($!)
gateway_port=$(gateway_port "$work/gateway.log")
wait_http "$gateway_port"

# The dispatcher gets its queues from the processor's own config: one source of truth. Their
# prometheus-budget gates need --prometheus-url, as the real dispatcher's do; the simulated gate
# reads the gateway's own metrics page, so the gateway stands in for Prometheus here.
"$bin/processor" queues --config "$config" --json \
  --igw-base-url "http://127.0.0.1:$gateway_port" > "$work/queues.json"
"$bin/async-dispatcher-sim" --redis.url "redis://127.0.0.1:$redis_port" \
  --redis.ss.queues-config-file "$work/queues.json" \
  --redis.ss.poll-interval-ms 100 --redis.ss.batch-size 20 \
  --prometheus-url "http://127.0.0.1:$gateway_port" \
  > "$work/dispatcher.log" 2>&1 &
pids+=($!)

# The service prints one line, `listening on http://127.0.0.1:PORT`, once it accepts requests.
"$bin/processor" serve --config "$config" --listen 127.0.0.1:0 \
  > "$work/serve.stdout" 2> "$work/serve.log" &
pids+=($!)
serve_pid=$!
api=
for _ in $(seq 1 600); do
  api=$(sed -n 's/^listening on //p' "$work/serve.stdout")
  if [ -n "$api" ]; then break; fi
  if ! kill -0 "$serve_pid" 2>/dev/null; then break; fi
  sleep 0.1
done
if [ -z "$api" ]; then
  echo "processor serve did not start; its log ($work/serve.log):" >&2
  tail -n 20 "$work/serve.log" >&2
  exit 1
fi
api="$api/v1"
echo "== processor serve is listening on $api (log: $work/serve.log)"

# Fails on an HTTP error, showing the service's error body.
call() {
  local out status
  out=$(curl -sS -w '\n%{http_code}' "$@")
  status=${out##*$'\n'}
  out=${out%$'\n'*}
  if [ "${status:0:1}" != 2 ]; then echo "HTTP $status from curl $*: $out" >&2; return 1; fi
  printf '%s' "$out"
}

echo
echo "== POST $api/files (examples/batch/demo.jsonl)"
file=$(call -F purpose=batch -F file=@examples/batch/demo.jsonl "$api/files")
jq -c . <<<"$file"
file_id=$(jq -r .id <<<"$file")

echo
echo "== POST $api/batches"
batch=$(call -H 'Content-Type: application/json' \
  -d "{\"input_file_id\":\"$file_id\",\"endpoint\":\"/v1/chat/completions\",\"completion_window\":\"10m\",\"metadata\":{\"demo\":\"scripts/demo.sh\"}}" \
  "$api/batches")
batch_id=$(jq -r .id <<<"$batch")
echo "$batch_id: $(jq -r .status <<<"$batch")"

echo
echo "== GET $api/batches/$batch_id until it ends"
last=
for _ in $(seq 1 600); do
  batch=$(call "$api/batches/$batch_id")
  now=$(jq -r '"\(.status): \(.request_counts.completed + .request_counts.failed)/\(.request_counts.total) done"' <<<"$batch")
  if [ "$now" != "$last" ]; then echo "$now"; last=$now; fi
  case $(jq -r .status <<<"$batch") in completed|failed|expired|cancelled) break ;; esac
  sleep 0.5
done

echo
echo "== the batch"
jq . <<<"$batch"

status=$(jq -r .status <<<"$batch")
output_file_id=$(jq -r '.output_file_id // empty' <<<"$batch")
error_file_id=$(jq -r '.error_file_id // empty' <<<"$batch")
if [ -n "$output_file_id" ]; then
  call "$api/files/$output_file_id/content" > "$work/output.jsonl"
  echo
  echo "== GET $api/files/$output_file_id/content (first 3 of $(wc -l < "$work/output.jsonl") lines)"
  head -n 3 "$work/output.jsonl"
fi
if [ -n "$error_file_id" ]; then
  call "$api/files/$error_file_id/content" > "$work/error.jsonl"
  echo
  echo "== GET $api/files/$error_file_id/content (first 3 of $(wc -l < "$work/error.jsonl") lines)"
  head -n 3 "$work/error.jsonl"
fi
echo
echo "batch $status (files kept in $work)"
[ "$status" = completed ]
