//! The gateway's run-time configuration: latency model, prefix cache, capacity and failure
//! injection.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::SimError;

/// How the simulated gateway behaves; the body of `POST /admin/config`.
///
/// Every field has a default, so a JSON object naming only some fields is valid. The default is
/// a perfect gateway: no latency, no capacity limit, no failures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// Latency of every inference reply.
    #[serde(with = "crate::duration_serde")]
    pub latency_fixed: Duration,
    /// Extra latency per output token (`max_tokens` or `max_completion_tokens`).
    #[serde(with = "crate::duration_serde")]
    pub latency_per_token: Duration,
    /// Output tokens assumed when a request names none.
    pub default_max_tokens: u64,
    /// At most this many inference requests at once; more get 429 with `Retry-After` (unless
    /// `queue_limit` is set).
    pub capacity: Option<usize>,
    /// Queueing mode, with `capacity` C: up to this many requests at once are admitted, and
    /// one admitted with n in flight (itself included) takes `latency × max(1, n / C)`, as a
    /// model server sharing its batch does past its knee (so throughput stays at most C per
    /// latency). Only past this limit the answer is 429. At least C.
    pub queue_limit: Option<usize>,
    /// Failure injection rules, tried in order; the first that fires decides the reply.
    pub failures: Vec<FailureRule>,
    /// The `Retry-After` value (seconds) of every 429 the gateway sends.
    pub retry_after_secs: u64,
    /// Seeds the failure dice so a run can be repeated; random when absent.
    pub seed: Option<u64>,
    /// Prompt prefixes each endpoint keeps cached (an LRU); 0 turns the prefix-cache model off.
    /// The prefix is the content of a chat request's first system message, else of its first
    /// message.
    pub prefix_cache_size: usize,
    /// Extra latency of a request whose prefix is not cached (only with `prefix_cache_size` > 0).
    #[serde(with = "crate::duration_serde")]
    pub prefix_miss_latency: Duration,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            latency_fixed: Duration::ZERO,
            latency_per_token: Duration::ZERO,
            default_max_tokens: 16,
            capacity: None,
            queue_limit: None,
            failures: Vec::new(),
            retry_after_secs: 1,
            seed: None,
            prefix_cache_size: 0,
            prefix_miss_latency: Duration::ZERO,
        }
    }
}

impl GatewayConfig {
    /// Refuses rates outside [0, 1], and a queue limit without a capacity or below it.
    pub fn validate(&self) -> Result<(), SimError> {
        if let Some(q) = self.queue_limit {
            match self.capacity {
                None => {
                    return Err(SimError::Config(format!(
                        "queue_limit ({q}) needs a capacity"
                    )))
                }
                Some(c) if q < c => {
                    return Err(SimError::Config(format!(
                        "queue_limit ({q}) must be at least capacity ({c})"
                    )))
                }
                Some(_) => {}
            }
        }
        for (i, rule) in self.failures.iter().enumerate() {
            if !(0.0..=1.0).contains(&rule.rate) {
                return Err(SimError::Config(format!(
                    "failures[{i}].rate must be within [0, 1], got {}",
                    rule.rate
                )));
            }
        }
        Ok(())
    }

    /// The latency of a reply with `tokens` output tokens.
    pub fn latency(&self, tokens: u64) -> Duration {
        let per_token = self
            .latency_per_token
            .checked_mul(u32::try_from(tokens).unwrap_or(u32::MAX))
            .unwrap_or(Duration::MAX);
        self.latency_fixed.saturating_add(per_token)
    }

    /// Admissions allowed at once: `queue_limit` in queueing mode, else `capacity`.
    pub fn admission_limit(&self) -> Option<usize> {
        self.queue_limit.or(self.capacity)
    }

    /// `latency` stretched for a request admitted with `in_flight` requests (itself
    /// included): by `in_flight / capacity` past the capacity, in queueing mode only.
    pub fn queued_latency(&self, latency: Duration, in_flight: usize) -> Duration {
        match (self.queue_limit, self.capacity) {
            (Some(_), Some(c)) if c > 0 && in_flight > c => {
                latency.mul_f64(in_flight as f64 / c as f64)
            }
            _ => latency,
        }
    }
}

/// One failure injection rule: with probability `rate`, reply with `kind`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailureRule {
    /// What the failure looks like.
    pub kind: FailureKind,
    /// Probability per request, in [0, 1].
    #[serde(default = "one")]
    pub rate: f64,
    /// Fire at most this many times (then the rule is spent); unlimited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    /// Only requests to this path (e.g. `/v1/embeddings`); all when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

fn one() -> f64 {
    1.0
}

impl FailureRule {
    /// A rule firing with probability `rate` on every path, without limit.
    pub fn new(kind: FailureKind, rate: f64) -> Self {
        Self {
            kind,
            rate,
            limit: None,
            path: None,
        }
    }

    /// Fires at most `n` times.
    pub fn limit(mut self, n: u64) -> Self {
        self.limit = Some(n);
        self
    }
}

/// `KIND:RATE[:LIMIT]`, e.g. `429:0.1`, `reset:1:3`, `ttl-expired:0.5`.
impl FromStr for FailureRule {
    type Err = SimError;

    fn from_str(s: &str) -> Result<Self, SimError> {
        let bad = |why: &str| {
            SimError::Config(format!(
                "failure rule {s:?}: {why} (expected KIND:RATE[:LIMIT], KIND one of {})",
                FailureKind::NAMES.join(", ")
            ))
        };
        let mut parts = s.split(':');
        let kind = parts.next().unwrap_or_default().parse::<FailureKind>()?;
        let rate = match parts.next() {
            Some(r) => r.trim().parse::<f64>().map_err(|_| bad("bad rate"))?,
            None => 1.0,
        };
        let limit = match parts.next() {
            Some(l) => Some(l.trim().parse::<u64>().map_err(|_| bad("bad limit"))?),
            None => None,
        };
        if parts.next().is_some() {
            return Err(bad("too many parts"));
        }
        if !(0.0..=1.0).contains(&rate) {
            return Err(bad("rate must be within [0, 1]"));
        }
        Ok(Self {
            kind,
            rate,
            limit,
            path: None,
        })
    }
}

/// The kinds of failure the gateway can inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FailureKind {
    /// 429 Too Many Requests with `Retry-After`.
    #[serde(rename = "429")]
    Status429,
    /// 500 Internal Server Error.
    #[serde(rename = "500")]
    Status500,
    /// 503 Service Unavailable.
    #[serde(rename = "503")]
    Status503,
    /// 400 Bad Request.
    #[serde(rename = "400")]
    Status400,
    /// 429 with `x-llm-d-request-dropped-reason: rejected-ttl-expired`, as the EPP sends when a
    /// request's TTL ran out in its queue.
    #[serde(rename = "ttl-expired")]
    TtlExpired,
    /// No reply: the TCP connection is reset.
    #[serde(rename = "connection-reset")]
    ConnectionReset,
}

impl FailureKind {
    const NAMES: [&'static str; 6] = [
        "429",
        "500",
        "503",
        "400",
        "ttl-expired",
        "connection-reset",
    ];

    /// The name used in JSON and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Status429 => "429",
            Self::Status500 => "500",
            Self::Status503 => "503",
            Self::Status400 => "400",
            Self::TtlExpired => "ttl-expired",
            Self::ConnectionReset => "connection-reset",
        }
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for FailureKind {
    type Err = SimError;

    fn from_str(s: &str) -> Result<Self, SimError> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "429" => Self::Status429,
            "500" => Self::Status500,
            "503" => Self::Status503,
            "400" => Self::Status400,
            "ttl-expired" | "ttl" => Self::TtlExpired,
            "connection-reset" | "reset" => Self::ConnectionReset,
            other => {
                return Err(SimError::Config(format!(
                    "unknown failure kind {other:?}; use one of {}",
                    Self::NAMES.join(", ")
                )))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_json_keeps_defaults_and_typos_are_refused() {
        let c: GatewayConfig = serde_json::from_str(
            r#"{"latency_fixed":"20ms","capacity":4,"failures":[{"kind":"503","rate":0.5,"limit":2}]}"#,
        )
        .unwrap();
        assert_eq!(c.latency_fixed, Duration::from_millis(20));
        assert_eq!(c.capacity, Some(4));
        assert_eq!(c.retry_after_secs, 1);
        assert_eq!(c.prefix_cache_size, 0, "the prefix cache is off by default");
        let p: GatewayConfig =
            serde_json::from_str(r#"{"prefix_cache_size":4,"prefix_miss_latency":"50ms"}"#)
                .unwrap();
        assert_eq!(
            (p.prefix_cache_size, p.prefix_miss_latency),
            (4, Duration::from_millis(50))
        );
        assert_eq!(
            c.failures,
            vec![FailureRule::new(FailureKind::Status503, 0.5).limit(2)]
        );
        assert!(serde_json::from_str::<GatewayConfig>(r#"{"latency":"1s"}"#).is_err());
        let back: GatewayConfig =
            serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn latency_is_fixed_plus_per_token() {
        let c = GatewayConfig {
            latency_fixed: Duration::from_millis(20),
            latency_per_token: Duration::from_millis(1),
            ..GatewayConfig::default()
        };
        assert_eq!(c.latency(100), Duration::from_millis(120));
        assert_eq!(GatewayConfig::default().latency(u64::MAX), Duration::ZERO);
    }

    #[test]
    fn queueing_stretches_latency_past_the_capacity_only() {
        let c = GatewayConfig {
            capacity: Some(4),
            queue_limit: Some(8),
            ..GatewayConfig::default()
        };
        let l = Duration::from_millis(20);
        assert_eq!(c.queued_latency(l, 1), l);
        assert_eq!(c.queued_latency(l, 4), l);
        assert_eq!(c.queued_latency(l, 6), Duration::from_millis(30));
        assert_eq!(c.queued_latency(l, 8), 2 * l);
        assert_eq!(c.admission_limit(), Some(8));
        let hard = GatewayConfig {
            queue_limit: None,
            ..c.clone()
        };
        assert_eq!(hard.queued_latency(l, 8), l, "a hard limit never queues");
        assert_eq!(hard.admission_limit(), Some(4));
        for bad in [
            GatewayConfig {
                capacity: None,
                ..c.clone()
            },
            GatewayConfig {
                queue_limit: Some(3),
                ..c.clone()
            },
        ] {
            assert!(bad
                .validate()
                .unwrap_err()
                .to_string()
                .contains("queue_limit"));
        }
        assert!(c.validate().is_ok());
    }

    #[test]
    fn rules_parse_from_flags() {
        assert_eq!(
            "429:0.25".parse::<FailureRule>().unwrap(),
            FailureRule::new(FailureKind::Status429, 0.25)
        );
        assert_eq!(
            "reset:1:3".parse::<FailureRule>().unwrap(),
            FailureRule::new(FailureKind::ConnectionReset, 1.0).limit(3)
        );
        assert_eq!(
            "ttl-expired".parse::<FailureRule>().unwrap().kind,
            FailureKind::TtlExpired
        );
        for bad in ["418:0.5", "429:2", "429:x", "500:0.1:y", "500:0.1:1:2"] {
            assert!(bad.parse::<FailureRule>().is_err(), "{bad}");
        }
        let c = GatewayConfig {
            failures: vec![FailureRule::new(FailureKind::Status500, 1.5)],
            ..GatewayConfig::default()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("failures[0].rate"));
    }
}
