#!/usr/bin/env bash
# Tests the images scripts/image.sh built, from inside their own roots: a throwaway container of
# each is mounted (buildah mount) and its binaries run there under chroot as the image's user
# (65532), so only what the image holds is found: a missing library, CA bundle or user fails.
#
#   bash scripts/image-test.sh batch-processor:VERSION async-dispatcher-sim:VERSION
#
# Checks: `processor --version`; `processor check-config` on every examples/config/*.yaml; the
# demo's job (examples/batch/demo.jsonl, `processor run` with examples/config/demo.yaml) through
# the dispatcher simulator and its fake gateway of the second image, to the last line, with
# Redis named `localhost` (resolved through the /etc/hosts Kubernetes mounts); the CA bundle
# trusted by `processor` over a rediss:// URL without `redis_tls` (the system roots).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
if [ "$(id -u)" != 0 ]; then exec buildah unshare bash "$0" "$@"; fi
export STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot
processor_image=${1:?usage: image-test.sh PROCESSOR_IMAGE SIM_IMAGE}
sim_image=${2:?usage: image-test.sh PROCESSOR_IMAGE SIM_IMAGE}
ensure_redis

containers=()
pids=()
work=$(mktemp -d -t batch-image-XXXXXX)
mounts=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount "${mounts[i]}" 2>/dev/null || true; done
  for c in "${containers[@]}"; do buildah rm "$c" >/dev/null 2>&1 || true; done
}
trap cleanup EXIT
export CHECK_LOG=$work/check.log

proc_ctr=$(buildah from --pull=never "$processor_image"); containers+=("$proc_ctr")
sim_ctr=$(buildah from --pull=never "$sim_image"); containers+=("$sim_ctr")
proc_root=$(buildah mount "$proc_ctr")
sim_root=$(buildah mount "$sim_ctr")
# What the image itself must hold (nothing else is copied in but the inputs below).
for f in /usr/local/bin/processor /etc/ssl/certs/ca-certificates.crt /etc/passwd /etc/group; do
  [ -s "$proc_root$f" ] || { echo "the image lacks $f" >&2; exit 1; }
done
# What any container runtime gives a container and an image cannot hold: the basic devices
# (the random generator reads /dev/urandom) and /proc, bound from the host.
for root in "$proc_root" "$sim_root"; do
  mkdir -p "$root/dev" "$root/proc"
  for dev in null zero random urandom; do
    touch "$root/dev/$dev"
    mount --bind "/dev/$dev" "$root/dev/$dev"
    mounts+=("$root/dev/$dev")
  done
  mount --bind /proc "$root/proc"
  mounts+=("$root/proc")
done
# As the kubelet does: /etc/hosts and a writable, mounted work volume; the inputs at /input.
printf '127.0.0.1 localhost\n' > "$proc_root/etc/hosts"
printf '127.0.0.1 localhost\n' > "$sim_root/etc/hosts"
mkdir -p "$proc_root/input" "$proc_root/out"
cp -r examples "$proc_root/input/"
chown -R 65532:65532 "$proc_root/out"
# Runs a command of an image as its user, inside its root, with only the image's environment
# (and the test's PROCESSOR_REDIS_URL_FILE), as a container runtime would.
image_env() { buildah inspect --type image --format '{{range .OCIv1.Config.Env}}{{println .}}{{end}}' "$1"; }
mapfile -t proc_env < <(image_env "$processor_image")
mapfile -t sim_env < <(image_env "$sim_image")
in_proc() {
  env -i "${proc_env[@]}" ${PROCESSOR_REDIS_URL_FILE:+PROCESSOR_REDIS_URL_FILE=$PROCESSOR_REDIS_URL_FILE} \
    chroot --userspec=65532:65532 "$proc_root" "$@"
}
in_sim() { env -i "${sim_env[@]}" chroot --userspec=65532:65532 "$sim_root" "$@"; }

check "processor --version" in_proc /usr/local/bin/processor --version
for config in examples/config/*.yaml; do
  check "processor check-config --config $config" \
    in_proc /usr/local/bin/processor check-config --config "/input/$config"
done

# The demo's job: Redis on the host's loopback (a chroot shares the network), the gateway and
# the dispatcher from the simulator image, `processor run` from the processor image.
start_redis "$work"
pids+=("$REDIS_PID")
in_sim /usr/local/bin/async-dispatcher-sim gateway --listen 127.0.0.1:0 --latency 20ms \
  > "$work/gateway.log" 2>&1 &
pids+=($!)
gateway_port=$(gateway_port "$work/gateway.log")
echo "redis://localhost:$REDIS_PORT" > "$proc_root/out/redis-url"
export PROCESSOR_REDIS_URL_FILE=/out/redis-url
in_proc /usr/local/bin/processor queues --config /input/examples/config/demo.yaml --json \
  --igw-base-url "http://127.0.0.1:$gateway_port" > "$sim_root/queues.json"
in_sim /usr/local/bin/async-dispatcher-sim --redis.url "redis://localhost:$REDIS_PORT" \
  --redis.ss.queues-config-file /queues.json --redis.ss.poll-interval-ms 100 \
  --redis.ss.batch-size 20 > "$work/dispatcher.log" 2>&1 &
pids+=($!)
demo_job() {
  in_proc /usr/local/bin/processor run --config /input/examples/config/demo.yaml \
    --input /input/examples/batch/demo.jsonl --output-dir /out/demo --no-progress \
    --completion-window 5m
  local want got
  want=$(wc -l < examples/batch/demo.jsonl)
  got=$(cat "$proc_root/out/demo/output.jsonl" "$proc_root/out/demo/error.jsonl" 2>/dev/null | wc -l)
  echo "lines answered: $got of $want"
  [ "$got" = "$want" ] && [ -s "$proc_root/out/demo/output.jsonl" ]
}
check "the demo's job through the simulator (processor run, examples/config/demo.yaml)" demo_job

# The CA bundle: a Redis over TLS whose certificate a test CA signed, the CA added to the
# image's bundle (as a private CA is added to a derived image), no redis_tls section: the
# processor finds the bundle where it looks, or fails to trust the server.
tls_check() {
  local dir=$work/tls port
  mkdir -p "$dir"
  openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=image-test-ca \
    -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -addext subjectAltName=DNS:localhost \
    -keyout "$dir/server.key" -out "$dir/server.csr" 2>/dev/null
  printf 'subjectAltName=DNS:localhost\n' > "$dir/ext"
  openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
    -CAcreateserial -days 1 -extfile "$dir/ext" -out "$dir/server.crt" 2>/dev/null
  port=$(free_port)
  redis-server --bind 127.0.0.1 --port 0 --tls-port "$port" --tls-cert-file "$dir/server.crt" \
    --tls-key-file "$dir/server.key" --tls-ca-cert-file "$dir/ca.crt" --tls-auth-clients no \
    --dir "$dir" --save "" --appendonly no --logfile "$dir/redis.log" &
  pids+=($!)
  for _ in $(seq 1 50); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
  cat "$dir/ca.crt" >> "$proc_root/etc/ssl/certs/ca-certificates.crt"
  echo "rediss://localhost:$port" > "$proc_root/out/redis-url-tls"
  # No dispatcher reads this Redis, so the job is queued over TLS and expires after its window:
  # exit 4. A server the processor does not trust is exit 1 (Redis unreachable).
  local rc=0
  PROCESSOR_REDIS_URL_FILE=/out/redis-url-tls in_proc /usr/local/bin/processor run \
    --config /input/examples/config/demo.yaml --input /input/examples/batch/demo.jsonl \
    --output-dir /out/tls --no-progress --completion-window 2s || rc=$?
  echo "processor run over rediss:// exited $rc (4: expired after being queued)"
  [ "$rc" = 4 ]
}
check "rediss:// trusted through the image's CA bundle" tls_check

check_summary "image tests"
