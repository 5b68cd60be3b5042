{{/* The release's resource name, at most 63 characters. */}}
{{- define "bp.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "bp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "bp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "bp.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "bp.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: llm-d
{{- end -}}

{{- define "bp.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "bp.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Where the mounted secrets are: the rendered config names these paths. */}}
{{- define "bp.secretsDir" -}}/etc/batch-processor{{- end -}}

{{/*
The processor's config file: the values' `config` with the keys the chart owns set from the other
values. Fails on a key the chart owns, and on a config the service would refuse to start with.
*/}}
{{- define "bp.processorConfig" -}}
{{- $v := .Values -}}
{{- $dir := include "bp.secretsDir" . -}}
{{- $config := deepCopy $v.config -}}
{{- $serve := default dict (get $config "serve") -}}
{{- range $key := list "redis_url_file" "redis_tls" "work_dir" "model_gateways" -}}
{{- if hasKey $config $key -}}{{- fail (printf "config.%s is set by the chart: use the chart's values (redis, workDir, models)" $key) -}}{{- end -}}
{{- end -}}
{{- $_ := set $config "model_gateways" (include "bp.modelGateways" . | fromJson) -}}
{{- if eq $v.config.dispatch_mode "async" -}}
{{- $ad := deepCopy (default dict (get $config "async_dispatch")) -}}
{{- if hasKey $ad "dispatcher" -}}{{- fail "config.async_dispatch.dispatcher is set by the chart: use the chart's values (dispatcher.*)" -}}{{- end -}}
{{- $d := $v.dispatcher -}}
{{- $gate := include "bp.poolFacts" $d | fromJson -}}
{{- $_ := set $gate "poll_interval" (printf "%vms" $d.pollIntervalMs) -}}
{{- $_ := set $gate "waiting_gate" (ne $d.waitingGate false) -}}
{{- if $d.gateType -}}{{- $_ := set $gate "gate_type" $d.gateType -}}{{- end -}}
{{- if gt (int (default 0 $d.batchSize)) 0 -}}{{- $_ := set $gate "batch_size" (int $d.batchSize) -}}{{- end -}}
{{- if $d.metricsUrls -}}{{- $_ := set $gate "metrics_urls" $d.metricsUrls -}}{{- end -}}
{{- $known := include "bp.pools" . | fromJson -}}
{{- $pools := dict -}}
{{- range $pool, $own := default dict $d.pools -}}
{{- if not (hasKey $known $pool) -}}{{- fail (printf "dispatcher.pools: %s is not the inference_pool_name of any model" $pool) -}}{{- end -}}
{{- $_ := set $pools $pool (include "bp.poolFacts" (default dict $own) | fromJson) -}}
{{- end -}}
{{- if $pools -}}{{- $_ := set $gate "pools" $pools -}}{{- end -}}
{{- $_ := set $ad "dispatcher" $gate -}}
{{- $_ := set $config "async_dispatch" $ad -}}
{{- end -}}
{{- range $key := list "listen" "api_keys_file" "tenant_header" "storage" "s3" -}}
{{- if hasKey $serve $key -}}{{- fail (printf "config.serve.%s is set by the chart: use the chart's values (service, auth, storage)" $key) -}}{{- end -}}
{{- end -}}
{{- if not $v.redis.existingSecret -}}{{- fail "redis.existingSecret: name the Secret holding the Redis URL" -}}{{- end -}}
{{- $_ := set $config "redis_url_file" (printf "%s/redis/%s" $dir $v.redis.key) -}}
{{- with $v.redis.tls -}}
{{- if .existingSecret -}}
{{- $tls := dict -}}
{{- if .caKey -}}{{- $_ := set $tls "ca_file" (printf "%s/redis-tls/%s" $dir .caKey) -}}{{- end -}}
{{- if and .certKey .keyKey -}}
{{- $_ := set $tls "cert_file" (printf "%s/redis-tls/%s" $dir .certKey) -}}
{{- $_ := set $tls "key_file" (printf "%s/redis-tls/%s" $dir .keyKey) -}}
{{- end -}}
{{- if .serverName -}}{{- $_ := set $tls "server_name" .serverName -}}{{- end -}}
{{- $_ := set $config "redis_tls" $tls -}}
{{- end -}}
{{- end -}}
{{- $_ := set $config "work_dir" "/var/lib/batch-processor/work" -}}
{{- $_ := set $serve "listen" (printf "0.0.0.0:%v" $v.service.port) -}}
{{- if and $v.auth.apiKeys.existingSecret $v.auth.tenantHeader -}}
{{- fail "auth: set either apiKeys.existingSecret or tenantHeader, not both" -}}
{{- else if $v.auth.apiKeys.existingSecret -}}
{{- $_ := set $serve "api_keys_file" (printf "%s/api-keys/%s" $dir $v.auth.apiKeys.key) -}}
{{- else if $v.auth.tenantHeader -}}
{{- $_ := set $serve "tenant_header" $v.auth.tenantHeader -}}
{{- else -}}
{{- fail "auth: set apiKeys.existingSecret or tenantHeader (without either the service only listens on loopback)" -}}
{{- end -}}
{{- if eq $v.storage.type "s3" -}}
{{- if not (hasPrefix "s3://" $v.storage.s3.url) -}}{{- fail "storage.s3.url: s3://bucket/prefix" -}}{{- end -}}
{{- $_ := set $serve "storage" $v.storage.s3.url -}}
{{- $s3 := dict -}}
{{- with $v.storage.s3 -}}
{{- if .endpoint -}}{{- $_ := set $s3 "endpoint" .endpoint -}}{{- end -}}
{{- if .region -}}{{- $_ := set $s3 "region" .region -}}{{- end -}}
{{- if .allowHttp -}}{{- $_ := set $s3 "allow_http" true -}}{{- end -}}
{{- if .existingSecret -}}
{{- $_ := set $s3 "access_key_id_file" (printf "%s/s3/%s" $dir .accessKeyIdKey) -}}
{{- $_ := set $s3 "secret_access_key_file" (printf "%s/s3/%s" $dir .secretAccessKeyKey) -}}
{{- end -}}
{{- end -}}
{{- if $s3 -}}{{- $_ := set $serve "s3" $s3 -}}{{- end -}}
{{- else if eq $v.storage.type "file" -}}
{{- $_ := set $serve "storage" "file:///var/lib/batch-processor/storage" -}}
{{- else -}}
{{- fail "storage.type: s3 or file" -}}
{{- end -}}
{{- $_ := set $config "serve" $serve -}}
{{- toYaml $config -}}
{{- end -}}

{{/* config.model_gateways from the `models` list: name → the entry's other keys. */}}
{{- define "bp.modelGateways" -}}
{{- $gateways := dict -}}
{{- range $i, $m := .Values.models -}}
{{- if not $m.name -}}{{- fail (printf "models[%d]: every model needs a name" $i) -}}{{- end -}}
{{- if hasKey $gateways $m.name -}}{{- fail (printf "models: %s is listed twice" $m.name) -}}{{- end -}}
{{- $_ := set $gateways $m.name (omit $m "name") -}}
{{- end -}}
{{- if not $gateways -}}{{- fail "models: list at least one model" -}}{{- end -}}
{{- toJson $gateways -}}
{{- end -}}

{{/*
The pools of config.model_gateways, as `processor queues` derives them: pool → its models,
sorted by name (both sides must name the same queues: <queue_prefix>:requests:<pool>).
*/}}
{{- define "bp.pools" -}}
{{- $pools := dict -}}
{{- $gateways := include "bp.modelGateways" . | fromJson -}}
{{- range $model := keys $gateways | sortAlpha -}}
{{- $gw := get $gateways $model -}}
{{- if and $gw $gw.inference_pool_name -}}
{{- $models := default list (get $pools $gw.inference_pool_name) -}}
{{- $_ := set $pools $gw.inference_pool_name (append $models $model) -}}
{{- end -}}
{{- end -}}
{{- toJson $pools -}}
{{- end -}}

{{/*
The facts and gate params set in one values table (dispatcher, or an entry of dispatcher.pools) as
the processor's config keys (async_dispatch.dispatcher, or its pools.<pool>): maxNumSeqs ->
max_num_seqs (0: unset), pods, headroom, gateParams.max_concurrency / baseline.
*/}}
{{- define "bp.poolFacts" -}}
{{- $facts := dict -}}
{{- if gt (int (default 0 .maxNumSeqs)) 0 -}}{{- $_ := set $facts "max_num_seqs" (int .maxNumSeqs) -}}{{- end -}}
{{- if .pods -}}{{- $_ := set $facts "pods" (int .pods) -}}{{- end -}}
{{- if hasKey . "headroom" -}}{{- $_ := set $facts "headroom" .headroom -}}{{- end -}}
{{- range $key := list "max_concurrency" "baseline" -}}
{{- if hasKey (default dict $.gateParams) $key -}}{{- $_ := set $facts $key (get $.gateParams $key) -}}{{- end -}}
{{- end -}}
{{- toJson $facts -}}
{{- end -}}

{{/*
One pool's gate, derived as `processor queues` derives it (DispatcherSettings::sizing): the keys of
dispatcher.pools.<pool> over those of dispatcher.*; max_concurrency = maxNumSeqs (else 100),
baseline = headroom; a local-max-concurrency limit = pods × max(1, ⌊max_concurrency × (1 − baseline)⌋);
`full`: what a full budget lets in at one poll, pods × max_concurrency (when sized).
Called with (dict "root" $ "pool" <pool>).
*/}}
{{- define "bp.poolSizing" -}}
{{- $d := .root.Values.dispatcher -}}
{{- $top := include "bp.poolFacts" $d | fromJson -}}
{{- $f := merge (include "bp.poolFacts" (default dict (get (default dict $d.pools) .pool)) | fromJson) $top -}}
{{- $seqs := int (default 0 $f.max_num_seqs) -}}
{{- $sized := or (gt $seqs 0) (hasKey $f "max_concurrency") -}}
{{- $m := int (ternary $seqs 100 (gt $seqs 0)) -}}
{{- if hasKey $f "max_concurrency" -}}{{- $m = int $f.max_concurrency -}}{{- end -}}
{{- $b := 0.25 -}}
{{- if hasKey $f "headroom" -}}{{- $b = float64 $f.headroom -}}{{- end -}}
{{- if hasKey $f "baseline" -}}{{- $b = float64 $f.baseline -}}{{- end -}}
{{- $pods := int (default 1 $f.pods) -}}
{{- $cap := int (floor (mulf $m (subf 1 $b))) -}}
{{- if lt $cap 1 -}}{{- $cap = 1 -}}{{- end -}}
{{- dict "max_concurrency" $m "baseline" $b "limit" (mul $pods $cap) "full" (mul $pods $m) "sized" $sized | toJson -}}
{{- end -}}

{{/*
The dispatcher-wide pacing: batch_size = dispatcher.batchSize, else the smallest sized pool's
pods × max_concurrency (no poll brings a pool more than its pods run), else the dispatcher's 10.
*/}}
{{- define "bp.gateSizing" -}}
{{- $batch := int (default 0 .Values.dispatcher.batchSize) -}}
{{- if eq $batch 0 -}}
{{- range $pool := keys (include "bp.pools" $ | fromJson) -}}
{{- $s := include "bp.poolSizing" (dict "root" $ "pool" $pool) | fromJson -}}
{{- if and $s.sized (or (eq $batch 0) (lt (int $s.full) $batch)) -}}{{- $batch = int $s.full -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- if eq $batch 0 -}}{{- $batch = 10 -}}{{- end -}}
{{- dict "batch_size" $batch | toJson -}}
{{- end -}}

{{/*
One pool's gate type and params, as `processor queues` prints them: the configured gateType; unset,
a gate that reads the pool's pods (dispatcher.metricsUrls.<pool>) itself, endpoint-scrape for one
pod without the waiting gate, else composite over each pod's running (and waiting) gates; a pool
without metricsUrls, prometheus-budget. Called with (dict "root" $ "pool" <pool>).
*/}}
{{- define "bp.poolGate" -}}
{{- $d := .root.Values.dispatcher -}}
{{- $pool := .pool -}}
{{- $urls := get (default dict $d.metricsUrls) $pool | default list -}}
{{- $waiting := ne $d.waitingGate false -}}
{{- $kind := $d.gateType -}}
{{- if and (not $kind) $d.metricsUrls -}}{{- $kind = "endpoint-scrape" -}}{{- end -}}
{{- if and (eq $kind "endpoint-scrape") (not $urls) -}}{{- $kind = "prometheus-budget" -}}
{{- else if eq $kind "endpoint-scrape" -}}{{- $kind = ternary "endpoint-scrape" "composite" (and (eq (len $urls) 1) (not $waiting)) -}}
{{- else if not $kind -}}{{- $kind = "prometheus-budget" -}}
{{- end -}}
{{- $s := include "bp.poolSizing" . | fromJson -}}
{{- $params := dict "pool" $pool "max_concurrency" (toString $s.max_concurrency) "baseline" (toString $s.baseline) -}}
{{- if eq $kind "local-max-concurrency" -}}
{{- $params = dict "limit" (toString $s.limit) -}}
{{- else if or (eq $kind "endpoint-scrape") (eq $kind "composite") -}}
{{- $gates := list -}}
{{- range $url := $urls -}}
{{- $gates = append $gates (dict "gate_type" "endpoint-scrape" "gate_params" (dict "url" $url "metric" "vllm:num_requests_running" "max_count_per_pod" (toString $s.max_concurrency) "baseline" (toString $s.baseline))) -}}
{{- if $waiting -}}
{{- $gates = append $gates (dict "gate_type" "endpoint-scrape" "gate_params" (dict "url" $url "metric" "vllm:num_requests_waiting" "max_count_per_pod" "1" "baseline" "0")) -}}
{{- end -}}
{{- end -}}
{{- if eq $kind "endpoint-scrape" -}}{{- $params = (index $gates 0).gate_params -}}
{{- else -}}{{- $params = dict "gates" (toJson $gates) -}}
{{- end -}}
{{- end -}}
{{- dict "gate_type" $kind "gate_params" $params | toJson -}}
{{- end -}}

{{/* The dispatcher's queue entries, one per pool, sorted by pool. */}}
{{- define "bp.dispatcherQueues" -}}
{{- $ad := default dict .Values.config.async_dispatch -}}
{{- $prefix := default "llm-d-async" $ad.queue_prefix -}}
{{- $pools := include "bp.pools" . | fromJson -}}
{{- $gateways := include "bp.modelGateways" . | fromJson -}}
{{- $entries := list -}}
{{- range $pool := keys $pools | sortAlpha -}}
{{- $url := "" -}}
{{- range $model := get $pools $pool -}}
{{- $gw := get $gateways $model -}}
{{- if and (not $url) $gw.url -}}{{- $url = trimSuffix "/" $gw.url -}}{{- end -}}
{{- end -}}
{{- $gate := include "bp.poolGate" (dict "root" $ "pool" $pool) | fromJson -}}
{{- $entries = append $entries (dict "queue_name" (printf "%s:requests:%s" $prefix $pool) "igw_base_url" (default "http://CHANGE-ME" $url) "request_path_url" $.Values.dispatcher.requestPath "gate_type" $gate.gate_type "gate_params" $gate.gate_params) -}}
{{- end -}}
{{- toJson $entries -}}
{{- end -}}
