//! A faithful stand-in for the llm-d-async dispatcher's Redis sorted-set transport, with the
//! fake OpenAI-compatible inference gateway of the `gateway-sim` crate, so batch pipelines can be
//! tested without GPUs or the real dispatcher.
//!
//! - [`Dispatcher`]: takes envelopes from request sorted sets (lowest deadline first, `n =
//!   floor(batch_size × budget)` per poll interval), drops the invalid, honours cancel markers,
//!   applies the queue's gate message by message, POSTs payloads (re-encoded as Go does) to
//!   the gateway, retries 429/5xx, and LPUSHes results, as the real one was observed to do
//!   (`docs/architecture.md`, "The real dispatcher, as observed"). [`DispatcherVersion`] picks
//!   the release: v0.9 ("M": ZPOPMIN, expired dropped silently) or v0.10 ("N", the default:
//!   leased claims in `{<queue>}:claimed`, `{<queue>}:claim-owners` and `{<queue>}:claims-idx`,
//!   `DEADLINE_EXCEEDED` for the expired, `request_token` in results).
//! - [`Gateway`] (re-exported from `gateway-sim`): deterministic replies that name the digest of
//!   the exact request body, a latency model, a prefix cache, a capacity limit and failure
//!   injection, all changeable at run time.
//!
//! The dispatcher parses envelopes and writes results with its own types, not the processor's,
//! so that a drift between the processor and the contract shows in end-to-end tests.
//!
//! Neither installs a global metrics recorder or tracing subscriber: counters live in the handles
//! ([`GatewayHandle::stats`], [`DispatcherHandle::stats`]) and on their own `/metrics` pages.
//!
//! ```no_run
//! use dispatcher_sim::{
//!     Dispatcher, DispatcherConfig, DispatcherVersion, Gateway, GatewayConfig, QueueEntry,
//! };
//!
//! # async fn demo() -> Result<(), dispatcher_sim::SimError> {
//! let gateway = Gateway::start("127.0.0.1:0".parse().unwrap(), GatewayConfig::default()).await?;
//! let mut config = DispatcherConfig::new(
//!     "redis://127.0.0.1:7777",
//!     vec![QueueEntry::new("llm-d-async:requests:pool-a")],
//! );
//! config.version = DispatcherVersion::V0_9;
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

// The gateway's HTTP plumbing and Prometheus writer serve the dispatcher too.
use gateway_sim::{http, prom};

pub use dispatcher::{
    ClaimKeys, Dispatcher, DispatcherConfig, DispatcherHandle, DispatcherStats, DispatcherVersion,
    ExpiredPolicy, QueueEntry, SimOptions, TransportConfig, DEFAULT_BUDGET_KEY,
    DEFAULT_RESULT_QUEUE, DEFAULT_RETRY_QUEUE,
};
pub use gateway_sim::{
    check_listen_addr, FailureKind, FailureRule, Gateway, GatewayConfig, GatewayHandle,
    GatewayLoad, GatewayStats, SeenRequest, SimError, Unseen,
};
