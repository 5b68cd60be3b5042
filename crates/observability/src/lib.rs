#![doc = include_str!("../README.md")]

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
