#!/usr/bin/env bash
# Runs every test of the workspace. The tests start their own redis-server on free loopback
# ports, so only the binary is needed: it is installed with apt-get when missing. The OpenAI SDK
# suite (tests/serve_sdk.rs), the S3 tests (moto_server) and the fuzz of the service
# (tests/serve_fuzz.rs, schemathesis) run from a virtualenv made here once.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_redis
ensure_prometheus   # sync mode's load through Prometheus (crates/sync-dispatch/tests/yielding.rs)
ensure_venv   # exports BATCH_VENV
ensure_moto   # the same virtualenv
ensure_schemathesis   # the same virtualenv: the fuzz of the running service
status=0
if [ "$#" -gt 0 ]; then
  # Arguments (a filter, `-p crate`, `-- --nocapture`) go to cargo test as given.
  cargo test --workspace --no-fail-fast "$@" || status=$?
else
  # Every test binary, several at once (scripts/run-tests.sh says why); TEST_JOBS=1 runs them
  # one by one.
  bash scripts/run-tests.sh || status=$?
fi
# The JSON scanner's portable path, which targets other than x86-64 run, tested here too.
cargo test -p batch-json -p batch-wire --features batch-json/portable --lib || status=$?
# The examples for those who embed the crates (built by `cargo test`, run only here): each runs
# on loopback in a second or so and exits non-zero when its job does not come out whole. Built
# for the whole workspace, as the tests were, and run from the target directory: `cargo run -p`
# would resolve one package's features and rebuild half the tree for each (100 s of CI).
cargo build --workspace --examples -q || status=$?
for example in sync_job async_job serve; do
  "${CARGO_TARGET_DIR:-target}/debug/examples/$example" || status=$?
done
exit "$status"
