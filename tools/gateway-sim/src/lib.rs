//! A fake OpenAI-compatible inference gateway, so batch pipelines can be tested without GPUs.
//!
//! [`Gateway`] starts an HTTP server answering `/v1/chat/completions`, `/v1/completions` and
//! `/v1/embeddings` with deterministic replies that name
//! [`body_digest`](batch_wire::hash::body_digest) of the exact request body, so a test can prove
//! which request a reply answers. It models latency (fixed plus per output token), a capacity
//! limit (429 with `Retry-After` beyond it, or in queueing mode latency that grows with the load
//! past it and 429 only past a queue limit), a prefix cache (an LRU of prompt prefixes per
//! endpoint, a miss may cost extra latency), a model server as vLLM schedules one
//! (`max_num_seqs` running, the rest waiting in its queue, by priority if asked, chat answers
//! streamed token by token when asked, with vLLM's metric names on `/metrics`) and injected
//! failures, all changeable at run time
//! through [`GatewayHandle::set_config`] or `POST /admin/config`.
//!
//! It installs no global metrics recorder or tracing subscriber: its counters are in
//! [`GatewayHandle::stats`], on `GET /admin/stats` and on its own `/metrics` page.
//!
//! The `dispatcher-sim` crate runs it beside its simulated dispatcher and re-exports these types.
//!
//! ```no_run
//! use gateway_sim::{Gateway, GatewayConfig};
//!
//! # async fn demo() -> Result<(), gateway_sim::SimError> {
//! let config = GatewayConfig {
//!     latency_fixed: std::time::Duration::from_millis(20),
//!     prefix_cache_size: 8,
//!     ..GatewayConfig::default()
//! };
//! let gateway = Gateway::start("127.0.0.1:0".parse().unwrap(), config).await?;
//! println!("POST to {}/v1/chat/completions", gateway.base_url());
//! // ... send requests ...
//! let stats = gateway.stats();
//! println!("{} answered, {} prefix-cache hits", stats.responses(200), stats.prefix_cache_hits);
//! gateway.shutdown().await;
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod config;
mod duration_serde;
mod gateway;
pub mod http;
mod prefix;
pub mod prom;
mod reply;
mod timer;

use std::net::SocketAddr;

pub use config::{standard_normal, FailureKind, FailureRule, GatewayConfig, Unseen};
pub use gateway::{Gateway, GatewayHandle, GatewayLoad, GatewayStats, SeenRequest};

/// What went wrong starting or configuring a simulator: this gateway, or the dispatcher of
/// `dispatcher-sim`, which shares this type.
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
    /// The Redis client could not be built (the dispatcher's).
    #[error("redis: {0}")]
    Redis(String),
}

/// Refuses listen addresses outside the loopback range unless `allow_non_loopback` is set: the
/// simulators are test tools and must not be reachable from other machines by accident.
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
