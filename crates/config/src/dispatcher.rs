//! What the real llm-d-async dispatcher must be given so that both sides agree on queue names.

use std::collections::BTreeMap;

use batch_keys::{NameError, QueueNames};
use serde::Serialize;

use crate::types::{DispatcherSettings, PoolSettings, ProcessorConfig};

/// `igw_base_url` of a pool none of whose models has a `url`: the operator must fill it in.
pub const PLACEHOLDER_GATEWAY_URL: &str = "http://CHANGE-ME";

/// The request path the dispatcher appends to `igw_base_url` (our batches are chat completions).
pub const DISPATCHER_REQUEST_PATH: &str = "/v1/chat/completions";

/// The gate our queue entries use unless `async_dispatch.dispatcher.gate_type` names another.
pub const DISPATCHER_GATE_TYPE: &str = "prometheus-budget";

/// The gate types the real dispatcher knows; any other name it opens fully.
pub const DISPATCHER_GATE_TYPES: [&str; 11] = [
    "constant",
    "redis",
    "redis-quota",
    "prometheus-budget",
    "prometheus-saturation",
    "prometheus-query",
    "endpoint-scrape",
    "local-max-concurrency",
    "composite",
    "wait-on-refuse",
    "tier-priority-admission",
];

/// The dispatcher's own `max_concurrency` of a `prometheus-budget` gate, used when neither it
/// nor `max_num_seqs` is configured.
pub const DISPATCHER_MAX_CONCURRENCY: usize = 100;

/// The dispatcher's own worker count (`--concurrency`).
pub const DISPATCHER_CONCURRENCY: usize = 64;

/// The v0.10 dispatcher's retry sorted set (its default, shared by every queue).
pub const DISPATCHER_RETRY_QUEUE: &str = "retry-sortedset";

/// The v0.10 dispatcher's default poll interval, milliseconds.
pub const DISPATCHER_POLL_INTERVAL_MS: u64 = 1000;

/// The v0.10 dispatcher's default messages per poll.
pub const DISPATCHER_BATCH_SIZE: u64 = 10;

/// The dispatcher settings with every default filled in ([`DispatcherSettings::sizing`]), and
/// what is wrong with them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GateSizing {
    /// The configured gate, or the default of the pools without `metrics_urls`.
    pub gate_type: String,
    /// Pool → its model servers' metrics pages (`metrics_urls`).
    pub metrics_urls: BTreeMap<String, Vec<String>>,
    /// Whether a gate that reads the pods also closes while a request waits on any of them.
    pub waiting_gate: bool,
    /// Pool → its gate, sized from its own settings over the dispatcher's.
    pub pools: BTreeMap<String, PoolSizing>,
    /// The dispatcher's poll interval, milliseconds.
    pub poll_interval_ms: u64,
    /// Messages taken per poll of each queue at a full budget.
    pub batch_size: u64,
    /// The dispatcher's `--concurrency`.
    pub concurrency: usize,
    /// The dispatcher's `--prometheus-cache-ttl`, as a flag value (`1s`, `500ms`).
    pub prometheus_cache_ttl: String,
    /// Why this sizing may not protect online traffic (or may not work at all), one sentence
    /// each, naming the settings to change.
    pub warnings: Vec<String>,
}

/// One pool's gate: its settings (`async_dispatch.dispatcher.pools.<pool>`, else the
/// dispatcher's) with every default derived.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolSizing {
    /// The pool's ready pods.
    pub pods: usize,
    /// The pool's model servers' `--max-num-seqs`, when known.
    pub max_num_seqs: Option<usize>,
    /// The gate's `max_concurrency` per pod.
    pub max_concurrency: usize,
    /// The gate's `baseline`.
    pub baseline: f64,
    /// Whether `max_concurrency` was configured or derived from `max_num_seqs` rather than the
    /// dispatcher's own 100.
    pub sized: bool,
}

impl PoolSizing {
    /// The running requests per pod at which a load-reading gate's budget
    /// `1 − running / max_concurrency − baseline` reaches 0.
    pub fn closes_at(&self) -> f64 {
        self.max_concurrency as f64 * (1.0 - self.baseline)
    }

    /// The batch requests the pool can run below its gate, all pods together: what the
    /// dispatcher's workers are sized to (`None` for an unsized pool).
    fn workers(&self) -> Option<usize> {
        // A pod never runs more than max_num_seqs, whatever max_concurrency says.
        let runnable = match self.max_num_seqs {
            Some(seqs) => self.max_concurrency.min(seqs),
            None => self.max_concurrency,
        };
        self.sized
            .then(|| per_pod_cap(runnable, self.baseline) * self.pods)
    }

    /// Messages a full budget lets in at one poll: the pool's whole gate (`None` when unsized).
    fn full_poll(&self) -> Option<u64> {
        self.sized
            .then_some((self.pods * self.max_concurrency) as u64)
    }
}

impl GateSizing {
    /// The gate of `pool`: `endpoint-scrape` (`composite` over several pods) when its metrics
    /// pages are known and no other gate is configured, else the configured one, else
    /// `prometheus-budget`.
    fn gate_type_of(&self, pool: &str) -> &str {
        match self.metrics_urls.get(pool).map(Vec::len) {
            _ if self.gate_type != ENDPOINT_SCRAPE => &self.gate_type,
            Some(0) | None => DISPATCHER_GATE_TYPE,
            Some(1) if !self.waiting_gate => ENDPOINT_SCRAPE,
            Some(_) => "composite",
        }
    }

    /// The gate type and parameters of `pool`, sized as `sizing`, all strings as the dispatcher
    /// takes them.
    fn gate(&self, pool: &str, sizing: &PoolSizing) -> (String, BTreeMap<String, String>) {
        let strings = |pairs: &[(&str, String)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect()
        };
        let kind = self.gate_type_of(pool).to_owned();
        let params = match kind.as_str() {
            "local-max-concurrency" => strings(&[(
                "limit",
                (per_pod_cap(sizing.max_concurrency, sizing.baseline) * sizing.pods).to_string(),
            )]),
            ENDPOINT_SCRAPE | "composite" => {
                let urls = self.metrics_urls.get(pool).cloned().unwrap_or_default();
                // A pod's running gate: closed once max_concurrency × (1 − baseline) run.
                let running = |url: &str| {
                    strings(&[
                        ("url", url.to_owned()),
                        ("metric", RUNNING_METRIC.to_owned()),
                        ("max_count_per_pod", sizing.max_concurrency.to_string()),
                        ("baseline", format!("{}", sizing.baseline)),
                    ])
                };
                // A pod's waiting gate: budget 1 − min(waiting, 1), closed while any waits.
                let waiting = |url: &str| {
                    strings(&[
                        ("url", url.to_owned()),
                        ("metric", WAITING_METRIC.to_owned()),
                        ("max_count_per_pod", "1".to_owned()),
                        ("baseline", "0".to_owned()),
                    ])
                };
                if kind == ENDPOINT_SCRAPE {
                    running(urls.first().map_or("", String::as_str))
                } else {
                    let mut gates = Vec::new();
                    for url in &urls {
                        gates.push(serde_json::json!({"gate_type": ENDPOINT_SCRAPE, "gate_params": running(url)}));
                        if self.waiting_gate {
                            gates.push(serde_json::json!({"gate_type": ENDPOINT_SCRAPE, "gate_params": waiting(url)}));
                        }
                    }
                    strings(&[("gates", serde_json::Value::from(gates).to_string())])
                }
            }
            _ => strings(&[
                ("pool", pool.to_owned()),
                ("max_concurrency", sizing.max_concurrency.to_string()),
                ("baseline", format!("{}", sizing.baseline)),
            ]),
        };
        (kind, params)
    }
}

/// The gate that reads a model server's metrics page itself.
pub const ENDPOINT_SCRAPE: &str = "endpoint-scrape";

/// vLLM's gauge of the requests a server runs now: what every load-reading gate counts.
pub const RUNNING_METRIC: &str = "vllm:num_requests_running";

/// vLLM's gauge of the requests waiting in a server's queue.
pub const WAITING_METRIC: &str = "vllm:num_requests_waiting";

/// Requests a pod may run before a gate of `max_concurrency` and `baseline` closes, at least 1.
fn per_pod_cap(max_concurrency: usize, baseline: f64) -> usize {
    ((max_concurrency as f64 * (1.0 - baseline)).floor() as usize).max(1)
}

impl DispatcherSettings {
    /// These settings with every default derived, for the pools named `pools`.
    ///
    /// Each pool's settings are its entry in [`Self::pools`] over the dispatcher's own keys;
    /// from them, per pool:
    /// - `max_concurrency`: `max_num_seqs`, else the dispatcher's 100;
    /// - `baseline`: `headroom`, so the gate closes once `(1 − headroom)` of a pod's slots run.
    ///
    /// And for the whole dispatcher, which has one of each:
    /// - `batch_size`: the smallest sized pool's `pods × max_concurrency`, so that a full budget
    ///   fills that pool's slots in one poll, and no poll lands more on any pool than its pods
    ///   can run (the excess would wait in the servers' queues, ahead of online requests); a
    ///   larger pool fills over a few polls. Else the dispatcher's 10;
    /// - `concurrency`: each pool's `pods × max_concurrency × (1 − baseline)` (with
    ///   `max_concurrency` at most `max_num_seqs`), summed, when every pool is sized: the batch
    ///   then cannot take more than its share even while a gate acts on an old reading; else
    ///   the dispatcher's 64.
    pub fn sizing(&self, pools: &[String]) -> GateSizing {
        let gate_type = match &self.gate_type {
            Some(kind) => kind.clone(),
            None if !self.metrics_urls.is_empty() => ENDPOINT_SCRAPE.to_owned(),
            None => DISPATCHER_GATE_TYPE.to_owned(),
        };
        let reads_pods = self.gate_type.is_none() && !self.metrics_urls.is_empty();
        let cache_ttl = self.prometheus_cache_ttl.unwrap_or(if reads_pods {
            self.poll_interval
        } else {
            std::time::Duration::from_secs(1)
        });
        let sized_pools: BTreeMap<String, PoolSizing> = pools
            .iter()
            .map(|pool| (pool.clone(), self.pool_sizing(self.pools.get(pool))))
            .collect();
        // Without pools, the dispatcher's keys alone size the pacing.
        let every: Vec<PoolSizing> = match sized_pools.is_empty() {
            true => vec![self.pool_sizing(None)],
            false => sized_pools.values().cloned().collect(),
        };
        let batch_size = self.batch_size.map_or_else(
            || {
                every
                    .iter()
                    .filter_map(PoolSizing::full_poll)
                    .min()
                    .unwrap_or(DISPATCHER_BATCH_SIZE)
            },
            |b| b as u64,
        );
        let concurrency = self.concurrency.unwrap_or_else(|| {
            every
                .iter()
                .map(PoolSizing::workers)
                .sum::<Option<usize>>()
                .unwrap_or(DISPATCHER_CONCURRENCY)
        });
        let mut sizing = GateSizing {
            gate_type,
            metrics_urls: self.metrics_urls.clone(),
            waiting_gate: self.waiting_gate,
            pools: sized_pools,
            poll_interval_ms: self.poll_interval.as_millis().max(1) as u64,
            batch_size,
            concurrency,
            prometheus_cache_ttl: humantime::format_duration(cache_ttl)
                .to_string()
                .replace(' ', ""),
            warnings: Vec::new(),
        };
        sizing.warnings = self.warnings(&sizing, pools);
        sizing
    }

    /// One pool's gate: `own` (its entry in `pools`) over these settings.
    fn pool_sizing(&self, own: Option<&PoolSettings>) -> PoolSizing {
        let own = own.cloned().unwrap_or_default();
        let max_num_seqs = own.max_num_seqs.or(self.max_num_seqs);
        let sized = own
            .max_concurrency
            .or(self.max_concurrency)
            .or(max_num_seqs);
        PoolSizing {
            pods: own.pods.unwrap_or(self.pods),
            max_num_seqs,
            max_concurrency: sized.unwrap_or(DISPATCHER_MAX_CONCURRENCY),
            baseline: own
                .baseline
                .or(self.baseline)
                .unwrap_or(own.headroom.unwrap_or(self.headroom)),
            sized: sized.is_some(),
        }
    }

    fn warnings(&self, s: &GateSizing, pools: &[String]) -> Vec<String> {
        let mut out = Vec::new();
        if !DISPATCHER_GATE_TYPES.contains(&s.gate_type.as_str()) {
            out.push(format!(
                "gate_type {:?} is not a gate the dispatcher knows ({}): it would open the gate fully",
                s.gate_type,
                DISPATCHER_GATE_TYPES.join(", ")
            ));
        } else if !matches!(
            s.gate_type.as_str(),
            "prometheus-budget" | "local-max-concurrency" | ENDPOINT_SCRAPE
        ) {
            out.push(format!(
                "gate_type {}: its gate_params are printed as for prometheus-budget (pool, max_concurrency, baseline); write the ones it takes by hand",
                s.gate_type
            ));
        }
        if s.gate_type == ENDPOINT_SCRAPE {
            for pool in pools.iter().filter(|p| !s.metrics_urls.contains_key(*p)) {
                out.push(format!(
                    "pool {pool} has no metrics_urls, so its gate reads Prometheus (prometheus-budget); name its model servers' /metrics pages in async_dispatch.dispatcher.metrics_urls.{pool} for a gate that reads them itself"
                ));
            }
        }
        for pool in s.metrics_urls.keys().filter(|p| !pools.contains(p)) {
            out.push(format!(
                "metrics_urls names pool {pool}, which no model has as its inference_pool_name"
            ));
        }
        if matches!(s.gate_type.as_str(), "prometheus-budget" | ENDPOINT_SCRAPE) {
            for (pool, p) in &s.pools {
                let closes_at = p.closes_at();
                match p.max_num_seqs {
                    None => out.push(format!(
                        "pool {pool}: max_num_seqs is not set (async_dispatch.dispatcher.max_num_seqs, or pools.{pool}.max_num_seqs): the gate counts requests running, which never exceed the model servers' --max-num-seqs, and with max_concurrency {} it closes only once {closes_at:.0} run on a pod; set max_num_seqs to the servers' value",
                        p.max_concurrency
                    )),
                    Some(seqs) if closes_at >= seqs as f64 => out.push(format!(
                        "pool {pool}: the gate can never close: it closes once max_concurrency × (1 − baseline) = {closes_at:.1} requests run on a pod, but a pod runs at most max_num_seqs = {seqs}; lower max_concurrency or raise baseline"
                    )),
                    Some(_) => {}
                }
            }
        }
        if self
            .prometheus_cache_ttl
            .is_some_and(|ttl| ttl > std::time::Duration::from_secs(5))
        {
            out.push(format!(
                "prometheus_cache_ttl {}: the gate acts on load readings this old, long after the online traffic they show has changed",
                s.prometheus_cache_ttl
            ));
        }
        out
    }
}

/// The v0.10 dispatcher's `--transport-config-file` object for this processor's pools.
///
/// It has no `url`: the Redis URL may hold a password, and this is meant to be printed and
/// written to files. The operator adds `url` (or gives the dispatcher its address otherwise).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DispatcherTransportConfig {
    /// The sorted set retried requests wait in.
    pub retry_queue_name: String,
    /// The dispatcher's fallback result list (see [`DispatcherQueues::result_queue_name`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result_queue_name: Option<String>,
    /// How often each queue is polled.
    pub poll_interval_ms: u64,
    /// Messages taken per poll.
    pub batch_size: u64,
    /// Whether the dispatcher traces requests.
    pub enable_tracing: bool,
    /// One entry per pool, as in the older queues-config array.
    pub queues: Vec<DispatcherQueueEntry>,
}

impl DispatcherTransportConfig {
    /// The object as pretty JSON, ready to be written to a file.
    pub fn to_json(&self) -> String {
        // Serialising plain strings, numbers and maps cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_else(|_| "{}".to_owned())
    }
}

/// One entry of the dispatcher's `--redis.ss.queues-config-file` JSON array.
///
/// It deliberately has no `result_queue_name`: a queue-level one would override the
/// `internal.result_queue_name` of our envelopes, which routes each result to the replica that
/// owns the job (contract §3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DispatcherQueueEntry {
    /// The pool's request sorted set.
    pub queue_name: String,
    /// Base URL of the inference gateway serving the pool.
    pub igw_base_url: String,
    /// Path appended to `igw_base_url`.
    pub request_path_url: String,
    /// The dispatch gate.
    pub gate_type: String,
    /// The gate's parameters (`pool`, `max_concurrency`, `baseline`), all strings as the dispatcher
    /// expects.
    pub gate_params: BTreeMap<String, String>,
}

/// One pool as this processor sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolQueues {
    /// The inference pool name.
    pub pool: String,
    /// The models routed to the pool, sorted.
    pub models: Vec<String>,
    /// The sorted set this processor enqueues into.
    pub request_queue_name: String,
    /// The list this replica pops results from.
    pub result_queue_name: String,
}

/// Everything needed to configure the dispatcher from this processor's config.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DispatcherQueues {
    /// Every pool, sorted by name.
    pub pools: Vec<PoolQueues>,
    /// The `--redis.ss.queues-config-file` array, one entry per pool.
    pub queues_config: Vec<DispatcherQueueEntry>,
    /// The `--redis.ss.result-queue-name` value: the first pool's result list. Only the
    /// dispatcher's fallback for envelopes that name no result list; ours always name one.
    pub result_queue_name: Option<String>,
    /// The gate and pacing every queue entry and command line carries.
    pub sizing: GateSizing,
}

impl DispatcherQueues {
    /// The queues-config array as pretty JSON, ready to be written to a file.
    pub fn queues_config_json(&self) -> String {
        // Serialising plain strings and maps cannot fail.
        serde_json::to_string_pretty(&self.queues_config).unwrap_or_else(|_| "[]".to_owned())
    }

    /// Whether some queue's gate reads Prometheus: the dispatcher then needs `--prometheus-url`
    /// and refuses to start without it.
    pub fn needs_prometheus(&self) -> bool {
        self.queues_config
            .iter()
            .any(|q| q.gate_type.starts_with("prometheus"))
    }

    /// Whether some queue's gate reads the pool's load (through Prometheus or from the pods),
    /// so that `--prometheus-cache-ttl`, which both go through, matters.
    pub fn reads_load(&self) -> bool {
        self.needs_prometheus()
            || self
                .queues_config
                .iter()
                .any(|q| matches!(q.gate_type.as_str(), ENDPOINT_SCRAPE | "composite"))
    }

    /// What the Prometheus behind `--prometheus-url` must hold for the gates to read the pools'
    /// load, as comment lines (empty when no gate reads Prometheus).
    pub fn prometheus_requirements(&self) -> Vec<String> {
        if !self.needs_prometheus() {
            return Vec::new();
        }
        let mut lines = vec![
            "# PROMETHEUS_URL: the Prometheus the gates query. Without the series below the gate's budget is".to_owned(),
            "# its fallback, 0: nothing is sent. For each pool P it must hold:".to_owned(),
            "#   vllm:num_requests_running{inference_pool=\"P\"}, from every model server of P (label the".to_owned(),
            "#     scraped series, e.g. a relabel rule from the pod's pool label);".to_owned(),
            "#   inference_pool_ready_pods{name=\"P\"}: the endpoint picker's metric; without one, a recording rule:".to_owned(),
            "#     - record: inference_pool_ready_pods".to_owned(),
            "#       expr: label_replace(count by (inference_pool) (up{inference_pool!=\"\"} == 1), \"name\", \"$1\", \"inference_pool\", \"(.*)\")".to_owned(),
            format!(
                "#   scraped at least every {} (the gate's cache): an older reading opens the gate on load that has passed.",
                self.sizing.prometheus_cache_ttl
            ),
        ];
        lines.push(format!(
            "# Pools: {}.",
            self.pools
                .iter()
                .map(|p| p.pool.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
        lines
    }

    /// The command that starts a v0.9 dispatcher (`--redis.ss.*` flags, which later releases
    /// still take) with the queues file at `queues_file`: every flag the printed configuration
    /// needs. Secrets stay in the environment: `$REDIS_URL`, and `$PROMETHEUS_URL` when a gate
    /// reads Prometheus.
    pub fn command_v0_9(&self, queues_file: &str) -> String {
        let mut line = format!(
            "llm-d-async --message-queue-impl=redis-sortedset --redis.url \"$REDIS_URL\" --redis.ss.queues-config-file {}",
            shell_word(queues_file)
        );
        if let Some(list) = &self.result_queue_name {
            line.push_str(&format!(
                " --redis.ss.result-queue-name {}",
                shell_word(list)
            ));
        }
        line.push_str(&format!(
            " --redis.ss.poll-interval-ms {} --redis.ss.batch-size {}",
            self.sizing.poll_interval_ms, self.sizing.batch_size
        ));
        self.push_pacing(&mut line);
        line
    }

    /// The command that starts a v0.10 dispatcher with the transport config at
    /// `transport_file` (which must have its `url` added), every flag it needs.
    pub fn command_v0_10(&self, transport_file: &str) -> String {
        let mut line = format!(
            "llm-d-async --transport redis-sortedset --transport-config-file {}",
            shell_word(transport_file)
        );
        self.push_pacing(&mut line);
        line
    }

    /// The flags both versions take: the workers, and the Prometheus the gates read.
    fn push_pacing(&self, line: &mut String) {
        line.push_str(&format!(" --concurrency {}", self.sizing.concurrency));
        if self.needs_prometheus() {
            line.push_str(" --prometheus-url \"$PROMETHEUS_URL\"");
        }
        if self.reads_load() {
            line.push_str(&format!(
                " --prometheus-cache-ttl {}",
                self.sizing.prometheus_cache_ttl
            ));
        }
    }

    /// The v0.10 transport config with the dispatcher's defaults and these queue entries.
    pub fn transport_config(&self) -> DispatcherTransportConfig {
        DispatcherTransportConfig {
            retry_queue_name: DISPATCHER_RETRY_QUEUE.to_owned(),
            result_queue_name: self.result_queue_name.clone(),
            poll_interval_ms: self.sizing.poll_interval_ms,
            batch_size: self.sizing.batch_size,
            enable_tracing: false,
            queues: self.queues_config.clone(),
        }
    }
}

impl ProcessorConfig {
    /// Pool → the models routed to it (sorted), for every model that names a pool.
    pub fn pools(&self) -> BTreeMap<String, Vec<String>> {
        let mut pools: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (model, gateway) in &self.model_gateways {
            if let Some(pool) = &gateway.inference_pool_name {
                pools.entry(pool.clone()).or_default().push(model.clone());
            }
        }
        pools
    }

    /// The queue naming of this replica, from `async_dispatch.queue_prefix` and `consumer_id`.
    ///
    /// A loaded config has valid names; if the fields were later edited to invalid ones this falls
    /// back to the defaults. Use [`ProcessorConfig::try_queue_names`] to get the error instead.
    pub fn queue_names(&self) -> QueueNames {
        self.try_queue_names().unwrap_or_default()
    }

    /// Like [`ProcessorConfig::queue_names`], but reports invalid names.
    pub fn try_queue_names(&self) -> Result<QueueNames, NameError> {
        QueueNames::new(
            self.async_dispatch.queue_prefix.clone(),
            self.async_dispatch.consumer_id.clone(),
        )
    }

    /// The dispatcher's queue entries and result-list flag for every pool.
    ///
    /// Each entry's `igw_base_url` is the `url` of the pool's first model (by name) that has one,
    /// else [`PLACEHOLDER_GATEWAY_URL`].
    pub fn dispatcher_queues(&self) -> Result<DispatcherQueues, NameError> {
        let names = self.try_queue_names()?;
        let settings = &self.async_dispatch.dispatcher;
        let pool_names: Vec<String> = self.pools().into_keys().collect();
        let sizing = settings.sizing(&pool_names);
        let mut pools = Vec::new();
        let mut queues_config = Vec::new();
        for (pool, models) in self.pools() {
            let request_queue_name = names.request_queue_name(&pool)?;
            let igw_base_url = models
                .iter()
                .find_map(|model| self.model_gateways.get(model)?.url.as_deref())
                .map_or(PLACEHOLDER_GATEWAY_URL, |url| url.trim_end_matches('/'))
                .to_owned();
            // `sizing` was made for these very pools: every one of them is in it.
            let pool_sizing = sizing
                .pools
                .get(&pool)
                .cloned()
                .unwrap_or_else(|| settings.pool_sizing(settings.pools.get(&pool)));
            let (gate_type, gate_params) = sizing.gate(&pool, &pool_sizing);
            queues_config.push(DispatcherQueueEntry {
                queue_name: request_queue_name.clone(),
                igw_base_url,
                request_path_url: DISPATCHER_REQUEST_PATH.to_owned(),
                gate_type,
                gate_params,
            });
            pools.push(PoolQueues {
                result_queue_name: names.result_queue_name(&pool)?,
                request_queue_name,
                models,
                pool,
            });
        }
        let result_queue_name = pools.first().map(|p| p.result_queue_name.clone());
        Ok(DispatcherQueues {
            pools,
            queues_config,
            result_queue_name,
            sizing,
        })
    }
}

/// `word` quoted for a POSIX shell when it holds anything but plain characters (a result list
/// name holds `$`).
fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./:=@%+,".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::shell_word;

    #[test]
    fn shell_words_are_quoted_only_when_needed() {
        assert_eq!(shell_word("queues.json"), "queues.json");
        assert_eq!(
            shell_word("llm-d-async:results:pool-a:$batch"),
            "'llm-d-async:results:pool-a:$batch'"
        );
        assert_eq!(shell_word("it's here"), r"'it'\''s here'");
        assert_eq!(shell_word(""), "''");
    }
}
