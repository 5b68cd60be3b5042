#!/usr/bin/env bash
# Tests the Helm chart deploy/helm/batch-processor (CI runs it from .ci/run), with the default
# values and each realistic values file in its ci/ folder:
#   - helm lint, and helm template (namespace llm-d, release name `batch`), as docs/deploy.md says;
#   - every rendered manifest validated against the Kubernetes $KUBE_VERSION schemas
#     (kubernetes-validate --strict, schemas shipped in the package: offline);
#   - the rendered processor config (ConfigMap processor.yaml) accepted by `processor check-config`,
#     with stand-ins at the mounted secrets' paths;
#   - in async mode, the rendered dispatcher ConfigMap (queues.json, transport.json, and the
#     transport config in llm-d-async-values.yaml) equal, as JSON, to what
#     `processor queues --json` / `--transport-config` prints for that config;
#   - checkov on the rendered manifests: no failed check (the chart's skips carry their reasons);
#   - the chart refusing values the service could not run with.
# helm is built with `go install` into $GOPATH/bin, the Python tools into a virtualenv under
# ~/.cache: both once per machine (scripts/lib.sh ensure_helm, ensure_chart_tools).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_helm
ensure_chart_tools   # exports CHART_VENV
KUBE_VERSION=1.37.0
chart=${CHART:-deploy/helm/batch-processor}   # another copy: to see a broken chart fail
cargo build --quiet --bin processor
processor=$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/debug/processor   # cargo's own target dir
py=$CHART_VENV/bin/python

work=$(mktemp -d -t batch-chart-XXXXXX)
trap 'rm -rf "$work"' EXIT
export CHECK_LOG=$work/check.log

# Writes each document of a rendered chart to $2/<kind>-<name>.yaml, and the ConfigMaps' files
# to $3 (processor.yaml; in async mode queues.json, transport.json, llm-d-async-values.yaml).
split_manifests() {
  "$py" - "$1" "$2" "$3" <<'EOF'
import sys, yaml, os
src, out, files = sys.argv[1], sys.argv[2], sys.argv[3]
for doc in yaml.safe_load_all(open(src)):
    if not doc:
        continue
    name = f"{doc['kind']}-{doc['metadata']['name']}".lower()
    with open(os.path.join(out, name + ".yaml"), "w") as f:
        yaml.safe_dump(doc, f)
    if doc["kind"] == "ConfigMap":
        for key, text in doc.get("data", {}).items():
            with open(os.path.join(files, key), "w") as f:
                f.write(text)
EOF
}

# Stand-ins for the mounted secrets, at the rendered paths moved under $work: the config is
# checked as the pod would read it.
secrets_root=$work/secrets
mkdir -p "$secrets_root/etc/batch-processor"/{redis,api-keys,redis-tls,s3}
printf 'key-of-tenant-a tenant-a\n' > "$secrets_root/etc/batch-processor/api-keys/api-keys"
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=chart-test-ca \
  -keyout "$work/ca.key" -out "$secrets_root/etc/batch-processor/redis-tls/ca.crt" 2>/dev/null
echo AKIACHARTTEST > "$secrets_root/etc/batch-processor/s3/access-key-id"
echo chart-test-secret > "$secrets_root/etc/batch-processor/s3/secret-access-key"

check_config() { # DIR: processor check-config on the rendered config
  # The URL's scheme follows the config: redis_tls only goes with a rediss:// URL.
  local scheme=redis
  if grep -q '^redis_tls:' "$1/processor.yaml"; then scheme=rediss; fi
  for key in redis-url url; do
    echo "$scheme://redis.llm-d.svc.cluster.local:6379" > "$secrets_root/etc/batch-processor/redis/$key"
  done
  sed "s|/etc/batch-processor/|$secrets_root/etc/batch-processor/|g" "$1/processor.yaml" > "$1/checked.yaml"
  if [ "$(grep -c "$secrets_root" "$1/checked.yaml")" = 0 ]; then echo "no mounted secret path in the config"; return 1; fi
  "$processor" check-config --config "$1/checked.yaml" > "$1/check-config.out"
}

# The dispatcher's files as `processor queues` prints them for the same config, compared as
# JSON (lines starting with # are comments, left out).
compare_queues() { # DIR
  "$processor" queues --config "$1/checked.yaml" --json > "$1/queues.expected"
  "$processor" queues --config "$1/checked.yaml" --transport-config > "$1/transport.expected" 2>/dev/null
  "$py" - "$1" <<'EOF'
import json, sys, os
d = sys.argv[1]
def load(path):
    return json.loads("".join(l for l in open(path) if not l.lstrip().startswith("#")))
ok = True
import yaml
# The llm-d-async chart's values carry the same transport config, plus that chart's urlSecret.
chart_values = yaml.safe_load(open(os.path.join(d, "llm-d-async-values.yaml")))["ap"]
assert chart_values["transport"] == "redis-sortedset", chart_values["transport"]
transport = dict(chart_values["transportConfig"])
secret = transport.pop("urlSecret")
assert secret["name"] and secret["key"], secret
with open(os.path.join(d, "chart-transport.json"), "w") as f:
    json.dump(transport, f)
for rendered, expected in (("queues.json", "queues.expected"), ("transport.json", "transport.expected"),
                           ("chart-transport.json", "transport.expected")):
    got, want = load(os.path.join(d, rendered)), load(os.path.join(d, expected))
    if got != want:
        ok = False
        print(f"{rendered} differs from `processor queues`:\nchart:  {json.dumps(got, sort_keys=True)}\nqueues: {json.dumps(want, sort_keys=True)}")
    else:
        print(f"{rendered}: {len(want if isinstance(want, list) else want['queues'])} queue(s), as `processor queues` prints")
sys.exit(0 if ok else 1)
EOF
}

# The ServiceMonitor (a CRD, outside the Kubernetes schemas): its endpoints name ports of the
# Service it selects, on /metrics.
check_servicemonitor() { # MANIFESTS-DIR
  "$py" - "$1" <<'EOF'
import glob, os, sys, yaml
d = sys.argv[1]
(sm,) = [yaml.safe_load(open(p)) for p in glob.glob(os.path.join(d, "servicemonitor-*.yaml"))]
services = [yaml.safe_load(open(p)) for p in glob.glob(os.path.join(d, "service-*.yaml"))]
assert sm["apiVersion"] == "monitoring.coreos.com/v1", sm["apiVersion"]
want = sm["spec"]["selector"]["matchLabels"]
(svc,) = [s for s in services if want.items() <= s["metadata"]["labels"].items()]
ports = {p["name"] for p in svc["spec"]["ports"]}
for ep in sm["spec"]["endpoints"]:
    assert ep["port"] in ports, (ep["port"], ports)
    assert ep["path"] == "/metrics", ep["path"]
print(f"scrapes {[ep['port'] for ep in sm['spec']['endpoints']]} of Service {svc['metadata']['name']}")
EOF
}

cases=(default "$chart"/ci/*-values.yaml)
for case in "${cases[@]}"; do
  name=$(basename "$case" .yaml)
  args=()
  [ "$case" = default ] || args=(-f "$case")
  dir=$work/$name
  mkdir -p "$dir/manifests"
  echo "== $name"
  check "helm lint ($name)" helm lint --strict "$chart" "${args[@]}"
  check "helm template ($name)" \
    bash -c 'helm template batch "$@" > "$0"' "$dir/rendered.yaml" "$chart" --namespace llm-d "${args[@]}"
  [ -s "$dir/rendered.yaml" ] || continue
  split_manifests "$dir/rendered.yaml" "$dir/manifests" "$dir"
  # ServiceMonitor is a CRD: no Kubernetes schema has it; check_servicemonitor checks it.
  check "kubernetes-validate --strict -k $KUBE_VERSION ($name)" \
    "$CHART_VENV/bin/kubernetes-validate" --strict --quiet -k "$KUBE_VERSION" \
    $(ls "$dir"/manifests/*.yaml | grep -v /servicemonitor-)
  if ls "$dir"/manifests/servicemonitor-* >/dev/null 2>&1; then
    check "ServiceMonitor scrapes a port of the Service ($name)" check_servicemonitor "$dir/manifests"
  fi
  check "processor check-config on the rendered config ($name)" check_config "$dir"
  if [ -e "$dir/queues.json" ]; then
    check "dispatcher ConfigMap = processor queues ($name)" compare_queues "$dir"
  fi
  check "checkov ($name)" "$CHART_VENV/bin/checkov" --quiet --compact --framework kubernetes \
    --skip-download -d "$dir/manifests"
done

# Values the service could not start with are refused at render time, naming the value.
refused() { # EXPECTED-MESSAGE HELM-ARGS...
  local want=$1; shift
  if helm template batch "$chart" "$@" > "$work/refused.out" 2>&1; then echo "rendered"; return 1; fi
  grep -F "$want" "$work/refused.out"
}
check "refused: no auth" refused "auth: set apiKeys.existingSecret or tenantHeader" \
  --set auth.apiKeys.existingSecret=
check "refused: both auth kinds" refused "not both" --set auth.tenantHeader=X-User
check "refused: a key the chart owns" refused "config.serve.listen is set by the chart" \
  --set config.serve.listen=0.0.0.0:1
check "refused: s3 without a bucket URL" refused "storage.s3.url" --set storage.type=s3
check "refused: async without a pool" refused "no model in \`models\` has an inference_pool_name" \
  --set 'models[0].name=m' --set 'models[0].url=http://gw'
check "refused: model_gateways in config" refused "config.model_gateways is set by the chart" \
  --set config.model_gateways.m.url=http://gw
check "refused: a model twice" refused "models: m is listed twice" \
  --set 'models[0].name=m' --set 'models[1].name=m'
check "refused: no model" refused "models: list at least one model" --set 'models=null'
check "refused: a pool override of no model's pool" \
  refused "dispatcher.pools: pool-x is not the inference_pool_name of any model" \
  -f "$chart/ci/async-two-pools-values.yaml" --set dispatcher.pools.pool-x.pods=2

check_summary "chart tests"
