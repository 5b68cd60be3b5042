//! What the caller configures: one endpoint's HTTP behaviour, and the process-wide limits.

use std::fmt;
use std::time::Duration;

use batch_limiter::Algorithm;

use crate::{DispatchError, LoadOptions};

// TLS settings of an endpoint, those of its client: endpoints with equal settings share one
// connection pool.
pub use batch_http_client::TlsOptions;

/// How to talk to one inference gateway.
#[derive(Clone)]
pub struct EndpointOptions {
    /// `http://` or `https://` base; the input line's `url` is appended (`/v1/chat/completions`).
    pub base_url: String,
    /// Limit for one attempt: connect, send, and read the whole response. Must be above 0.
    pub request_timeout: Duration,
    /// Retries after the first attempt (0 = one attempt only).
    pub max_retries: u32,
    /// Backoff before the first retry; doubles on each further retry.
    pub initial_backoff: Duration,
    /// Cap of any backoff, `Retry-After` included.
    pub max_backoff: Duration,
    /// Sent as `Authorization: Bearer <key>`. Never printed.
    pub api_key: Option<String>,
    /// Sent as `x-gateway-inference-objective`.
    pub inference_objective: Option<String>,
    /// TLS settings for `https://` bases.
    pub tls: TlsOptions,
    /// Read the pool's load and leave online traffic its room ([`crate::load`]); the limiter
    /// alone when absent.
    pub load: Option<LoadOptions>,
}

impl EndpointOptions {
    /// Options for `base_url` with conservative defaults (the config crate sets the real ones):
    /// timeout 5 min, 3 retries, backoff 1 s up to 60 s, no key, no objective, system roots.
    pub fn new(base_url: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            request_timeout: Duration::from_secs(300),
            max_retries: 3,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
            api_key: None,
            inference_objective: None,
            tls: TlsOptions::default(),
            load: None,
        }
    }

    pub(crate) fn validate(&self, name: &str) -> Result<(), DispatchError> {
        let invalid = |message: String| DispatchError::InvalidOptions {
            endpoint: name.to_owned(),
            message,
        };
        if self.request_timeout.is_zero() {
            return Err(invalid("request_timeout must be above 0".into()));
        }
        if self.max_backoff < self.initial_backoff {
            return Err(invalid(format!(
                "max_backoff ({:?}) is below initial_backoff ({:?})",
                self.max_backoff, self.initial_backoff
            )));
        }
        if let Some(load) = &self.load {
            load.validate().map_err(invalid)?;
        }
        if self.tls.client_cert_file.is_some() != self.tls.client_key_file.is_some() {
            return Err(invalid(
                "tls: client_cert_file and client_key_file go together".into(),
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for EndpointOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EndpointOptions")
            .field("base_url", &self.base_url)
            .field("request_timeout", &self.request_timeout)
            .field("max_retries", &self.max_retries)
            .field("initial_backoff", &self.initial_backoff)
            .field("max_backoff", &self.max_backoff)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("inference_objective", &self.inference_objective)
            .field("tls", &self.tls)
            .field("load", &self.load)
            .finish()
    }
}

/// Process-wide concurrency limits (`concurrency.*` in the config).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LimitOptions {
    /// In-flight requests across all endpoints and jobs of the process.
    pub global: usize,
    /// Initial and maximum in-flight requests per endpoint.
    pub per_endpoint: usize,
    /// With `false` the per-endpoint limit stays at `per_endpoint`.
    pub aimd_enabled: bool,
    /// AIMD floor.
    pub aimd_min: usize,
    /// AIMD multiplicative decrease, in (0, 1).
    pub backoff_factor: f64,
    /// AIMD additive increase, at least 1 (the gradient limiter's first step).
    pub additive_increase: usize,
    /// Which limiter moves the per-endpoint limit (`concurrency.aimd.algorithm`).
    pub algorithm: Algorithm,
}

impl Default for LimitOptions {
    /// The reference processor's defaults: global 100, per endpoint 10, AIMD on, min 5,
    /// factor 0.5, increase 1, the reference algorithm.
    fn default() -> Self {
        Self {
            global: 100,
            per_endpoint: 10,
            aimd_enabled: true,
            aimd_min: 5,
            backoff_factor: 0.5,
            additive_increase: 1,
            algorithm: Algorithm::Aimd,
        }
    }
}

impl LimitOptions {
    pub(crate) fn aimd_config(&self) -> batch_limiter::AimdConfig {
        batch_limiter::AimdConfig {
            min: self.aimd_min,
            max: self.per_endpoint,
            backoff_factor: self.backoff_factor,
            additive_increase: self.additive_increase,
        }
    }

    /// Checks the limits: both above 0 and, with AIMD on, a valid AIMD config.
    pub fn validate(&self) -> Result<(), DispatchError> {
        let invalid = |message: String| DispatchError::InvalidLimits(message);
        if self.global == 0 {
            return Err(invalid("concurrency.global must be above 0".into()));
        }
        if self.per_endpoint == 0 {
            return Err(invalid("concurrency.per_endpoint must be above 0".into()));
        }
        if self.aimd_enabled {
            self.aimd_config()
                .validate()
                .map_err(|e| invalid(e.to_string()))?;
        }
        Ok(())
    }
}
