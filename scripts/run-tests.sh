#!/usr/bin/env bash
# Runs every test binary of the workspace, several at once. `cargo test` runs its binaries one
# after the other, and most of this suite's time is spent waiting (on servers it starts, on
# timeouts it provokes, on simulated answers), not on the CPU: run side by side, the slowest
# binaries overlap instead of adding up. Each binary runs as `cargo test` would run it: from its
# package's directory, with the variables cargo sets. Its output is printed whole when it fails,
# as one line otherwise.
#
# Usage: run-tests.sh [JOBS]   (default TEST_JOBS, else 2). Exits non-zero when any test failed.
# Two, not more: the suite holds timing checks (a fairness order, a half-sent connection closed
# within seconds) that three binaries at once beside a build broke on this 2-core machine.
set -uo pipefail
cd "$(dirname "$0")/.."
jobs="${1:-${TEST_JOBS:-2}}"
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT

# Every test binary (unit and integration tests of every package): path, package directory,
# name. Built once here; cargo's JSON messages say where each one is.
if ! cargo test --workspace --no-run --message-format=json-render-diagnostics >"$logs/build.json"; then
  echo "building the tests failed" >&2
  exit 1
fi
python3 - "$logs/build.json" >"$logs/binaries" <<'PY'
import json, os, sys
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["executable"], os.path.dirname(m["manifest_path"]), m["target"]["name"], sep="\t")
PY

# The slowest binaries first (measured in CI: a minute or more each), so the run does not end
# with one of them alone; the rest in cargo's order.
slow='^(net_faults|replicas|quick|dispatcher_versions|jobs|serve|yielding|faults)$'
{ awk -F'\t' -v re="$slow" '$3 ~ re' "$logs/binaries"; awk -F'\t' -v re="$slow" '$3 !~ re' "$logs/binaries"; } \
  >"$logs/order"

cargo_bin="$(command -v cargo)"
run_one() { # path dir name index
  local started=$SECONDS status=0
  (cd "$2" && CARGO="$cargo_bin" CARGO_MANIFEST_DIR="$2" "$1" >"$logs/$4.log" 2>&1) || status=$?
  local took=$((SECONDS - started)) rel="${2#"$PWD"/}"
  # One write per binary, so that lines of binaries ending together do not interleave.
  if [ "$status" = 0 ]; then
    echo "ok   ${took}s  $rel: $3 ($(grep -h '^test result' "$logs/$4.log" | tail -1))"
  else
    touch "$logs/$4.failed"
    { echo "FAILED ${took}s  $rel: $3"; sed 's/^/    /' "$logs/$4.log"; } >"$logs/$4.report"
    cat "$logs/$4.report"
  fi
}

i=0
while IFS=$'\t' read -r path dir name; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  i=$((i + 1))
  run_one "$path" "$dir" "$name" "$i" &
done <"$logs/order"
wait

# Documentation tests (the crates' READMEs are their front pages): rustdoc builds them, so
# they come after the binaries rather than competing with them for the CPU.
doc_status=0
cargo test --workspace --doc --no-fail-fast -q || doc_status=$?

failed=$(find "$logs" -name '*.failed' | wc -l)
echo "test binaries: $i run, $failed failed; doctests: $([ "$doc_status" = 0 ] && echo ok || echo FAILED)"
[ "$failed" = 0 ] && [ "$doc_status" = 0 ]
