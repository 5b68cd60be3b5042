//! Sync dispatch: the processor calls the inference gateway itself, over HTTP(S).
//!
//! A [`SyncDispatcher`] is process-wide. Each [`dispatch`](SyncDispatcher::dispatch) takes the
//! endpoint's adaptive permit, then the one global permit, sends the request with the
//! reference processor's retry rules, feeds the final answer to that endpoint's AIMD
//! controller, and returns a [`SyncOutcome`]:
//!
//! - Retried: network errors, timeouts, 429 and 5xx (never other statuses), up to
//!   `max_retries`, with exponential backoff (×2, ±50 % jitter). A 429 without `Retry-After`
//!   waits 3 × the base; 502/503/504 cap at `max_backoff / 2`; `Retry-After` (seconds or HTTP
//!   date) is honoured up to `max_backoff`. A 429/503 with
//!   `x-llm-d-request-dropped-reason: rejected-ttl-expired` is final and becomes `batch_expired`.
//! - AIMD ([`Algorithm::Aimd`], the reference): a final 429 or 5xx, or any other answer that
//!   needed a 429/5xx retry, lowers the endpoint's limit; any other answer is a success; no
//!   answer is no signal. [`Algorithm::Gradient`] and [`Algorithm::Work`] hear every attempt
//!   instead (2xx latency and `usage.completion_tokens`, 429/5xx overload) and give the
//!   permits back while a request backs off.
//! - Load ([`EndpointOptions::load`]): the endpoint's limit follows the room the pool's model
//!   servers leave for online traffic, read from their metrics ([`load`]), the limiter taking
//!   over while no fresh reading is at hand; the body may carry a `priority` for servers
//!   that schedule by it.
//! - Headers: `Content-Type: application/json`, `X-Request-ID`, `x-slo-ttft-ms` (milliseconds
//!   left to the SLO), `Authorization: Bearer` and `x-gateway-inference-objective` when
//!   configured, and the job's pass-through headers (which cannot override these).
//!
//! ```no_run
//! use std::time::{Duration, SystemTime};
//! use batch_sync_dispatch::{EndpointOptions, LimitOptions, SyncDispatcher, SyncOutcome, SyncRequest};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), batch_sync_dispatch::DispatchError> {
//! let dispatcher = SyncDispatcher::new(LimitOptions::default());
//! dispatcher.add_endpoint("llama-3", EndpointOptions::new("http://127.0.0.1:8000"))?;
//!
//! let body = bytes::Bytes::from_static(br#"{"model":"llama-3","messages":[]}"#);
//! let outcome = dispatcher
//!     .dispatch("llama-3", SyncRequest {
//!         id: "batch_req_batch_abc_0",
//!         path: "/v1/chat/completions",
//!         body,
//!         slo_deadline: SystemTime::now() + Duration::from_secs(3600),
//!         headers: &[],
//!     })
//!     .await;
//! match outcome {
//!     SyncOutcome::Http { status, body } => println!("{status}: {} bytes", body.len()),
//!     SyncOutcome::Failed { code, message } => println!("{code}: {message}"),
//! }
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod client;
mod dispatcher;
pub mod load;
pub mod metrics;
mod options;
mod retry;

use std::time::SystemTime;

use bytes::Bytes;

pub use batch_limiter::Algorithm;
pub use client::{
    build as build_client, build_checked as build_checked_client, CheckedClient, CheckedResolver,
    HttpClient,
};
pub use dispatcher::SyncDispatcher;
pub use load::LoadOptions;
pub use options::{EndpointOptions, LimitOptions, TlsOptions};

/// One request to send.
#[derive(Debug, Clone)]
pub struct SyncRequest<'a> {
    /// Sent as `X-Request-ID`.
    pub id: &'a str,
    /// The input line's `url`, appended to the endpoint's base URL.
    pub path: &'a str,
    /// The body, sent byte for byte.
    pub body: Bytes,
    /// The job's SLO; `x-slo-ttft-ms` carries the milliseconds left at each attempt.
    pub slo_deadline: SystemTime,
    /// The job's pass-through headers.
    pub headers: &'a [(String, String)],
}

/// The final outcome of a dispatch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SyncOutcome {
    /// The gateway's last answer, any status.
    Http {
        /// The HTTP status.
        status: u16,
        /// The response body, as received.
        body: Bytes,
    },
    /// No usable HTTP answer; `code` is one of those listed on
    /// [`SyncDispatcher::dispatch`].
    Failed {
        /// Machine-readable code for the error line.
        code: String,
        /// What happened, for people.
        message: String,
    },
}

impl SyncOutcome {
    fn failed(code: &str, message: impl Into<String>) -> Self {
        SyncOutcome::Failed {
            code: code.to_owned(),
            message: message.into(),
        }
    }
}

/// Why an endpoint could not be added.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DispatchError {
    /// The process-wide limits are unusable.
    #[error("concurrency limits: {0}")]
    InvalidLimits(String),
    /// The endpoint's options are unusable.
    #[error("endpoint {endpoint}: {message}")]
    InvalidOptions {
        /// The endpoint's name.
        endpoint: String,
        /// What is wrong.
        message: String,
    },
    /// A TLS file could not be read or used.
    #[error("tls: {0}")]
    Tls(String),
    /// An endpoint with this name exists already.
    #[error("endpoint {0} is already configured")]
    DuplicateEndpoint(String),
}
