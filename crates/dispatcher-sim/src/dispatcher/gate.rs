//! Dispatch gates: each yields a budget in [0, 1]; `floor(batch_size × budget)` messages are
//! taken per poll, and a budget of 0 just before sending refuses the message.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use fred::prelude::{Client as RedisClient, KeysInterface};
use http_body_util::BodyExt;
use hyper::Uri;

use super::config::{QueueEntry, DEFAULT_BUDGET_KEY};
use crate::GatewayLoad;
use crate::{GatewayHandle, SimError};

/// The gate types the simulator implements.
pub const GATE_TYPES: [&str; 3] = ["constant", "redis", "prometheus-budget"];

/// A queue's gate.
pub enum Gate {
    /// A fixed budget.
    Constant(f64),
    /// A budget read as a float from a Redis key; a missing key is 0.
    Redis {
        /// The key.
        key: String,
    },
    /// `max(0, 1 − in_flight / max_concurrency − baseline)` of a gateway.
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

/// Where a `prometheus-budget` gate reads the load.
pub enum LoadSource {
    /// The embedded gateway, in process.
    Embedded(GatewayLoad),
    /// `gateway_in_flight_requests` of a simulator gateway's `/metrics` page, cached briefly
    /// because the gate is also asked before every send.
    Scrape {
        /// The page.
        uri: Uri,
        /// The last reading and when it was taken.
        last: Mutex<Option<(Instant, Option<f64>)>>,
    },
}

/// How long a scraped reading is reused.
const SCRAPE_TTL: Duration = Duration::from_millis(50);

impl LoadSource {
    fn scrape(uri: Uri) -> Self {
        LoadSource::Scrape {
            uri,
            last: Mutex::new(None),
        }
    }

    async fn in_flight(&self, http: &crate::http::Client) -> Option<f64> {
        match self {
            LoadSource::Embedded(g) => Some(g.in_flight() as f64),
            LoadSource::Scrape { uri, last } => {
                let cached = *last.lock().unwrap_or_else(|e| e.into_inner());
                if let Some((at, value)) = cached {
                    if at.elapsed() < SCRAPE_TTL {
                        return value;
                    }
                }
                let value = scrape_in_flight(http, uri).await;
                *last.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), value));
                value
            }
        }
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
            "constant" => Ok(Gate::Constant(param_f64(queue, params, "budget", 1.0)?)),
            "redis" => Ok(Gate::Redis {
                key: params
                    .get("budget_key")
                    .filter(|k| !k.is_empty())
                    .cloned()
                    .unwrap_or_else(|| DEFAULT_BUDGET_KEY.to_owned()),
            }),
            "prometheus-budget" => {
                let load = match (params.get("metrics_url"), embedded) {
                    (Some(url), _) => LoadSource::scrape(url.parse().map_err(|e| {
                        SimError::Config(format!(
                            "queue {queue}: gate_params.metrics_url {url:?} is not a URL: {e}"
                        ))
                    })?),
                    (None, Some(gw)) => LoadSource::Embedded(gw.load()),
                    (None, None) => {
                        let url = format!("{base_url}/metrics");
                        LoadSource::scrape(url.parse().map_err(|e| {
                            SimError::Config(format!("queue {queue}: {url:?} is not a URL: {e}"))
                        })?)
                    }
                };
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
            other => Err(SimError::Config(format!(
                "queue {queue}: unknown gate type {other:?} (the simulator knows {})",
                GATE_TYPES.join(", ")
            ))),
        }
    }

    /// The current budget, clamped to [0, 1]. Errors close the gate (or use the fallback).
    pub async fn budget(&self, redis: &RedisClient, http: &crate::http::Client) -> f64 {
        let raw = match self {
            Gate::Constant(b) => *b,
            Gate::Redis { key } => match redis.get::<Option<String>, _>(key.as_str()).await {
                Ok(None) => 0.0,
                Ok(Some(v)) => v.trim().parse::<f64>().unwrap_or_else(|_| {
                    tracing::warn!(key = %key, value = %v, "gate budget is not a number; gate closed");
                    0.0
                }),
                Err(e) => {
                    tracing::warn!(key = %key, error = %e, "reading the gate budget failed; gate closed");
                    0.0
                }
            },
            Gate::PrometheusBudget {
                load,
                max_concurrency,
                baseline,
                fallback,
            } => {
                match load.in_flight(http).await {
                    Some(n) => 1.0 - n / max_concurrency - baseline,
                    None => *fallback,
                }
            }
        };
        if raw.is_nan() {
            0.0
        } else {
            raw.clamp(0.0, 1.0)
        }
    }
}

async fn scrape_in_flight(http: &crate::http::Client, uri: &Uri) -> Option<f64> {
    let fetch = async {
        let req = hyper::Request::get(uri.clone())
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .ok()?;
        let resp = http.request(req).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        crate::prom::read_sample(
            &String::from_utf8_lossy(&body),
            "gateway_in_flight_requests",
        )
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
    fn unknown_gate_types_are_named() {
        let err = Gate::from_entry(&entry("composite-ish", &[]), None, BASE)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("composite-ish"), "{err}");
    }

    #[test]
    fn constant_and_redis_parameters() {
        assert!(
            matches!(Gate::from_entry(&entry("constant", &[]), None, BASE), Ok(Gate::Constant(b)) if b == 1.0)
        );
        assert!(matches!(
            Gate::from_entry(&entry("constant", &[("budget", "0.5")]), None, BASE),
            Ok(Gate::Constant(b)) if b == 0.5
        ));
        let err = Gate::from_entry(&entry("constant", &[("budget", "half")]), None, BASE)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("gate_params.budget"), "{err}");
        assert!(matches!(
            Gate::from_entry(&entry("redis", &[]), None, BASE),
            Ok(Gate::Redis { key }) if key == "dispatch-gate-budget"
        ));
        assert!(matches!(
            Gate::from_entry(&QueueEntry::new("q"), None, BASE),
            Ok(Gate::Constant(b)) if b == 1.0
        ));
    }

    #[test]
    fn prometheus_budget_reads_the_queues_gateway_unless_told_otherwise() {
        let gate = Gate::from_entry(&entry("prometheus-budget", &[]), None, BASE).unwrap();
        assert!(
            matches!(gate, Gate::PrometheusBudget { load: LoadSource::Scrape { ref uri, .. }, .. }
            if uri == "http://127.0.0.1:1/metrics")
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
            matches!(gate, Gate::PrometheusBudget { load: LoadSource::Scrape { ref uri, .. }, max_concurrency, baseline, fallback }
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
