#!/usr/bin/env bash
# `just bench`: measures the processor against the limits of this machine (redis-benchmark,
# the simulated gateway's capacity) and writes docs/benchmarks.md and docs/*.svg.
# Installs redis-server and redis-benchmark with apt-get when missing. Extra arguments go to
# the bench binary (e.g. --quick, --only aimd, --no-cluster, --out DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

ensure_redis
cargo build --release --bins
if [ "$#" -eq 0 ]; then set -- --out docs; fi
exec target/release/bench "$@"
