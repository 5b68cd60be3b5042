//! What the real llm-d-async dispatcher must be given so that both sides agree on queue names.

use std::collections::BTreeMap;

use batch_keys::{NameError, QueueNames};
use serde::Serialize;

use crate::types::ProcessorConfig;

/// `igw_base_url` of a pool none of whose models has a `url`: the operator must fill it in.
pub const PLACEHOLDER_GATEWAY_URL: &str = "http://CHANGE-ME";

/// The request path the dispatcher appends to `igw_base_url` (our batches are chat completions).
pub const DISPATCHER_REQUEST_PATH: &str = "/v1/chat/completions";

/// The gate our queue entries use, with the dispatcher's own defaults as parameters.
pub const DISPATCHER_GATE_TYPE: &str = "prometheus-budget";

/// The v0.10 dispatcher's retry sorted set (its default, shared by every queue).
pub const DISPATCHER_RETRY_QUEUE: &str = "retry-sortedset";

/// The v0.10 dispatcher's default poll interval, milliseconds.
pub const DISPATCHER_POLL_INTERVAL_MS: u64 = 1000;

/// The v0.10 dispatcher's default messages per poll.
pub const DISPATCHER_BATCH_SIZE: u64 = 10;

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
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DispatcherQueues {
    /// Every pool, sorted by name.
    pub pools: Vec<PoolQueues>,
    /// The `--redis.ss.queues-config-file` array, one entry per pool.
    pub queues_config: Vec<DispatcherQueueEntry>,
    /// The `--redis.ss.result-queue-name` value: the first pool's result list. Only the
    /// dispatcher's fallback for envelopes that name no result list; ours always name one.
    pub result_queue_name: Option<String>,
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
        self.push_prometheus(&mut line);
        line
    }

    /// The command that starts a v0.10 dispatcher with the transport config at
    /// `transport_file` (which must have its `url` added), every flag it needs.
    pub fn command_v0_10(&self, transport_file: &str) -> String {
        let mut line = format!(
            "llm-d-async --transport redis-sortedset --transport-config-file {}",
            shell_word(transport_file)
        );
        self.push_prometheus(&mut line);
        line
    }

    fn push_prometheus(&self, line: &mut String) {
        if self.needs_prometheus() {
            line.push_str(" --prometheus-url \"$PROMETHEUS_URL\"");
        }
    }

    /// The v0.10 transport config with the dispatcher's defaults and these queue entries.
    pub fn transport_config(&self) -> DispatcherTransportConfig {
        DispatcherTransportConfig {
            retry_queue_name: DISPATCHER_RETRY_QUEUE.to_owned(),
            result_queue_name: self.result_queue_name.clone(),
            poll_interval_ms: DISPATCHER_POLL_INTERVAL_MS,
            batch_size: DISPATCHER_BATCH_SIZE,
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
        let mut pools = Vec::new();
        let mut queues_config = Vec::new();
        for (pool, models) in self.pools() {
            let request_queue_name = names.request_queue_name(&pool)?;
            let igw_base_url = models
                .iter()
                .find_map(|model| self.model_gateways.get(model)?.url.as_deref())
                .map_or(PLACEHOLDER_GATEWAY_URL, |url| url.trim_end_matches('/'))
                .to_owned();
            let gate_params = BTreeMap::from([
                ("pool".to_owned(), pool.clone()),
                ("max_concurrency".to_owned(), "100".to_owned()),
                ("baseline".to_owned(), "0.05".to_owned()),
            ]);
            queues_config.push(DispatcherQueueEntry {
                queue_name: request_queue_name.clone(),
                igw_base_url,
                request_path_url: DISPATCHER_REQUEST_PATH.to_owned(),
                gate_type: DISPATCHER_GATE_TYPE.to_owned(),
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
