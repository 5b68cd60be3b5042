//! The simulated dispatcher: request sorted sets in, HTTP to the gateway, result lists out.

mod backoff;
mod config;
mod engine;
mod gate;
mod gojson;
mod stats;
mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::{Method, StatusCode};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::{
    DispatcherConfig, DispatcherVersion, ExpiredPolicy, QueueEntry, SimOptions, TransportConfig,
    DEFAULT_BUDGET_KEY, DEFAULT_RESULT_QUEUE, DEFAULT_RETRY_QUEUE,
};
pub use engine::ClaimKeys;
pub use stats::DispatcherStats;

use crate::http::{self, Reply};
use crate::{GatewayHandle, SimError};
use engine::Shared;

/// Starts dispatchers. See [`DispatcherHandle`] for what a running one offers.
pub struct Dispatcher;

impl Dispatcher {
    /// Validates `config`, connects to Redis (in the background: an unreachable Redis is
    /// retried and logged, never fatal) and starts polling every queue.
    ///
    /// Queue entries without `igw_base_url` are served by `embedded_gateway`; without one they
    /// are an error, as is an unknown gate type.
    pub async fn start(
        config: DispatcherConfig,
        embedded_gateway: Option<&GatewayHandle>,
    ) -> Result<DispatcherHandle, SimError> {
        config.validate()?;
        let shared = Arc::new(Shared::new(&config, embedded_gateway)?);
        let mut tasks = shared.clone().spawn_loops();

        let metrics = CancellationToken::new();
        let mut metrics_addr = None;
        if let Some(listen) = config.metrics_listen {
            let listener = http::bind(listen).await?;
            metrics_addr = Some(listener.local_addr().map_err(|error| SimError::Bind {
                addr: listen,
                error,
            })?);
            let source = shared.clone();
            let handler = Arc::new(move |req: hyper::Request<hyper::body::Incoming>| {
                let source = source.clone();
                async move { metrics_reply(&source, req.method(), req.uri().path()) }
            });
            tasks.push(http::serve(listener, metrics.clone(), handler));
        }
        tracing::info!(
            queues = config.queues.len(),
            metrics = ?metrics_addr,
            "dispatcher started"
        );
        Ok(DispatcherHandle {
            shared,
            tasks,
            metrics,
            metrics_addr,
            grace: config.shutdown_grace,
        })
    }
}

fn metrics_reply(shared: &Shared, method: &Method, path: &str) -> Reply {
    Reply::Response(match (method, path) {
        (&Method::GET, "/metrics") => http::response(
            StatusCode::OK,
            "text/plain; version=0.0.4",
            shared.stats().to_prometheus(),
        ),
        (&Method::GET, "/health") => http::response(StatusCode::OK, "text/plain", "ok\n"),
        _ => http::response(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    })
}

/// A running dispatcher. Dropping it stops every task abruptly; prefer
/// [`DispatcherHandle::shutdown`].
pub struct DispatcherHandle {
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
    metrics: CancellationToken,
    metrics_addr: Option<SocketAddr>,
    grace: Duration,
}

impl DispatcherHandle {
    /// A snapshot of the counters.
    pub fn stats(&self) -> DispatcherStats {
        self.shared.stats()
    }

    /// Where `/metrics` is served, when `metrics_listen` was set.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Resolves once `crash_after` has fired (never otherwise): every task has been stopped
    /// abruptly and nothing more is taken or written. In v0.9 the messages in hand are lost;
    /// in v0.10 their claims stay in Redis until the lease runs out and a reclaimer (of any
    /// dispatcher) puts them back.
    pub async fn crashed(&self) {
        self.shared.crash_signal().cancelled().await;
    }

    /// Whether `crash_after` has fired.
    pub fn has_crashed(&self) -> bool {
        self.shared.has_crashed()
    }

    /// Stops taking messages, waits (up to the configured grace) for requests in flight to
    /// finish and write their results, then stops everything.
    pub async fn shutdown(mut self) {
        self.shared.stop_taking();
        self.metrics.cancel();
        for task in self.tasks.drain(..) {
            let _ = tokio::time::timeout(self.grace, task).await;
        }
        self.shared.drain(self.grace).await;
        self.shared.kill();
        self.shared.quit().await;
    }
}

impl Drop for DispatcherHandle {
    fn drop(&mut self) {
        self.metrics.cancel();
        self.shared.kill();
        // Without this the Redis client would keep reconnecting until the runtime ends.
        self.shared.quit_in_background();
    }
}
