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
  # redis-sentinel: the Sentinel tests (tools/testkit); redis-cli: TLS commands and cluster creation.
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    redis-server redis-tools redis-sentinel >/dev/null
  # Debian starts a system Redis (and Sentinel) with the packages; we never use them.
}

# Installs prometheus with apt-get when missing: the test of sync mode's load read through
# Prometheus's query API starts one of its own (tools/testkit). Debian starts a system
# Prometheus with the package; the tests never use it.
ensure_prometheus() {
  if command -v prometheus >/dev/null; then return; fi
  echo "installing prometheus with apt-get..." >&2
  as_root apt-get update -qq >/dev/null || true
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
}

# Makes a new, empty virtualenv at $1 (python3 and python3-venv installed with apt-get when
# missing: Debian ships venv's pip bootstrap, ensurepip, in a package of its own).
make_venv() {
  if ! command -v python3 >/dev/null || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    echo "installing python3 and python3-venv with apt-get..." >&2
    as_root apt-get update -qq >/dev/null || true
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv >/dev/null
  fi
  rm -rf "$1"
  mkdir -p "$(dirname "$1")"
  python3 -m venv "$1"
}

# The S3-compatible server of the S3 tests (tools/testkit S3Server): moto's moto_server, pinned
# with the Flask it serves through. moto[s3], not moto[server], which brings every AWS service's
# dependencies.
MOTO_PACKAGES=("moto[s3]==5.2.5" "flask==3.1.3" "flask-cors==6.0.5")

# Installs moto_server into the virtualenv $BATCH_VENV (default target/venv, made when missing)
# and exports BATCH_VENV, where the tests look for it. Fast when it is already there.
ensure_moto() {
  export BATCH_VENV="${BATCH_VENV:-$PWD/target/venv}"
  local stamp="$BATCH_VENV/.moto-${MOTO_PACKAGES[0]#*==}"
  if [ -e "$stamp" ] && [ -x "$BATCH_VENV/bin/moto_server" ]; then return; fi
  if ! "$BATCH_VENV/bin/python" -c '' 2>/dev/null; then make_venv "$BATCH_VENV"; fi
  echo "installing ${MOTO_PACKAGES[*]} into $BATCH_VENV..." >&2
  "$BATCH_VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${MOTO_PACKAGES[@]}"
  touch "$stamp"
}

# The fuzz of the running service (tests/serve_fuzz.rs): schemathesis, pinned with the
# hypothesis it works with (newer ones dropped an internal it calls).
SCHEMATHESIS_PACKAGES=("schemathesis==3.39.16" "hypothesis==6.135.0")

# Installs schemathesis into the virtualenv $BATCH_VENV (made by ensure_venv). Fast when there.
ensure_schemathesis() {
  export BATCH_VENV="${BATCH_VENV:-$PWD/target/venv}"
  local stamp="$BATCH_VENV/.schemathesis-${SCHEMATHESIS_PACKAGES[0]#*==}"
  if [ -e "$stamp" ] && [ -x "$BATCH_VENV/bin/schemathesis" ]; then return; fi
  echo "installing ${SCHEMATHESIS_PACKAGES[*]} into $BATCH_VENV..." >&2
  "$BATCH_VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    "${SCHEMATHESIS_PACKAGES[@]}"
  touch "$stamp"
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

# Starts redis-server on a free 127.0.0.1 port with data in $1; waits until it answers PING.
# Sets REDIS_PORT and REDIS_PID. Another port is tried when the chosen one was taken meanwhile.
start_redis() {
  local attempt
  for attempt in 1 2 3 4 5; do
    REDIS_PORT=$(free_port)
    redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --dir "$1" --save "" --appendonly no \
      --logfile "$1/redis.log" --daemonize no &
    REDIS_PID=$!
    for _ in $(seq 1 100); do
      if [ "$(redis-cli -p "$REDIS_PORT" ping 2>/dev/null)" = PONG ]; then return; fi
      if ! kill -0 "$REDIS_PID" 2>/dev/null; then break; fi
      sleep 0.1
    done
    if kill -0 "$REDIS_PID" 2>/dev/null; then break; fi
  done
  echo "redis-server did not start; see $1/redis.log" >&2; return 1
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
  echo "making the test virtualenv $BATCH_VENV (openai==$OPENAI_SDK_VERSION)..." >&2
  make_venv "$BATCH_VENV"
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

# Installs buildah (the image builds of scripts/image.sh) with apt-get when missing.
ensure_buildah() {
  command -v buildah >/dev/null && return
  echo "installing buildah with apt-get..." >&2
  as_root apt-get update -qq >/dev/null || true
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah >/dev/null
}

# helm, at the version the chart tests (scripts/chart-test.sh) run: built from its Go module into
# $GOPATH/bin (outside the clone, so a build of several minutes happens once per machine).
HELM_VERSION=v4.3.2

# Puts helm $HELM_VERSION on PATH as `helm`, installing it with `go install` when missing.
ensure_helm() {
  local gobin
  # The Go toolchain of these machines lives in /usr/local/go (Debian's golang is too old for helm 4).
  command -v go >/dev/null || export PATH="/usr/local/go/bin:$PATH"
  command -v go >/dev/null || { echo "helm is built with go install: install Go (1.25 or later) first" >&2; return 1; }
  gobin="$(go env GOPATH)/bin"
  export PATH="$gobin:$PATH"
  # `helm version` of a go-installed helm says only v4.3: the module's version is in the binary.
  if [ -x "$gobin/helm" ] && go version -m "$gobin/helm" 2>/dev/null \
    | grep -qE "^[[:space:]]+mod[[:space:]]+helm.sh/helm/v4[[:space:]]+$HELM_VERSION[[:space:]]"; then
    return
  fi
  echo "installing helm $HELM_VERSION with go install (a few minutes, once)..." >&2
  go install "helm.sh/helm/v4/cmd/helm@$HELM_VERSION"
}

# The chart tests' Python tools, pinned: Kubernetes schemas (shipped in the package, offline)
# and the policy scanner.
CHART_PY_PACKAGES=("kubernetes-validate==1.37.0" "checkov==3.3.30")

# Installs them into the virtualenv $CHART_VENV (default ~/.cache/batch-processor/chart-venv,
# outside the clone: checkov and its dependencies take minutes) and exports CHART_VENV.
ensure_chart_tools() {
  export CHART_VENV="${CHART_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/batch-processor/chart-venv}"
  local stamp="$CHART_VENV/.packages-${CHART_PY_PACKAGES[0]#*==}-${CHART_PY_PACKAGES[1]#*==}"
  if [ -e "$stamp" ] && [ -x "$CHART_VENV/bin/checkov" ] && [ -x "$CHART_VENV/bin/kubernetes-validate" ]; then
    return
  fi
  if ! "$CHART_VENV/bin/python" -c '' 2>/dev/null; then make_venv "$CHART_VENV"; fi
  echo "installing ${CHART_PY_PACKAGES[*]} into $CHART_VENV (minutes, once)..." >&2
  "$CHART_VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${CHART_PY_PACKAGES[@]}"
  touch "$stamp"
}

# Runs one check of a test script: `check NAME COMMAND...` runs the command with its output in
# $CHECK_LOG (default: a file under $TMPDIR), counts it in CHECKS_PASSED or CHECKS_FAILED and
# says ok or FAIL (then with the output's last lines). The script ends with check_summary.
CHECKS_PASSED=0
CHECKS_FAILED=0
check() {
  local name=$1 log=${CHECK_LOG:-${TMPDIR:-/tmp}/batch-check.$$.log}; shift
  if "$@" > "$log" 2>&1; then
    CHECKS_PASSED=$((CHECKS_PASSED + 1)); echo "ok   $name"
  else
    CHECKS_FAILED=$((CHECKS_FAILED + 1)); echo "FAIL $name"; sed 's/^/     /' "$log" | tail -n 30
  fi
}

# Prints "<what>: N passed, N failed" and fails when one did.
check_summary() {
  echo "$1: $CHECKS_PASSED passed, $CHECKS_FAILED failed"
  [ "$CHECKS_FAILED" = 0 ]
}

# Waits for the simulator's gateway (`async-dispatcher-sim gateway --listen 127.0.0.1:0`) to
# print its address in the log $1, and prints its port.
gateway_port() {
  local port=
  for _ in $(seq 1 100); do
    port=$(sed -n 's|^listening gateway=http://127.0.0.1:\([0-9]*\).*|\1|p' "$1")
    if [ -n "$port" ]; then echo "$port"; return; fi
    sleep 0.1
  done
  echo "the gateway did not start; see $1" >&2; return 1
}
