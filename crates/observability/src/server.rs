//! The HTTP endpoint: liveness, readiness and the metrics scrape on one port.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::{MetricsHandle, ObservabilityError};

/// A client that has not sent its request headers by then is dropped (slow or stuck clients).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long shutdown waits for open connections to finish before dropping them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Pause after a failed accept (e.g. out of file descriptors) so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

const TEXT: &str = "text/plain; charset=utf-8";
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether the process is ready for work, as `GET /ready` reports it. Clones share one flag;
/// it starts not ready.
#[derive(Clone, Debug, Default)]
pub struct Readiness {
    ready: Arc<AtomicBool>,
}

impl Readiness {
    /// Marks the process ready (`/ready` answers 200) or not (503), e.g. `false` when shutdown starts.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    /// Whether `/ready` currently answers 200.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }
}

/// A running endpoint. Dropping it leaves the server running; cancel its token to stop it.
#[derive(Debug)]
pub struct ServerHandle {
    local_addr: SocketAddr,
    task: JoinHandle<()>,
}

impl ServerHandle {
    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits until the server has stopped after its shutdown token was cancelled: the listener is
    /// closed and open connections have finished (or were dropped after a short grace period).
    ///
    /// # Errors
    ///
    /// [`ObservabilityError::Task`] if the server task panicked or was aborted.
    pub async fn join(self) -> Result<(), ObservabilityError> {
        self.task.await.map_err(|error| ObservabilityError::Task {
            addr: self.local_addr,
            error,
        })
    }
}

/// Serves `GET /health`, `GET /ready` and `GET /metrics` on `addr` until `shutdown` is cancelled.
///
/// Any address is allowed (pods bind `0.0.0.0`). Returns once the listener is bound; the server runs
/// on a spawned task, so this must be called within a Tokio runtime. On shutdown the server stops
/// accepting at once and lets requests in progress finish.
///
/// # Errors
///
/// [`ObservabilityError::Bind`] (naming `addr`) if the address cannot be bound.
pub async fn serve(
    addr: SocketAddr,
    metrics: MetricsHandle,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> Result<ServerHandle, ObservabilityError> {
    let bind_error = |error| ObservabilityError::Bind { addr, error };
    let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
    let local_addr = listener.local_addr().map_err(bind_error)?;
    let routes = Arc::new(Routes { metrics, readiness });
    let task = tokio::spawn(accept_loop(listener, routes, shutdown));
    Ok(ServerHandle { local_addr, task })
}

async fn accept_loop(listener: TcpListener, routes: Arc<Routes>, shutdown: CancellationToken) {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(error) => {
                tracing::warn!(%error, "observability server: accept failed");
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                }
            }
        };
        let routes = Arc::clone(&routes);
        let service = service_fn(move |request| {
            std::future::ready(Ok::<_, Infallible>(routes.respond(&request)))
        });
        let connection = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        connections.spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "observability server: connection ended with an error");
            }
        });
    }
    // Closing the listener first makes new connections fail at once.
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            "observability server: dropping connections still open after the grace period"
        );
    }
    connections.shutdown().await;
}

struct Routes {
    metrics: MetricsHandle,
    readiness: Readiness,
}

impl Routes {
    fn respond(&self, request: &Request<Incoming>) -> Response<Full<Bytes>> {
        let path = request.uri().path();
        if !matches!(path, "/health" | "/ready" | "/metrics") {
            return reply(StatusCode::NOT_FOUND, TEXT, "not found\n");
        }
        if !matches!(*request.method(), Method::GET | Method::HEAD) {
            let mut response = reply(StatusCode::METHOD_NOT_ALLOWED, TEXT, "method not allowed\n");
            response
                .headers_mut()
                .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
            return response;
        }
        match path {
            "/health" => reply(StatusCode::OK, TEXT, "ok"),
            "/ready" if self.readiness.is_ready() => reply(StatusCode::OK, TEXT, "ready"),
            "/ready" => reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, "not ready"),
            _ => reply(StatusCode::OK, PROMETHEUS_TEXT, self.metrics.render()),
        }
    }
}

fn reply(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}
