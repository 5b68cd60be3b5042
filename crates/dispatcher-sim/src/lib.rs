//! A faithful stand-in for the llm-d-async dispatcher's Redis sorted-set transport, and a fake
//! OpenAI-compatible inference gateway, so batch pipelines can be tested without GPUs or the real
//! dispatcher.
//!
//! - [`Gateway`]: an HTTP server answering `/v1/chat/completions`, `/v1/completions` and
//!   `/v1/embeddings` with deterministic replies that name
//!   [`body_digest`](batch_wire::hash::body_digest) of the exact request body, with a latency model,
//!   a capacity limit and failure injection, all changeable at run time.
//! - [`Dispatcher`]: takes envelopes from request sorted sets (lowest deadline first, `n =
//!   floor(batch_size × budget)` per poll interval), drops the invalid and the expired, honours
//!   cancel markers, POSTs payloads to the gateway, retries 429/5xx through `retry-sortedset`, and
//!   LPUSHes results, exactly as `dispatcher-contract.md` describes the v0.9 ("M") dispatcher.
//!
//! Neither installs a global metrics recorder or tracing subscriber: counters live in the handles
//! ([`GatewayHandle::stats`], [`DispatcherHandle::stats`]) and on their own `/metrics` pages.
//!
//! ```no_run
//! use dispatcher_sim::{Dispatcher, DispatcherConfig, Gateway, GatewayConfig, QueueEntry};
//!
//! # async fn demo() -> Result<(), dispatcher_sim::SimError> {
//! let gateway = Gateway::start("127.0.0.1:0".parse().unwrap(), GatewayConfig::default()).await?;
//! let config = DispatcherConfig::new(
//!     "redis://127.0.0.1:7777",
//!     vec![QueueEntry::new("llm-d-async:requests:pool-a")],
//! );
//! // The queue names no `igw_base_url`, so it is served by the embedded gateway.
//! let dispatcher = Dispatcher::start(config, Some(&gateway)).await?;
//! // ... ZADD envelopes, read results with RPOP ...
//! println!("taken so far: {}", dispatcher.stats().taken);
//! dispatcher.shutdown().await;
//! gateway.shutdown().await;
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod dispatcher;
mod duration_serde;
mod gateway;
mod http;
mod prom;

use std::net::SocketAddr;

pub use dispatcher::{
    Dispatcher, DispatcherConfig, DispatcherHandle, DispatcherStats, ExpiredPolicy, QueueEntry,
    SimOptions, DEFAULT_BUDGET_KEY, DEFAULT_RESULT_QUEUE, DEFAULT_RETRY_QUEUE,
};
pub use gateway::{
    FailureKind, FailureRule, Gateway, GatewayConfig, GatewayHandle, GatewayStats, SeenRequest,
};

/// What went wrong starting or configuring the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The configuration is unusable; the message names the field and the value.
    #[error("configuration: {0}")]
    Config(String),
    /// A listener could not be bound.
    ///
    /// The I/O error is part of the message, not a `source()`, so a printed chain shows it once.
    #[error("cannot listen on {addr}: {error}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why binding failed.
        error: std::io::Error,
    },
    /// The Redis client could not be built.
    #[error("redis: {0}")]
    Redis(String),
}

/// Refuses listen addresses outside the loopback range unless `allow_non_loopback` is set: the
/// simulator is a test tool and must not be reachable from other machines by accident.
pub fn check_listen_addr(addr: SocketAddr, allow_non_loopback: bool) -> Result<(), SimError> {
    if addr.ip().is_loopback() || allow_non_loopback {
        Ok(())
    } else {
        Err(SimError::Config(format!(
            "listen address {addr} is not a loopback address; pass --allow-non-loopback to use it"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_by_default() {
        assert!(check_listen_addr("127.0.0.1:0".parse().unwrap(), false).is_ok());
        assert!(check_listen_addr("[::1]:80".parse().unwrap(), false).is_ok());
        let err = check_listen_addr("0.0.0.0:8080".parse().unwrap(), false).unwrap_err();
        assert!(err.to_string().contains("--allow-non-loopback"), "{err}");
        assert!(check_listen_addr("0.0.0.0:8080".parse().unwrap(), true).is_ok());
    }
}
