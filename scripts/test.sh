#!/usr/bin/env bash
# Runs every test of the workspace. The tests start their own redis-server on free loopback
# ports, so only the binary is needed: it is installed with apt-get when missing. The S3 tests
# start moto_server, installed here once into the virtualenv $BATCH_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_redis
ensure_moto   # exports BATCH_VENV
cargo test --workspace "$@"
