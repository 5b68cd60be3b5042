//! The dispatcher's configuration: queue entries as the real dispatcher reads them, and the
//! simulator's own switches.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use serde::{de, Deserialize, Deserializer, Serialize};

use crate::SimError;

/// The result list used when neither the queue entry nor the envelope names one.
pub const DEFAULT_RESULT_QUEUE: &str = "result-list";

/// The shared sorted set holding requests waiting for a retry, scored by due time.
pub const DEFAULT_RETRY_QUEUE: &str = "retry-sortedset";

/// The Redis key the `redis` gate reads its budget from by default.
pub const DEFAULT_BUDGET_KEY: &str = "dispatch-gate-budget";

/// One element of the real dispatcher's queues-config JSON array.
///
/// Unknown fields are ignored (as Go's decoder does), `null` reads as absent, and `gate_params`
/// values may be strings, numbers or booleans.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueEntry {
    /// The request sorted set.
    pub queue_name: String,
    /// Where to POST; the embedded gateway when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub igw_base_url: Option<String>,
    /// The path appended to `igw_base_url` unless the message names an `endpoint`;
    /// `/v1/completions` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_path_url: Option<String>,
    /// Sent as `x-gateway-inference-objective` when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_objective: Option<String>,
    /// `constant`, `redis` or `prometheus-budget`; no gate (budget 1) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate_type: Option<String>,
    /// The gate's parameters.
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "lenient_map"
    )]
    pub gate_params: BTreeMap<String, String>,
    /// Where this queue's results go, overriding the envelope's `internal.result_queue_name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_queue_name: Option<String>,
    /// Free-form labels.
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "lenient_map"
    )]
    pub labels: BTreeMap<String, String>,
    /// The queue's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

impl QueueEntry {
    /// An entry for `queue_name` with every other field absent.
    pub fn new(queue_name: impl Into<String>) -> Self {
        Self {
            queue_name: queue_name.into(),
            ..Self::default()
        }
    }

    /// Reads a queues-config JSON array, as `--redis.ss.queues-config-file` holds.
    pub fn parse_list(json: &str) -> Result<Vec<QueueEntry>, SimError> {
        serde_json::from_str(json).map_err(|e| {
            SimError::Config(format!(
                "queues config is not a JSON array of queue entries: {e}"
            ))
        })
    }
}

/// Reads a string map whose values may be strings, numbers or booleans, and which may be `null`.
fn lenient_map<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    let raw: Option<BTreeMap<String, serde_json::Value>> = Option::deserialize(d)?;
    raw.unwrap_or_default()
        .into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => Ok((k, s)),
            serde_json::Value::Number(n) => Ok((k, n.to_string())),
            serde_json::Value::Bool(b) => Ok((k, b.to_string())),
            other => Err(de::Error::custom(format!(
                "value of {k:?} must be a string, number or boolean, got {other}"
            ))),
        })
        .collect()
}

/// What to do with a message whose deadline has passed when it is taken.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ExpiredPolicy {
    /// Drop it silently, no result (v0.9, "M").
    #[default]
    Drop,
    /// Write a `DEADLINE_EXCEEDED` result (v0.10+, "N").
    Result,
}

impl FromStr for ExpiredPolicy {
    type Err = SimError;

    fn from_str(s: &str) -> Result<Self, SimError> {
        match s {
            "drop" => Ok(Self::Drop),
            "result" => Ok(Self::Result),
            other => Err(SimError::Config(format!(
                "--sim.expired must be drop or result, got {other:?}"
            ))),
        }
    }
}

impl fmt::Display for ExpiredPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Drop => "drop",
            Self::Result => "result",
        })
    }
}

/// The simulator's own switches; the defaults behave like the real v0.9 dispatcher.
#[derive(Debug, Clone, PartialEq)]
pub struct SimOptions {
    /// Expired messages: dropped (default) or answered with `DEADLINE_EXCEEDED`.
    pub expired: ExpiredPolicy,
    /// Multiplies every retry backoff (including `Retry-After`), so tests need not wait seconds.
    pub time_scale: f64,
    /// Probability that a result is pushed twice.
    pub duplicate_rate: f64,
    /// Crash after taking this many messages from request queues, losing those in hand.
    pub crash_after: Option<u64>,
    /// Delay before each result is pushed.
    pub result_delay: Duration,
    /// Seeds the jitter and duplicate dice; random when absent.
    pub seed: Option<u64>,
}

impl Default for SimOptions {
    fn default() -> Self {
        Self {
            expired: ExpiredPolicy::Drop,
            time_scale: 1.0,
            duplicate_rate: 0.0,
            crash_after: None,
            result_delay: Duration::ZERO,
            seed: None,
        }
    }
}

/// Everything a [`crate::Dispatcher`] needs. Build with [`DispatcherConfig::new`] and adjust the
/// public fields.
#[derive(Debug, Clone, PartialEq)]
pub struct DispatcherConfig {
    /// A Redis URL in any form batch-redis takes (`redis://`, `rediss://`, `redis-cluster://`,
    /// `redis-sentinel://`, …).
    pub redis_url: String,
    /// TLS settings for a `rediss…` URL (`--redis.tls-*`); `None`: the system's roots.
    pub redis_tls: Option<batch_redis::RedisTls>,
    /// The request queues to serve.
    pub queues: Vec<QueueEntry>,
    /// `--redis.ss.result-queue-name` (default `result-list`).
    pub default_result_queue: String,
    /// The retry sorted set (default `retry-sortedset`).
    pub retry_queue: String,
    /// `--redis.ss.poll-interval-ms` (default 1 s).
    pub poll_interval: Duration,
    /// `--redis.ss.batch-size`: messages per poll at budget 1 (default 10).
    pub batch_size: usize,
    /// `--concurrency`: HTTP workers (default 64).
    pub concurrency: usize,
    /// `--request-timeout` (default 5 min).
    pub request_timeout: Duration,
    /// Serve the dispatcher's `/metrics` here when set.
    pub metrics_listen: Option<SocketAddr>,
    /// How long a graceful shutdown waits for requests in flight.
    pub shutdown_grace: Duration,
    /// Simulator switches.
    pub sim: SimOptions,
}

impl DispatcherConfig {
    /// The real dispatcher's defaults for `redis_url` and `queues`.
    pub fn new(redis_url: impl Into<String>, queues: Vec<QueueEntry>) -> Self {
        Self {
            redis_url: redis_url.into(),
            redis_tls: None,
            queues,
            default_result_queue: DEFAULT_RESULT_QUEUE.to_owned(),
            retry_queue: DEFAULT_RETRY_QUEUE.to_owned(),
            poll_interval: Duration::from_secs(1),
            batch_size: 10,
            concurrency: 64,
            request_timeout: Duration::from_secs(300),
            metrics_listen: None,
            shutdown_grace: Duration::from_secs(10),
            sim: SimOptions::default(),
        }
    }

    /// Checks every field that has a forbidden value, naming it.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |m: String| Err(SimError::Config(m));
        if self.queues.is_empty() {
            return bad("at least one queue entry is required".into());
        }
        for (i, q) in self.queues.iter().enumerate() {
            if q.queue_name.trim().is_empty() {
                return bad(format!("queues[{i}].queue_name is empty"));
            }
        }
        if self.default_result_queue.is_empty() {
            return bad("the default result queue name is empty".into());
        }
        if self.retry_queue.is_empty() {
            return bad("the retry queue name is empty".into());
        }
        if self.poll_interval.is_zero() {
            return bad("poll interval must be > 0".into());
        }
        if self.batch_size == 0 {
            return bad("batch size must be > 0".into());
        }
        if self.concurrency == 0 {
            return bad("concurrency must be > 0".into());
        }
        if self.request_timeout.is_zero() {
            return bad("request timeout must be > 0".into());
        }
        let s = &self.sim;
        if !(s.time_scale.is_finite() && s.time_scale >= 0.0) {
            return bad(format!(
                "time scale must be a finite number >= 0, got {}",
                s.time_scale
            ));
        }
        if !(0.0..=1.0).contains(&s.duplicate_rate) {
            return bad(format!(
                "duplicate rate must be within [0, 1], got {}",
                s.duplicate_rate
            ));
        }
        if s.crash_after == Some(0) {
            return bad("crash-after must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_seed_example_and_tolerates_go_quirks() {
        let list = QueueEntry::parse_list(
            r#"[{"queue_name":"llm-d-async:requests:optimized-baseline",
                "igw_base_url":"http://llm-d-inference-gateway-istio:80",
                "request_path_url":"/v1/completions","gate_type":"prometheus-budget",
                "gate_params":{"pool":"optimized-baseline","max_concurrency":"100","baseline":0.05},
                "labels":null,"worker_pool_id":"default"}]"#,
        )
        .unwrap();
        let q = &list[0];
        assert_eq!(q.queue_name, "llm-d-async:requests:optimized-baseline");
        assert_eq!(q.gate_type.as_deref(), Some("prometheus-budget"));
        assert_eq!(q.gate_params["max_concurrency"], "100");
        assert_eq!(q.gate_params["baseline"], "0.05");
        assert!(q.labels.is_empty());
        assert!(QueueEntry::parse_list(r#"{"queue_name":"x"}"#).is_err());
        assert!(QueueEntry::parse_list(r#"[{"gate_params":{"a":[1]},"queue_name":"x"}]"#).is_err());
    }

    #[test]
    fn defaults_are_the_real_dispatchers() {
        let c = DispatcherConfig::new("redis://127.0.0.1:1", vec![QueueEntry::new("q")]);
        assert_eq!(c.default_result_queue, "result-list");
        assert_eq!(c.poll_interval, Duration::from_millis(1000));
        assert_eq!(c.batch_size, 10);
        assert_eq!(c.concurrency, 64);
        assert_eq!(c.request_timeout, Duration::from_secs(300));
        assert_eq!(c.sim.expired, ExpiredPolicy::Drop);
        c.validate().unwrap();
    }

    #[test]
    fn forbidden_values_are_named() {
        let base = DispatcherConfig::new("redis://127.0.0.1:1", vec![QueueEntry::new("q")]);
        let cases: Vec<(DispatcherConfig, &str)> = vec![
            (
                DispatcherConfig {
                    queues: vec![],
                    ..base.clone()
                },
                "queue entry",
            ),
            (
                DispatcherConfig {
                    queues: vec![QueueEntry::new(" ")],
                    ..base.clone()
                },
                "queues[0].queue_name",
            ),
            (
                DispatcherConfig {
                    batch_size: 0,
                    ..base.clone()
                },
                "batch size",
            ),
            (
                DispatcherConfig {
                    concurrency: 0,
                    ..base.clone()
                },
                "concurrency",
            ),
            (
                DispatcherConfig {
                    sim: SimOptions {
                        duplicate_rate: 2.0,
                        ..SimOptions::default()
                    },
                    ..base.clone()
                },
                "duplicate rate",
            ),
            (
                DispatcherConfig {
                    sim: SimOptions {
                        time_scale: f64::NAN,
                        ..SimOptions::default()
                    },
                    ..base.clone()
                },
                "time scale",
            ),
        ];
        for (config, needle) in cases {
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(needle), "{err} should name {needle}");
        }
        assert_eq!(
            "result".parse::<ExpiredPolicy>().unwrap(),
            ExpiredPolicy::Result
        );
        assert!("later".parse::<ExpiredPolicy>().is_err());
    }
}
