#!/usr/bin/env bash
# Runs every test of the workspace. The tests start their own redis-server on free loopback
# ports, so only the binary is needed: it is installed with apt-get when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_redis
cargo test --workspace "$@"
