#!/usr/bin/env bash
# `just fuzz [SECONDS]`: fuzzes the JSON scanner (crates/json) against serde_json (fuzz/), on its
# SSE2 path and then on its portable path (what targets other than x86-64 run), SECONDS each
# (default 300). Needs the nightly toolchain and cargo-fuzz: installed here when missing.
# Inputs that fail are kept in fuzz/artifacts/json/.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs="${1:-300}"
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
mkdir -p corpus/json
for features in "" "--features portable"; do
    echo "== json ${features:-(SSE2)}: ${secs}s"
    # shellcheck disable=SC2086
    cargo +nightly fuzz run json $features corpus/json seeds/json -- -max_total_time="$secs"
done
