# Helpers shared by the scripts: installing what is missing, free ports, waiting for Redis.

# Runs a command as root (directly, or through sudo when there is one).
as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "need root to run: $*" >&2; return 1; fi
}

# Installs redis-server (and redis-cli, redis-benchmark) with apt-get when missing.
ensure_redis() {
  if command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null \
    && command -v redis-cli >/dev/null && command -v redis-sentinel >/dev/null; then return; fi
  echo "installing redis-server, redis-tools and redis-sentinel with apt-get..." >&2
  as_root apt-get update -qq >/dev/null || true
  # redis-sentinel: the Sentinel tests (crates/testkit); redis-cli: TLS commands and cluster creation.
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    redis-server redis-tools redis-sentinel >/dev/null
  # Debian starts a system Redis (and Sentinel) with the packages; we never use them.
}

# Prints a loopback TCP port nobody listens on.
free_port() {
  local port
  for _ in $(seq 1 100); do
    port=$(( 20000 + RANDOM % 40000 ))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then echo "$port"; return; fi
  done
  echo "no free port found" >&2; return 1
}

# Starts redis-server on 127.0.0.1:$1 with data in $2; waits until it answers PING.
start_redis() {
  redis-server --bind 127.0.0.1 --port "$1" --dir "$2" --save "" --appendonly no \
    --logfile "$2/redis.log" --daemonize no &
  REDIS_PID=$!
  for _ in $(seq 1 100); do
    if [ "$(redis-cli -p "$1" ping 2>/dev/null)" = PONG ]; then return; fi
    sleep 0.1
  done
  echo "redis-server did not start; see $2/redis.log" >&2; return 1
}

# Waits until an HTTP server answers on 127.0.0.1:$1.
wait_http() {
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return; fi
    sleep 0.1
  done
  echo "nothing listens on 127.0.0.1:$1" >&2; return 1
}

# The openai package the SDK compatibility suite (tests/compat) runs with: pinned, bumped on purpose.
OPENAI_SDK_VERSION=3.51.0

# Makes a virtualenv with the openai package at $BATCH_VENV (default target/venv) and exports
# BATCH_VENV for the tests (tests/serve_sdk.rs). Fast when it is already there.
ensure_venv() {
  export BATCH_VENV="${BATCH_VENV:-$PWD/target/venv}"
  local stamp="$BATCH_VENV/.openai-$OPENAI_SDK_VERSION"
  if [ -e "$stamp" ] && "$BATCH_VENV/bin/python" -c '' 2>/dev/null; then return; fi
  # Debian ships venv's pip bootstrap (ensurepip) in a package of its own.
  if ! command -v python3 >/dev/null || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    echo "installing python3 and python3-venv with apt-get..." >&2
    as_root apt-get update -qq >/dev/null || true
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv >/dev/null
  fi
  echo "making the test virtualenv $BATCH_VENV (openai==$OPENAI_SDK_VERSION)..." >&2
  rm -rf "$BATCH_VENV"
  python3 -m venv "$BATCH_VENV"
  "$BATCH_VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    "openai==$OPENAI_SDK_VERSION"
  touch "$stamp"
}

# Installs each of the given commands with apt-get when missing (each from the Debian package of
# its own name: curl, jq).
ensure_tools() {
  local missing=()
  for tool in "$@"; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  if [ "${#missing[@]}" = 0 ]; then return; fi
  echo "installing ${missing[*]} with apt-get..." >&2
  as_root apt-get update -qq >/dev/null || true
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}
