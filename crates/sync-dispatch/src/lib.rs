#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod client;
mod dispatcher;
pub mod load;
pub mod metrics;
mod options;
mod retry;

use std::time::SystemTime;

use bytes::Bytes;

pub use batch_limiter::{Algorithm, Flow};
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
    /// What the request shares the endpoint's limit as: its batch job (the flow), in its
    /// tenant's group or a group of its own. Of the groups waiting for the limit, the one that
    /// had the fewest permits lately gets the next (groups side by side take turns, one
    /// request each; a group that arrives beside a busy one goes first until it catches up),
    /// and a group's flows take turns within it, so jobs side by side progress together
    /// whatever each one has waiting. The default is one flow for every request
    /// that names none, served in arrival order.
    pub flow: Flow<'a>,
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
