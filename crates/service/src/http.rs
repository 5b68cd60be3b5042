//! The HTTP/1 server of the API, with limits at its edge: a deadline for a request's headers,
//! an idle bound on each connection, and a bound on connections served at once.
//!
//! `axum::serve` sets none of these (hyper's header timeout needs a timer it does not give), so
//! a client sending half a request line held a connection, its buffers and a file descriptor
//! forever. Here hyper's own `header_read_timeout` closes slow or silent clients, a watchdog
//! closes connections that move no byte for `idle_timeout`, and a semaphore stops accepting at
//! `max_connections` (the kernel's backlog holds further ones) while open ones are served.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long a stopping server waits for its connections' requests in progress.
const DRAIN_PATIENCE: Duration = Duration::from_secs(5);

/// The listen backlog asked for: connections the kernel completes while the server is at
/// `max_connections` or busy wait there (Linux caps it at `net.core.somaxconn`, 4096 by default
/// since 5.4); tokio's default of 1024 drops a burst's handshakes sooner.
const BACKLOG: u32 = 4096;

/// A listener on `addr` with [`BACKLOG`] (`SO_REUSEADDR` as tokio's `bind` sets it).
pub(crate) fn bind(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// The limits of [`serve`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct EdgeLimits {
    /// `serve.header_read_timeout`.
    pub header_read_timeout: Duration,
    /// `serve.idle_timeout`.
    pub idle_timeout: Duration,
    /// `serve.max_connections`.
    pub max_connections: usize,
}

/// Serves `app` on `listener` until `stop`, then lets requests in progress finish (a few
/// seconds at most).
pub(crate) async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: EdgeLimits,
    tls: Option<TlsAcceptor>,
    stop: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let connections = TaskTracker::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    // The read buffer bounds a request head: at 64 KiB, hyper answers 431 itself; below that,
    // the API answers over its own smaller limits with a body and a request id.
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(64 << 10)
        .max_headers(2 * batch_api::MAX_HEADERS);
    let service = TowerToHyperService::new(app);
    tokio::spawn(give_memory_back(
        slots.clone(),
        limits.max_connections,
        stop.clone(),
    ));
    loop {
        // A slot first: at the limit, nothing more is accepted until a connection closes.
        let slot = tokio::select! {
            _ = stop.cancelled() => break,
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, or a connection reset before it was taken: the
                    // listener itself is fine; wait a moment rather than spin.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let http = http.clone();
        let service = service.clone();
        let stop = stop.clone();
        let tls = tls.clone();
        connections.spawn(async move {
            let idle = limits.idle_timeout;
            match tls {
                None => connection(stream, http, service, idle, stop).await,
                // The handshake gets the time a request head gets.
                Some(tls) => {
                    match tokio::time::timeout(limits.header_read_timeout, tls.accept(stream)).await
                    {
                        Ok(Ok(stream)) => connection(stream, http, service, idle, stop).await,
                        Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                        Err(_) => {
                            tracing::debug!("TLS handshake not done within header_read_timeout")
                        }
                    }
                }
            }
            drop(slot);
        });
    }
    connections.close();
    if tokio::time::timeout(DRAIN_PATIENCE, connections.wait())
        .await
        .is_err()
    {
        tracing::warn!("some connections were still busy when the server stopped");
    }
}

/// Connections that must have closed since the busiest moment before memory is handed back.
const TRIM_AFTER_CLOSED: usize = 256;

/// Hands the memory of closed connections back to the system after a burst of them.
///
/// glibc's allocator keeps what thousands of connections freed (their buffers interleave with
/// live allocations in its arenas), so a burst left the process hundreds of MB larger for good;
/// `malloc_trim` returns the free pages of every arena.
async fn give_memory_back(slots: Arc<Semaphore>, max: usize, stop: CancellationToken) {
    let mut busiest = 0;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let open = max - slots.available_permits();
        busiest = busiest.max(open);
        if busiest - open >= TRIM_AFTER_CLOSED {
            busiest = open;
            let _ = tokio::task::spawn_blocking(trim).await;
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim() {
    // SAFETY: malloc_trim only walks and releases the allocator's own free memory.
    unsafe { libc::malloc_trim(0) };
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() {}

/// Drives one connection until it ends, it stays idle too long, or the server stops.
async fn connection<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    stream: S,
    http: hyper::server::conn::http1::Builder,
    service: TowerToHyperService<axum::Router>,
    idle_timeout: Duration,
    stop: CancellationToken,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched {
        inner: stream,
        activity: activity.clone(),
    });
    let conn = http.serve_connection(io, service);
    tokio::pin!(conn);
    let mut closing = false;
    loop {
        let idle_until = activity.last() + idle_timeout;
        tokio::select! {
            served = conn.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!(error = %e, "connection ended");
                }
                return;
            }
            _ = stop.cancelled(), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
            _ = tokio::time::sleep_until(idle_until.into()) => {
                if activity.last() + idle_timeout > Instant::now() {
                    continue;
                }
                if closing {
                    // Asked to close and still no byte moved: the peer is gone or stuck.
                    tracing::debug!("closing a connection idle past its graceful close");
                    return;
                }
                // Closes at once when between requests; a request in progress is answered first.
                conn.as_mut().graceful_shutdown();
                closing = true;
                activity.touch();
            }
        }
    }
}

/// When a connection last moved a byte.
struct Activity {
    start: Instant,
    /// Milliseconds since `start`.
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }
}

/// A stream that records in [`Activity`] each read or write that moved bytes.
struct Watched<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
