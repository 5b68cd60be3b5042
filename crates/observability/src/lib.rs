//! Health, readiness and Prometheus metrics for the batch processor.
//!
//! The other crates emit metrics through the [`metrics`] facade and know nothing about Prometheus.
//! This crate is the other end: [`install_recorder`] installs the process-wide Prometheus recorder
//! (once; later calls return the same [`MetricsHandle`]) with the descriptions of every metric the
//! processor emits ([`names`]) and histogram buckets suited to request and job durations. [`serve`]
//! exposes it over HTTP next to the probes a pod needs:
//!
//! - `GET /health`: always `200 ok` while the process serves HTTP (liveness);
//! - `GET /ready`: `503` until [`Readiness::set_ready`]`(true)`, and again after `set_ready(false)`
//!   (e.g. when shutdown starts), so traffic and scheduling stop before the process does;
//! - `GET /metrics`: the Prometheus text exposition format;
//! - anything else: `404` (`405` for another method on one of the paths above).
//!
//! The server has no listener of its own in the exporter: one port serves probes and metrics.
//!
//! Traces: [`trace_layer`] exports `tracing` spans over OTLP when configured, and
//! [`traceparent`] gives the W3C header of a span, sent on a batch's inference requests.
//!
//! ```no_run
//! use batch_observability::{install_recorder, names, serve, Readiness};
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn run() -> Result<(), batch_observability::ObservabilityError> {
//! let metrics = install_recorder()?;
//! let readiness = Readiness::default();
//! let shutdown = CancellationToken::new();
//! let server = serve("0.0.0.0:9090".parse().unwrap(), metrics, readiness.clone(), shutdown.clone()).await?;
//! tracing::info!(addr = %server.local_addr(), "observability endpoint up");
//!
//! metrics::counter!(names::REQUESTS_ENQUEUED_TOTAL, "pool" => "pool-a").increment(1);
//! readiness.set_ready(true);
//! // ... run the processor; on shutdown:
//! readiness.set_ready(false);
//! shutdown.cancel();
//! server.join().await?;
//! # Ok(())
//! # }
//! ```

mod recorder;
mod server;
mod traces;

pub use recorder::{install_recorder, names, MetricsHandle};
pub use server::{serve, Readiness, ServerHandle};
pub use traces::{
    set_parent, trace_layer, traceparent, TraceError, TraceLayer, Traces, TRACEPARENT,
};

use std::net::SocketAddr;

/// What can go wrong when setting up metrics or the HTTP endpoint.
///
/// Each variant shows its cause in the message and has no `source()`, so a printed chain
/// shows the cause once.
#[derive(Debug, thiserror::Error)]
pub enum ObservabilityError {
    /// Another `metrics` recorder (not ours) was installed globally first.
    #[error("metrics recorder: another global recorder is already installed in this process")]
    RecorderTaken,
    /// The Prometheus recorder refused its configuration.
    #[error("metrics recorder: {0}")]
    Recorder(metrics_exporter_prometheus::BuildError),
    /// The endpoint could not listen on the requested address.
    #[error("observability server: cannot bind {addr}: {error}")]
    Bind {
        /// The address that was asked for.
        addr: SocketAddr,
        /// Why binding failed.
        error: std::io::Error,
    },
    /// The server task ended abnormally (it panicked or its runtime went away).
    #[error("observability server on {addr}: task failed: {error}")]
    Task {
        /// The address the server was listening on.
        addr: SocketAddr,
        /// How the task ended.
        error: tokio::task::JoinError,
    },
}
