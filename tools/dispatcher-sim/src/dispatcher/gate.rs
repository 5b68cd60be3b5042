//! Dispatch gates: each yields a budget in [0, 1], and `floor(batch_size × budget)` messages are
//! taken per poll; then, in the poller, each message taken is put to the gate ([`Gate::apply`]):
//! a budget gate whose budget reads 0 again refuses it, a `local-max-concurrency` gate refuses
//! it once its slots are taken.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fred::prelude::{Client as RedisClient, KeysInterface};
use http_body_util::BodyExt;
use hyper::Uri;

use super::config::{QueueEntry, DEFAULT_BUDGET_KEY};
use crate::GatewayLoad;
use crate::{GatewayHandle, SimError};

/// The gate types the simulator implements.
pub const GATE_TYPES: [&str; 6] = [
    "constant",
    "redis",
    "prometheus-budget",
    "endpoint-scrape",
    "composite",
    "local-max-concurrency",
];

/// Gate types the real dispatcher knows but the simulator does not model: refused at start
/// rather than silently opened. Any other name opens the gate, as the real factory does.
const REAL_UNSIMULATED: [&str; 5] = [
    "wait-on-refuse",
    "tier-priority-admission",
    "redis-quota",
    "prometheus-saturation",
    "prometheus-query",
];

/// What a gate says about one message taken from its queue.
pub enum Verdict {
    /// Send it; the release (if any) frees the gate's slot once its result or retry is written.
    Continue(Option<GateRelease>),
    /// Put it back into its queue at its deadline score.
    Refuse,
}

/// A slot of a `local-max-concurrency` gate, freed when dropped.
pub struct GateRelease(Arc<AtomicUsize>);

impl Drop for GateRelease {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A queue's gate.
pub enum Gate {
    /// A fixed budget.
    Constant(f64),
    /// A budget read as a float from a Redis key.
    Redis {
        /// The key.
        key: String,
        /// With `address` (which the real factory requires) a missing or unreadable budget
        /// reads as 1, as the real gate reads it. Without it, the simulator's older reading
        /// (missing = 0) stays for configurations written before this was observed.
        missing_open: bool,
    },
    /// At most `limit` messages between being taken and their result (or retry) written.
    LocalMaxConcurrency {
        /// `limit`.
        limit: usize,
        /// Slots taken now.
        in_flight: Arc<AtomicUsize>,
    },
    /// The least budget of several gates; a message goes only if each of them lets it.
    Composite(Vec<Gate>),
    /// `max(0, 1 − in_flight / max_concurrency − baseline)` of a gateway; also the
    /// `endpoint-scrape` gate, whose `max_count_per_pod` is the `max_concurrency`.
    PrometheusBudget {
        /// Where the in-flight count comes from.
        load: LoadSource,
        /// `max_concurrency` (default 100).
        max_concurrency: f64,
        /// `baseline` (default 0.05): capacity kept for online traffic.
        baseline: f64,
        /// The budget when the load cannot be read (default 0: closed).
        fallback: f64,
    },
}

/// Where a `prometheus-budget` gate reads the load, and how long a reading is reused.
///
/// The real gate sums `vllm:num_requests_running` of the pool through Prometheus, and reuses a
/// reading for `--prometheus-cache-ttl` (5 s unless set): it sees requests *running* (never more
/// than a pod's `max_num_seqs`, never the waiting queue) and sees them late. Both are kept here,
/// so the bursts and the late closing show as they do on the real stack.
pub struct LoadSource {
    reader: LoadReader,
    ttl: Duration,
    last: Mutex<Option<(Instant, Option<f64>)>>,
}

/// Where a reading comes from.
pub enum LoadReader {
    /// The embedded gateway, in process: its running requests ([`GatewayLoad::running`]).
    Embedded(GatewayLoad),
    /// A metrics page: the sum of its `vllm:num_requests_running` samples when it has them
    /// (a vLLM-mode simulator or a model server), else a simulator gateway's
    /// `gateway_in_flight_requests`.
    Scrape(Uri),
    /// A metrics page's samples of one metric, summed (the `endpoint-scrape` gate).
    Metric(Uri, String),
}

/// The real dispatcher's `--prometheus-cache-ttl` default.
pub const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(5);

impl LoadSource {
    fn new(reader: LoadReader) -> Self {
        LoadSource {
            reader,
            ttl: DEFAULT_CACHE_TTL,
            last: Mutex::new(None),
        }
    }

    async fn in_flight(&self, http: &crate::http::Client) -> Option<f64> {
        let cached = *self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, value)) = cached {
            if at.elapsed() < self.ttl {
                return value;
            }
        }
        let value = match &self.reader {
            LoadReader::Embedded(g) => Some(g.running() as f64),
            LoadReader::Scrape(uri) => scrape_running(http, uri, None).await,
            LoadReader::Metric(uri, name) => scrape_running(http, uri, Some(name)).await,
        };
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), value));
        value
    }
}

fn param_f64(
    queue: &str,
    params: &BTreeMap<String, String>,
    name: &str,
    default: f64,
) -> Result<f64, SimError> {
    match params.get(name) {
        None => Ok(default),
        Some(raw) => raw
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite())
            .ok_or_else(|| {
                SimError::Config(format!(
                    "queue {queue}: gate_params.{name} must be a number, got {raw:?}"
                ))
            }),
    }
}

/// The gate configurations of a composite gate's `gates` (a JSON array of `{gate_type,
/// gate_params}`; parameter values may be strings, numbers or booleans), as queue entries of
/// `queue`.
fn inner_gates(queue: &str, raw: &str) -> Result<Vec<QueueEntry>, SimError> {
    let bad = |why: String| {
        SimError::Config(format!(
            "queue {queue}: composite gate_params.gates is not a JSON array of gate configurations: {why}"
        ))
    };
    let list: Vec<serde_json::Value> = serde_json::from_str(raw).map_err(|e| bad(e.to_string()))?;
    list.into_iter()
        .map(|gate| {
            let mut entry = QueueEntry::new(queue);
            entry.gate_type = gate["gate_type"].as_str().map(str::to_owned);
            if let Some(params) = gate["gate_params"].as_object() {
                for (key, value) in params {
                    let text = match value {
                        serde_json::Value::String(s) => s.clone(),
                        serde_json::Value::Number(_) | serde_json::Value::Bool(_) => {
                            value.to_string()
                        }
                        other => return Err(bad(format!("gate_params.{key} is {other}"))),
                    };
                    entry.gate_params.insert(key.clone(), text);
                }
            }
            Ok(entry)
        })
        .collect()
}

impl Gate {
    /// Builds the gate a queue entry asks for; an unknown type is an error naming it.
    ///
    /// `embedded` is the gateway serving this queue when it runs in process; otherwise a
    /// `prometheus-budget` gate reads `gate_params.metrics_url`, else `<base_url>/metrics`.
    pub fn from_entry(
        entry: &QueueEntry,
        embedded: Option<&GatewayHandle>,
        base_url: &str,
    ) -> Result<Self, SimError> {
        let queue = &entry.queue_name;
        let params = &entry.gate_params;
        let kind = entry.gate_type.as_deref().map(str::trim).unwrap_or("");
        match kind {
            "" => Ok(Gate::Constant(1.0)),
            // The real `constant` gate is always open: its params are not read.
            "constant" => Ok(Gate::Constant(1.0)),
            "redis" => Ok(Gate::Redis {
                key: params
                    .get("budget_key")
                    .filter(|k| !k.is_empty())
                    .cloned()
                    .unwrap_or_else(|| DEFAULT_BUDGET_KEY.to_owned()),
                missing_open: params.get("address").is_some_and(|a| !a.is_empty()),
            }),
            "local-max-concurrency" => {
                let limit = params
                    .get("limit")
                    .and_then(|l| l.trim().parse::<usize>().ok())
                    .filter(|l| *l > 0)
                    .ok_or_else(|| {
                        SimError::Config(format!(
                            "queue {queue}: local-max-concurrency needs an integer gate_params.limit > 0"
                        ))
                    })?;
                if params.get("gating_mode").is_some_and(|m| m == "blocking") {
                    return Err(SimError::Config(format!(
                        "queue {queue}: local-max-concurrency gating_mode blocking is not simulated"
                    )));
                }
                Ok(Gate::LocalMaxConcurrency {
                    limit,
                    in_flight: Arc::new(AtomicUsize::new(0)),
                })
            }
            "prometheus-budget" => {
                let reader = match (params.get("metrics_url"), embedded) {
                    (Some(url), _) => LoadReader::Scrape(url.parse().map_err(|e| {
                        SimError::Config(format!(
                            "queue {queue}: gate_params.metrics_url {url:?} is not a URL: {e}"
                        ))
                    })?),
                    (None, Some(gw)) => LoadReader::Embedded(gw.load()),
                    (None, None) => {
                        let url = format!("{base_url}/metrics");
                        LoadReader::Scrape(url.parse().map_err(|e| {
                            SimError::Config(format!("queue {queue}: {url:?} is not a URL: {e}"))
                        })?)
                    }
                };
                let load = LoadSource::new(reader);
                let max_concurrency = param_f64(queue, params, "max_concurrency", 100.0)?;
                if max_concurrency <= 0.0 {
                    return Err(SimError::Config(format!(
                        "queue {queue}: gate_params.max_concurrency must be > 0"
                    )));
                }
                Ok(Gate::PrometheusBudget {
                    load,
                    max_concurrency,
                    baseline: param_f64(queue, params, "baseline", 0.05)?,
                    fallback: param_f64(queue, params, "fallback", 0.0)?,
                })
            }
            "endpoint-scrape" => {
                for unsimulated in ["labels", "pods_url", "pods_metric", "pods_labels"] {
                    if params.contains_key(unsimulated) {
                        return Err(SimError::Config(format!(
                            "queue {queue}: endpoint-scrape gate_params.{unsimulated} is not simulated"
                        )));
                    }
                }
                let required = |name: &str| {
                    params.get(name).filter(|v| !v.is_empty()).ok_or_else(|| {
                        SimError::Config(format!(
                            "queue {queue}: endpoint-scrape gate requires gate_params.{name}"
                        ))
                    })
                };
                let url = required("url")?;
                let metric = required("metric")?.clone();
                let uri = url.parse().map_err(|e| {
                    SimError::Config(format!(
                        "queue {queue}: gate_params.url {url:?} is not a URL: {e}"
                    ))
                })?;
                // The real source divides by max_count_per_pod when it is above 0 (and clamps
                // the share to [0, 1]); at 0 the metric itself is the share.
                let max_count = param_f64(queue, params, "max_count_per_pod", 0.0)?;
                Ok(Gate::PrometheusBudget {
                    load: LoadSource::new(LoadReader::Metric(uri, metric)),
                    max_concurrency: if max_count > 0.0 { max_count } else { 1.0 },
                    baseline: param_f64(queue, params, "baseline", 0.0)?,
                    fallback: param_f64(queue, params, "fallback", 0.0)?,
                })
            }
            "composite" => {
                let raw = params.get("gates").filter(|g| !g.is_empty()).ok_or_else(|| {
                    SimError::Config(format!(
                        "queue {queue}: composite gate requires gate_params.gates, a JSON array of gate configurations"
                    ))
                })?;
                let inner = inner_gates(queue, raw)?;
                let mut gates = Vec::with_capacity(inner.len());
                for entry in inner {
                    let gate = Gate::from_entry(&entry, embedded, base_url)?;
                    if matches!(gate, Gate::LocalMaxConcurrency { .. }) {
                        return Err(SimError::Config(format!(
                            "queue {queue}: local-max-concurrency inside a composite gate is not simulated"
                        )));
                    }
                    gates.push(gate);
                }
                Ok(Gate::Composite(gates))
            }
            other if REAL_UNSIMULATED.contains(&other) => Err(SimError::Config(format!(
                "queue {queue}: gate type {other:?} is not simulated (the simulator knows {})",
                GATE_TYPES.join(", ")
            ))),
            other => {
                tracing::warn!(queue = %queue, gate_type = %other, "unknown gate type: the gate is open, as in the real dispatcher");
                Ok(Gate::Constant(1.0))
            }
        }
    }

    /// The current budget, clamped to [0, 1]. Errors close the gate (or use the fallback).
    pub async fn budget(&self, redis: &RedisClient, http: &crate::http::Client) -> f64 {
        let raw = match self {
            Gate::Constant(b) => *b,
            Gate::Redis { key, missing_open } => {
                match redis.get::<Option<String>, _>(key.as_str()).await {
                    Ok(None) => f64::from(u8::from(*missing_open)),
                    Ok(Some(v)) => v.trim().parse::<f64>().unwrap_or_else(|_| {
                        tracing::warn!(key = %key, value = %v, "gate budget is not a number");
                        f64::from(u8::from(*missing_open))
                    }),
                    Err(e) => {
                        tracing::warn!(key = %key, error = %e, "reading the gate budget failed; gate closed");
                        0.0
                    }
                }
            }
            Gate::PrometheusBudget {
                load,
                max_concurrency,
                baseline,
                fallback,
            } => match load.in_flight(http).await {
                Some(n) => 1.0 - n / max_concurrency - baseline,
                None => *fallback,
            },
            Gate::LocalMaxConcurrency { limit, in_flight } => {
                let used = in_flight.load(Ordering::SeqCst).min(*limit);
                (limit - used) as f64 / *limit as f64
            }
            Gate::Composite(gates) => {
                let mut least: f64 = 1.0;
                for gate in gates {
                    least = least.min(Box::pin(gate.budget(redis, http)).await);
                }
                least
            }
        };
        if raw.is_nan() {
            0.0
        } else {
            raw.clamp(0.0, 1.0)
        }
    }
}

impl Gate {
    /// The per-message decision, made in the poller right after the cancel check (as the real
    /// one does): budget gates refuse when their budget, read again, is 0; a
    /// `local-max-concurrency` gate refuses when its slots are all taken.
    pub async fn apply(&self, redis: &RedisClient, http: &crate::http::Client) -> Verdict {
        match self {
            Gate::LocalMaxConcurrency { limit, in_flight } => {
                let taken = in_flight.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    (n < *limit).then_some(n + 1)
                });
                match taken {
                    Ok(_) => Verdict::Continue(Some(GateRelease(in_flight.clone()))),
                    Err(_) => Verdict::Refuse,
                }
            }
            _ if self.budget(redis, http).await <= 0.0 => Verdict::Refuse,
            _ => Verdict::Continue(None),
        }
    }
}

impl Gate {
    /// This gate with its load readings reused for `ttl` (the dispatcher's
    /// `--prometheus-cache-ttl`; zero reads the load at every poll and message).
    pub fn with_cache_ttl(mut self, ttl: Duration) -> Self {
        self.set_cache_ttl(ttl);
        self
    }

    fn set_cache_ttl(&mut self, ttl: Duration) {
        match self {
            Gate::PrometheusBudget { load, .. } => load.ttl = ttl,
            Gate::Composite(gates) => gates.iter_mut().for_each(|g| g.set_cache_ttl(ttl)),
            _ => {}
        }
    }
}

async fn scrape_running(
    http: &crate::http::Client,
    uri: &Uri,
    metric: Option<&str>,
) -> Option<f64> {
    let fetch = async {
        let req = hyper::Request::get(uri.clone())
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .ok()?;
        let resp = http.request(req).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        let page = String::from_utf8_lossy(&body);
        match metric {
            Some(name) => crate::prom::sum_samples(&page, name),
            None => crate::prom::sum_samples(&page, "vllm:num_requests_running")
                .or_else(|| crate::prom::read_sample(&page, "gateway_in_flight_requests")),
        }
    };
    let value = tokio::time::timeout(Duration::from_secs(2), fetch)
        .await
        .ok()
        .flatten();
    if value.is_none() {
        tracing::warn!(%uri, "could not read the gateway load; using the gate's fallback");
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "http://127.0.0.1:1";

    fn entry(kind: &str, params: &[(&str, &str)]) -> QueueEntry {
        QueueEntry {
            gate_type: Some(kind.to_owned()),
            gate_params: params
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..QueueEntry::new("q")
        }
    }

    #[test]
    fn unknown_gate_types_open_the_gate_and_unsimulated_real_ones_are_named() {
        // The real factory falls back to an open gate for a name it does not know.
        assert!(matches!(
            Gate::from_entry(&entry("composite-ish", &[]), None, BASE),
            Ok(Gate::Constant(b)) if b == 1.0
        ));
        let err = Gate::from_entry(&entry("redis-quota", &[]), None, BASE)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("redis-quota"), "{err}");
    }

    #[test]
    fn the_constant_gate_is_always_open_whatever_its_params() {
        for params in [&[][..], &[("budget", "0.5")][..], &[("budget", "half")][..]] {
            assert!(matches!(
                Gate::from_entry(&entry("constant", params), None, BASE),
                Ok(Gate::Constant(b)) if b == 1.0
            ));
        }
        assert!(matches!(
            Gate::from_entry(&QueueEntry::new("q"), None, BASE),
            Ok(Gate::Constant(b)) if b == 1.0
        ));
    }

    #[test]
    fn a_redis_gate_with_an_address_reads_a_missing_budget_as_open() {
        assert!(matches!(
            Gate::from_entry(&entry("redis", &[("address", "127.0.0.1:6379")]), None, BASE),
            Ok(Gate::Redis { key, missing_open: true }) if key == "dispatch-gate-budget"
        ));
        assert!(matches!(
            Gate::from_entry(&entry("redis", &[]), None, BASE),
            Ok(Gate::Redis {
                missing_open: false,
                ..
            })
        ));
    }

    #[tokio::test]
    async fn local_max_concurrency_refuses_past_its_limit_until_a_slot_is_released() {
        let gate = Gate::from_entry(
            &entry("local-max-concurrency", &[("limit", "2")]),
            None,
            BASE,
        )
        .unwrap();
        assert!(Gate::from_entry(&entry("local-max-concurrency", &[]), None, BASE).is_err());
        // apply() of this gate touches neither Redis nor HTTP.
        let redis = fred::prelude::Builder::default_centralized()
            .build()
            .unwrap();
        let http = crate::http::client();
        let Verdict::Continue(Some(a)) = gate.apply(&redis, &http).await else {
            panic!("first slot refused")
        };
        assert_eq!(gate.budget(&redis, &http).await, 0.5);
        let Verdict::Continue(Some(_b)) = gate.apply(&redis, &http).await else {
            panic!("second slot refused")
        };
        assert!(matches!(gate.apply(&redis, &http).await, Verdict::Refuse));
        assert_eq!(gate.budget(&redis, &http).await, 0.0);
        drop(a);
        assert!(matches!(
            gate.apply(&redis, &http).await,
            Verdict::Continue(Some(_))
        ));
    }

    #[test]
    fn prometheus_budget_reads_the_queues_gateway_unless_told_otherwise() {
        let gate = Gate::from_entry(&entry("prometheus-budget", &[]), None, BASE).unwrap();
        assert!(
            matches!(gate, Gate::PrometheusBudget { load: LoadSource { reader: LoadReader::Scrape(ref uri), ttl, .. }, .. }
            if uri == "http://127.0.0.1:1/metrics" && ttl == DEFAULT_CACHE_TTL)
        );
        let gate = Gate::from_entry(
            &entry(
                "prometheus-budget",
                &[
                    ("metrics_url", "http://127.0.0.1:2/m"),
                    ("max_concurrency", "8"),
                ],
            ),
            None,
            BASE,
        )
        .unwrap();
        assert!(
            matches!(gate, Gate::PrometheusBudget { load: LoadSource { reader: LoadReader::Scrape(ref uri), .. }, max_concurrency, baseline, fallback }
            if uri == "http://127.0.0.1:2/m" && max_concurrency == 8.0 && baseline == 0.05 && fallback == 0.0)
        );
        let err = Gate::from_entry(
            &entry("prometheus-budget", &[("max_concurrency", "0")]),
            None,
            BASE,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("max_concurrency"), "{err}");
    }
}
