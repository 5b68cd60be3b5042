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
    /// `constant`, `redis`, `local-max-concurrency` or `prometheus-budget`; no gate (budget 1)
    /// when absent or of a type the real dispatcher does not know.
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

/// Which release of the real dispatcher to behave like.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DispatcherVersion {
    /// v0.9 ("M"): ZPOPMIN, expired messages dropped silently (unless
    /// [`SimOptions::expired`] says otherwise), no `request_token` in results; a crash loses
    /// what was in hand.
    V0_9,
    /// v0.10 ("N", contract §6): leased claims instead of ZPOPMIN, `DEADLINE_EXCEEDED` for
    /// expired messages, `request_token` in results; a crash loses nothing.
    #[default]
    V0_10,
}

impl FromStr for DispatcherVersion {
    type Err = SimError;

    fn from_str(s: &str) -> Result<Self, SimError> {
        match s.trim().trim_start_matches('v') {
            "0.9" => Ok(Self::V0_9),
            "0.10" => Ok(Self::V0_10),
            other => Err(SimError::Config(format!(
                "--dispatcher-version must be 0.9 or 0.10, got {other:?}"
            ))),
        }
    }
}

impl fmt::Display for DispatcherVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::V0_9 => "0.9",
            Self::V0_10 => "0.10",
        })
    }
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

/// The simulator's own switches; the defaults behave like the real dispatcher.
#[derive(Debug, Clone, PartialEq)]
pub struct SimOptions {
    /// v0.9 only: expired messages dropped (default) or answered with `DEADLINE_EXCEEDED`.
    /// v0.10 always answers them.
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
    /// v0.10: how long a claim is leased before the reclaimer may put it back (300 s), scaled
    /// by `time_scale`; capped at the deadline plus 5 minutes (scaled too).
    pub claim_lease: Duration,
    /// v0.10: how often the reclaimer looks for expired claims (15 s), scaled by `time_scale`.
    pub reclaim_interval: Duration,
}

impl SimOptions {
    /// `d` × `time_scale`, never below 10 ms so that no loop spins.
    pub fn scaled(&self, d: Duration) -> Duration {
        Duration::try_from_secs_f64(d.as_secs_f64() * self.time_scale)
            .unwrap_or(Duration::MAX)
            .max(Duration::from_millis(10))
    }
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
            claim_lease: Duration::from_secs(300),
            reclaim_interval: Duration::from_secs(15),
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
    /// `--prometheus-cache-ttl`: how long a `prometheus-budget` gate reuses a load reading
    /// (default 5 s, as the real one; zero reads it at every poll and message).
    pub prometheus_cache_ttl: Duration,
    /// `--request-timeout` (default 5 min).
    pub request_timeout: Duration,
    /// Serve the dispatcher's `/metrics` here when set.
    pub metrics_listen: Option<SocketAddr>,
    /// How long a graceful shutdown waits for requests in flight.
    pub shutdown_grace: Duration,
    /// Simulator switches.
    pub sim: SimOptions,
    /// The release to behave like (v0.10 by default).
    pub version: DispatcherVersion,
    /// v0.10: this instance's name in `{<queue>}:claim-owners`; random by default, so that
    /// two dispatchers never share one.
    pub instance_id: String,
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
            prometheus_cache_ttl: super::gate::DEFAULT_CACHE_TTL,
            request_timeout: Duration::from_secs(300),
            metrics_listen: None,
            shutdown_grace: Duration::from_secs(10),
            sim: SimOptions::default(),
            version: DispatcherVersion::default(),
            instance_id: random_instance_id(),
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
        if s.claim_lease.is_zero() {
            return bad("claim lease must be > 0".into());
        }
        if s.reclaim_interval.is_zero() {
            return bad("reclaim interval must be > 0".into());
        }
        if self.instance_id.is_empty() {
            return bad("the instance id is empty".into());
        }
        Ok(())
    }
}

/// `sim-<pid>-<random>`: unique per process and per dispatcher.
fn random_instance_id() -> String {
    format!("sim-{}-{:016x}", std::process::id(), rand::random::<u64>())
}

/// The v0.10 `--transport-config` object (or the file `--transport-config-file` names):
/// `{url, retry_queue_name, result_queue_name, poll_interval_ms, batch_size, enable_tracing,
/// queues}`. Absent fields keep the flags' (or the defaults') values; unknown ones are ignored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct TransportConfig {
    /// The Redis URL.
    #[serde(default)]
    pub url: Option<String>,
    /// The retry sorted set.
    #[serde(default)]
    pub retry_queue_name: Option<String>,
    /// The default result list.
    #[serde(default)]
    pub result_queue_name: Option<String>,
    /// The poll interval, milliseconds.
    #[serde(default)]
    pub poll_interval_ms: Option<u64>,
    /// Messages per poll at budget 1.
    #[serde(default)]
    pub batch_size: Option<usize>,
    /// Accepted and ignored: the simulator does not trace.
    #[serde(default)]
    pub enable_tracing: Option<bool>,
    /// The queue entries, as in the older queues-config array.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub queues: Vec<QueueEntry>,
}

fn null_as_empty<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<QueueEntry>, D::Error> {
    Ok(Option::<Vec<QueueEntry>>::deserialize(d)?.unwrap_or_default())
}

impl TransportConfig {
    /// Reads the JSON object.
    pub fn parse(json: &str) -> Result<Self, SimError> {
        if !json.trim_start().starts_with('{') {
            return Err(SimError::Config(
                "the transport config must be a JSON object".into(),
            ));
        }
        serde_json::from_str(json)
            .map_err(|e| SimError::Config(format!("the transport config is invalid: {e}")))
    }

    /// Writes the fields that are set into `config` (the queues only when some are listed).
    pub fn apply(&self, config: &mut DispatcherConfig) {
        if let Some(url) = &self.url {
            config.redis_url = url.clone();
        }
        if let Some(q) = &self.retry_queue_name {
            config.retry_queue = q.clone();
        }
        if let Some(q) = &self.result_queue_name {
            config.default_result_queue = q.clone();
        }
        if let Some(ms) = self.poll_interval_ms {
            config.poll_interval = Duration::from_millis(ms);
        }
        if let Some(n) = self.batch_size {
            config.batch_size = n;
        }
        if !self.queues.is_empty() {
            config.queues = self.queues.clone();
        }
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
        assert_eq!(c.version, DispatcherVersion::V0_10);
        assert_eq!(c.sim.claim_lease, Duration::from_secs(300));
        assert_eq!(c.sim.reclaim_interval, Duration::from_secs(15));
        let other = DispatcherConfig::new("redis://127.0.0.1:1", vec![QueueEntry::new("q")]);
        assert_ne!(c.instance_id, other.instance_id);
        c.validate().unwrap();
        assert_eq!(
            c.sim.scaled(Duration::from_secs(300)),
            Duration::from_secs(300)
        );
        let fast = SimOptions {
            time_scale: 0.01,
            ..SimOptions::default()
        };
        assert_eq!(
            fast.scaled(Duration::from_secs(300)),
            Duration::from_secs(3)
        );
        assert_eq!(fast.scaled(Duration::ZERO), Duration::from_millis(10));
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
        assert_eq!(
            "0.9".parse::<DispatcherVersion>().unwrap(),
            DispatcherVersion::V0_9
        );
        assert_eq!(
            "v0.10".parse::<DispatcherVersion>().unwrap(),
            DispatcherVersion::V0_10
        );
        assert!("0.11".parse::<DispatcherVersion>().is_err());
    }

    #[test]
    fn reads_the_transport_config_object() {
        let t = TransportConfig::parse(
            r#"{"url":"redis://127.0.0.1:7","retry_queue_name":"retries","result_queue_name":"res",
                "poll_interval_ms":250,"batch_size":20,"enable_tracing":true,"future":1,
                "queues":[{"queue_name":"q1","igw_base_url":"http://127.0.0.1:9"}]}"#,
        )
        .unwrap();
        let mut c = DispatcherConfig::new("redis://127.0.0.1:1", vec![]);
        t.apply(&mut c);
        assert_eq!(c.redis_url, "redis://127.0.0.1:7");
        assert_eq!(
            (c.retry_queue.as_str(), c.default_result_queue.as_str()),
            ("retries", "res")
        );
        assert_eq!(
            (c.poll_interval, c.batch_size),
            (Duration::from_millis(250), 20)
        );
        assert_eq!(c.queues[0].queue_name, "q1");
        let partial = TransportConfig::parse(r#"{"queues":null}"#).unwrap();
        let mut d = DispatcherConfig::new("redis://127.0.0.1:1", vec![QueueEntry::new("q")]);
        partial.apply(&mut d);
        assert_eq!(d.queues, vec![QueueEntry::new("q")]);
        assert_eq!(d.batch_size, 10);
        assert!(TransportConfig::parse(r#"[{"queue_name":"q"}]"#).is_err());
        assert!(TransportConfig::parse(r#"{"batch_size":"x"}"#).is_err());
    }
}
