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
    /// Extra latency per output token (the answer's `completion_tokens`).
    #[serde(with = "crate::duration_serde")]
    pub latency_per_token: Duration,
    /// Prompt processing per prompt token (the request's words, as `usage.prompt_tokens`
    /// reports them), on top of `latency_fixed`: long prompts take longer, and the answer says
    /// why. Not in model-server or vLLM mode.
    #[serde(with = "crate::duration_serde")]
    pub latency_per_prompt_token: Duration,
    /// Answer lengths drawn per request from a lognormal of this median (tokens), independent
    /// of `max_tokens` as real answers stop early; reported in `usage.completion_tokens`.
    /// Without it an answer has `max_tokens` (or `max_completion_tokens`, or
    /// `default_max_tokens`) tokens.
    pub length_median: Option<u64>,
    /// The lognormal's sigma (of the natural log of the length); 0 gives the median always.
    pub length_sigma: f64,
    /// With `length_median`: the share of answers, in [0, 1], made `tail_factor` times longer.
    pub tail_share: f64,
    /// How much longer a tail answer is; at least 1.
    pub tail_factor: f64,
    /// Model-server mode, with `capacity` C and `queue_limit`: past C in flight the time per
    /// output token grows by `in_flight / C` (re-read every 16 tokens, as a server's running
    /// batch grows and shrinks: continuous batching) instead of the whole latency being
    /// stretched at admission. The fixed latency (prompt processing) is not stretched.
    pub batching: bool,
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
    /// Seeds the failure dice and the answer lengths so a run can be repeated; random when
    /// absent.
    pub seed: Option<u64>,
    /// Prompt prefixes each endpoint keeps cached (an LRU); 0 turns the prefix-cache model off.
    /// The prefix is the content of a chat request's first system message, else of its first
    /// message.
    pub prefix_cache_size: usize,
    /// Extra latency of a request whose prefix is not cached (only with `prefix_cache_size` > 0).
    #[serde(with = "crate::duration_serde")]
    pub prefix_miss_latency: Duration,
    /// Latency that varies per request for reasons its `usage` does not show (prompt length,
    /// cache hits, the pod it lands on): a factor drawn per request on its unloaded latency,
    /// the reported token counts unchanged. Not in model-server mode.
    pub unseen: Unseen,
    /// Pods behind one URL, as a gateway routing across pods of different speeds: one factor
    /// on the unloaded latency per pod; a request goes to the pod with the fewest in flight
    /// (the first among equals). `capacity` stays the whole gateway's (each pod's share when
    /// they fill evenly). Empty: one pod. Not in model-server or vLLM mode.
    pub pod_factors: Vec<f64>,
    /// The status of the answer past the capacity: 429 (with `Retry-After`), or 503 as some
    /// gateways say they are full.
    pub full_status: u16,
    /// vLLM mode: at most this many requests run at once (vLLM's `--max-num-seqs`); the rest
    /// wait in the server's queue, in arrival order (or by `priority` with
    /// `priority_scheduling`). A request's time is then its wait, plus `latency_fixed` (time to
    /// the first token), plus its tokens at `latency_per_token` each, both slowed by
    /// `itl_growth` as more run. The `/metrics` page shows vLLM's `vllm:num_requests_running` and
    /// `vllm:num_requests_waiting`. A chat request with `"stream": true` is answered as vLLM
    /// streams (`text/event-stream`): one `chat.completion.chunk` event per token, sent at its
    /// token's time (the first after the wait and `latency_fixed`, each next `latency_per_token`
    /// later, as slowed then), the usage event with `stream_options.include_usage`, then
    /// `data: [DONE]`. Not with `capacity`, `queue_limit` or `batching`.
    pub max_num_seqs: Option<usize>,
    /// vLLM mode: requests waiting past this many are refused with `full_status` at once (as a
    /// gateway in front of a full server does); unbounded when absent, as vLLM itself is.
    pub max_waiting: Option<usize>,
    /// vLLM mode: how much longer the first token and each next one take with `max_num_seqs`
    /// running than with one (0.5 = 50 % longer), growing linearly in between, as the batch
    /// shares the GPU: llm-d-inference-sim's `--time-factor-under-load` less 1.
    pub itl_growth: f64,
    /// vLLM mode: the waiting queue served by the request body's `priority` (lower first, 0
    /// when absent; vLLM's `--scheduling-policy priority`), arrival order among equals.
    /// Running requests are not preempted.
    pub priority_scheduling: bool,
    /// vLLM mode: the `model_name` label of the vLLM metrics.
    pub served_model_name: String,
}

/// A per-request latency factor the answer's `usage` does not show ([`GatewayConfig::unseen`]).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Unseen {
    /// Every request costs what its tokens say.
    #[default]
    None,
    /// A lognormal factor of median 1 and this sigma.
    Lognormal {
        /// The sigma of the factor's natural log.
        sigma: f64,
    },
    /// Two kinds of request, half each, of these factors.
    TwoKinds {
        /// One kind's factor.
        a: f64,
        /// The other's.
        b: f64,
    },
    /// This share of requests this many times longer.
    Tail {
        /// The share, in [0, 1].
        share: f64,
        /// How many times longer.
        factor: f64,
    },
}

impl Unseen {
    /// The factor of one request.
    pub fn factor(self, rng: &mut impl rand::Rng) -> f64 {
        match self {
            Unseen::None => 1.0,
            Unseen::Lognormal { sigma } => (sigma * standard_normal(rng)).exp(),
            Unseen::TwoKinds { a, b } => {
                if rng.random::<bool>() {
                    a
                } else {
                    b
                }
            }
            Unseen::Tail { share, factor } => {
                if rng.random::<f64>() < share {
                    factor
                } else {
                    1.0
                }
            }
        }
    }

    fn validate(self) -> Result<(), SimError> {
        let ok = match self {
            Unseen::None => true,
            Unseen::Lognormal { sigma } => sigma >= 0.0 && sigma.is_finite(),
            Unseen::TwoKinds { a, b } => a > 0.0 && b > 0.0 && a.is_finite() && b.is_finite(),
            Unseen::Tail { share, factor } => {
                (0.0..=1.0).contains(&share) && factor >= 1.0 && factor.is_finite()
            }
        };
        if ok {
            Ok(())
        } else {
            Err(SimError::Config(format!(
                "unseen: {self:?} is out of range (sigma ≥ 0, factors > 0, share in [0, 1], tail factor ≥ 1)"
            )))
        }
    }
}

/// One standard normal from two uniforms (Box-Muller): what the lognormal answer lengths and
/// latencies are drawn from, here and by the bench's inputs and online load.
pub fn standard_normal(rng: &mut impl rand::Rng) -> f64 {
    let (u1, u2): (f64, f64) = (rng.random(), rng.random());
    (-2.0 * (1.0 - u1).ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            latency_fixed: Duration::ZERO,
            latency_per_token: Duration::ZERO,
            latency_per_prompt_token: Duration::ZERO,
            length_median: None,
            length_sigma: 0.8,
            tail_share: 0.0,
            tail_factor: 20.0,
            batching: false,
            default_max_tokens: 16,
            capacity: None,
            queue_limit: None,
            failures: Vec::new(),
            retry_after_secs: 1,
            seed: None,
            prefix_cache_size: 0,
            prefix_miss_latency: Duration::ZERO,
            unseen: Unseen::None,
            pod_factors: Vec::new(),
            full_status: 429,
            max_num_seqs: None,
            max_waiting: None,
            itl_growth: 0.0,
            priority_scheduling: false,
            served_model_name: "sim-model".to_owned(),
        }
    }
}

impl GatewayConfig {
    /// Refuses rates outside [0, 1], a queue limit without a capacity or below it, and
    /// batching without a queue limit.
    pub fn validate(&self) -> Result<(), SimError> {
        if !(self.length_sigma >= 0.0 && self.length_sigma.is_finite()) {
            return Err(SimError::Config(format!(
                "length_sigma must be 0 or more, got {}",
                self.length_sigma
            )));
        }
        if !(0.0..=1.0).contains(&self.tail_share) {
            return Err(SimError::Config(format!(
                "tail_share must be within [0, 1], got {}",
                self.tail_share
            )));
        }
        if !(self.tail_factor >= 1.0 && self.tail_factor.is_finite()) {
            return Err(SimError::Config(format!(
                "tail_factor must be at least 1, got {}",
                self.tail_factor
            )));
        }
        if self.batching && self.queue_limit.is_none() {
            return Err(SimError::Config(
                "batching needs a capacity and a queue_limit".into(),
            ));
        }
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
        self.unseen.validate()?;
        if let Some(f) = self
            .pod_factors
            .iter()
            .find(|f| !(**f > 0.0 && f.is_finite()))
        {
            return Err(SimError::Config(format!(
                "pod_factors must all be above 0, got {f}"
            )));
        }
        let plain_only = !self.pod_factors.is_empty() || !self.latency_per_prompt_token.is_zero();
        if plain_only && (self.batching || self.max_num_seqs.is_some()) {
            return Err(SimError::Config(
                "pod_factors and latency_per_prompt_token do not go with batching or max_num_seqs"
                    .into(),
            ));
        }
        self.validate_vllm_mode()?;
        if !matches!(self.full_status, 429 | 503) {
            return Err(SimError::Config(format!(
                "full_status must be 429 or 503, got {}",
                self.full_status
            )));
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

    fn validate_vllm_mode(&self) -> Result<(), SimError> {
        if !(self.itl_growth >= 0.0 && self.itl_growth.is_finite()) {
            return Err(SimError::Config(format!(
                "itl_growth must be 0 or more, got {}",
                self.itl_growth
            )));
        }
        let Some(seqs) = self.max_num_seqs else {
            if self.max_waiting.is_some() || self.priority_scheduling {
                return Err(SimError::Config(
                    "max_waiting and priority_scheduling need max_num_seqs".into(),
                ));
            }
            return Ok(());
        };
        if seqs == 0 {
            return Err(SimError::Config("max_num_seqs must be at least 1".into()));
        }
        if self.capacity.is_some() || self.queue_limit.is_some() || self.batching {
            return Err(SimError::Config(
                "max_num_seqs (vLLM mode) does not go with capacity, queue_limit or batching"
                    .into(),
            ));
        }
        Ok(())
    }

    /// vLLM mode: how much longer an output token takes with `running` requests running.
    pub fn itl_stretch(&self, running: usize) -> f64 {
        match self.max_num_seqs {
            Some(seqs) if seqs > 1 => {
                let busy = running.saturating_sub(1).min(seqs - 1) as f64 / (seqs - 1) as f64;
                1.0 + self.itl_growth * busy
            }
            _ => 1.0,
        }
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
    /// included): by `in_flight / capacity` past the capacity, in queueing mode only (not in
    /// model-server mode, which stretches each token instead: [`Self::token_stretch`]).
    pub fn queued_latency(&self, latency: Duration, in_flight: usize) -> Duration {
        if self.batching {
            return latency;
        }
        latency.mul_f64(self.stretch(in_flight))
    }

    /// How much longer each output token takes with `in_flight` requests running, in
    /// model-server mode: `max(1, in_flight / capacity)`; 1 otherwise.
    pub fn token_stretch(&self, in_flight: usize) -> f64 {
        if self.batching {
            self.stretch(in_flight)
        } else {
            1.0
        }
    }

    fn stretch(&self, in_flight: usize) -> f64 {
        match (self.queue_limit, self.capacity) {
            (Some(_), Some(c)) if c > 0 && in_flight > c => in_flight as f64 / c as f64,
            _ => 1.0,
        }
    }

    /// An answer's length in tokens: drawn with `rng` when `length_median` is set (lognormal,
    /// and `tail_factor` times longer for a `tail_share` of answers), else `requested`.
    pub fn answer_tokens(&self, requested: u64, rng: &mut impl rand::Rng) -> u64 {
        let Some(median) = self.length_median else {
            return requested;
        };
        let mut tokens = median as f64 * (self.length_sigma * standard_normal(rng)).exp();
        if self.tail_share > 0.0 && rng.random::<f64>() < self.tail_share {
            tokens *= self.tail_factor;
        }
        (tokens.round() as u64).max(1)
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
    fn answer_lengths_are_lognormal_seeded_and_independent_of_max_tokens() {
        use rand::SeedableRng;
        let c = GatewayConfig {
            length_median: Some(40),
            ..GatewayConfig::default()
        };
        let draw = |c: &GatewayConfig, seed| {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            (0..20_000)
                .map(|_| c.answer_tokens(16, &mut rng))
                .collect::<Vec<u64>>()
        };
        let mut lengths = draw(&c, 7);
        assert_eq!(lengths, draw(&c, 7), "the same seed draws the same lengths");
        lengths.sort_unstable();
        let median = lengths[lengths.len() / 2];
        assert!((37..=43).contains(&median), "median {median}");
        // ln-sigma 0.8: the 84th percentile is e^0.8 = 2.2 times the median.
        let p84 = lengths[lengths.len() * 84 / 100] as f64;
        assert!((80.0..=98.0).contains(&p84), "84th percentile {p84}");
        assert!(lengths.iter().all(|&t| t >= 1));

        let tail = GatewayConfig {
            tail_share: 0.01,
            length_sigma: 0.0,
            ..c.clone()
        };
        let long = draw(&tail, 1).iter().filter(|&&t| t == 800).count();
        assert!((140..=260).contains(&long), "{long} of 20,000 are 20 × 40");
        assert_eq!(
            GatewayConfig::default().answer_tokens(16, &mut rand::rng()),
            16,
            "without a length model the answer has the requested length"
        );
        for bad in [
            GatewayConfig {
                tail_share: 1.5,
                ..c.clone()
            },
            GatewayConfig {
                tail_factor: 0.5,
                ..c.clone()
            },
            GatewayConfig {
                length_sigma: -1.0,
                ..c.clone()
            },
            GatewayConfig {
                batching: true,
                capacity: Some(4),
                ..c.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn batching_stretches_tokens_not_the_admission_latency() {
        let c = GatewayConfig {
            capacity: Some(4),
            queue_limit: Some(8),
            batching: true,
            ..GatewayConfig::default()
        };
        assert!(c.validate().is_ok());
        let l = Duration::from_millis(20);
        assert_eq!(c.queued_latency(l, 8), l);
        assert_eq!(c.token_stretch(2), 1.0);
        assert_eq!(c.token_stretch(6), 1.5);
        let queueing = GatewayConfig {
            batching: false,
            ..c.clone()
        };
        assert_eq!(queueing.token_stretch(8), 1.0);
        assert_eq!(queueing.queued_latency(l, 8), 2 * l);
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
