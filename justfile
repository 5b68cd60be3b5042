# Recipes for the common tasks; each calls a script that also works without `just`.

# Run the demo: a real Redis, the dispatcher simulator and `processor serve`, driven with curl.
demo:
    bash scripts/demo.sh

# Run every test (installs redis-server when missing).
test:
    bash scripts/test.sh

# What CI runs: formatting, clippy, tests.
ci:
    bash .ci/run

# Test the Helm chart: lint, render, Kubernetes schemas, config checks, checkov (CI runs it).
chart-test:
    bash scripts/chart-test.sh

# Build the container images (static release binaries, FROM scratch) with buildah and test them
# inside their own roots. Not in CI: a release build of its own takes 10 minutes or more.
image:
    bash scripts/image.sh

# Measure the processor against the limits of this machine; writes docs/benchmarks.md and docs/*.svg.
bench:
    bash scripts/bench.sh

# Fuzz the JSON scanner against serde_json, both of its paths, SECONDS each (nightly, cargo-fuzz).
fuzz SECONDS="300":
    bash scripts/fuzz.sh {{SECONDS}}
