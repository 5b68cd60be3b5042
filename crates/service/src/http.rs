//! The HTTP/1 server of the API, with limits at its edge: deadlines for a connection's first
//! request head and for later ones, an idle bound on each connection, a bound on connections
//! served at once and on those of one peer address.
//!
//! `axum::serve` sets none of these (hyper's header timeout needs a timer it does not give), so
//! a client sending half a request line held a connection, its buffers and a file descriptor
//! forever. Here a new connection has `first_request_timeout` to send its first head, hyper's
//! own `header_read_timeout` bounds later ones, a watchdog closes connections that move no byte
//! for `idle_timeout`, and a semaphore bounds connections at `max_connections`.
//!
//! Idle connections must not cost the others their service: at the ceiling, a new connection
//! closes the oldest one that has not yet been answered anything but a 401 (half-sent requests,
//! keyless probes), and only when every open connection has been answered does it wait in the
//! kernel's backlog; one peer address holds at most `max_connections_per_peer` (more are closed
//! at once), so one client cannot fill the ceiling alone.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
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

/// The open-file limit of this process, its soft limit first raised to its hard one (the
/// connection ceiling's default follows it).
pub(crate) fn open_file_limit() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed to them.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return 1024;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit.rlim_cur = limit.rlim_max;
            }
        }
    }
    limit.rlim_cur
}

/// The limits of [`serve`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct EdgeLimits {
    /// `serve.first_request_timeout`.
    pub first_request_timeout: Duration,
    /// `serve.header_read_timeout`.
    pub header_read_timeout: Duration,
    /// `serve.idle_timeout`.
    pub idle_timeout: Duration,
    /// `serve.max_connections` or its default.
    pub max_connections: usize,
    /// `serve.max_connections_per_peer` or its default (0: none).
    pub per_peer: usize,
}

/// The open connections that may be closed to make room, and the count of each peer's.
#[derive(Default)]
struct Edge {
    /// Connections not yet answered anything but a 401, by opening order, with what closes
    /// each and whether a request of it is being answered: at the ceiling, the oldest with no
    /// request in progress is closed for a new one (a request in progress is either
    /// authenticated, an upload on a client's first connection, or about to be answered 401).
    unproven: Mutex<BTreeMap<u64, (CancellationToken, Arc<AtomicBool>)>>,
    next: AtomicU64,
    peers: Mutex<HashMap<IpAddr, usize>>,
}

impl Edge {
    /// Counts a connection of `peer`, unless it already holds `cap` (0: no cap).
    fn enter(self: &Arc<Self>, peer: IpAddr, cap: usize) -> Option<PeerSeat> {
        let mut peers = self.peers.lock().expect("peers lock");
        let open = peers.entry(peer).or_default();
        if cap > 0 && *open >= cap {
            return None;
        }
        *open += 1;
        Some(PeerSeat {
            edge: self.clone(),
            peer,
        })
    }

    /// Registers a new connection as closable; its number, what closes it and the flag its
    /// requests raise while they are answered.
    fn register(&self) -> (u64, CancellationToken, Arc<AtomicBool>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let close = CancellationToken::new();
        let busy = Arc::new(AtomicBool::new(false));
        self.unproven
            .lock()
            .expect("unproven lock")
            .insert(id, (close.clone(), busy.clone()));
        (id, close, busy)
    }

    /// Connection `id` was answered, or ended: it is no longer closed to make room.
    fn forget(&self, id: u64) {
        self.unproven.lock().expect("unproven lock").remove(&id);
    }

    /// Closes the oldest connection not yet answered and with no request in progress; false
    /// when there is none.
    fn close_oldest(&self) -> bool {
        let mut unproven = self.unproven.lock().expect("unproven lock");
        let oldest = unproven
            .iter()
            .find(|(_, (_, busy))| !busy.load(Ordering::Relaxed))
            .map(|(id, _)| *id);
        match oldest.and_then(|id| unproven.remove(&id)) {
            Some((close, _)) => {
                close.cancel();
                true
            }
            None => false,
        }
    }
}

/// One connection of a peer, counted until dropped.
struct PeerSeat {
    edge: Arc<Edge>,
    peer: IpAddr,
}

impl Drop for PeerSeat {
    fn drop(&mut self) {
        let mut peers = self.edge.peers.lock().expect("peers lock");
        if let Some(open) = peers.get_mut(&self.peer) {
            *open -= 1;
            if *open == 0 {
                peers.remove(&self.peer);
            }
        }
    }
}

/// The API's service on one connection, noting its first request head and its first answer
/// other than a 401.
#[derive(Clone)]
struct Noted {
    service: TowerToHyperService<axum::Router>,
    edge: Arc<Edge>,
    id: u64,
    headed: Arc<AtomicBool>,
    busy: Arc<AtomicBool>,
}

impl hyper::service::Service<hyper::Request<hyper::body::Incoming>> for Noted {
    type Response = axum::response::Response;
    type Error = std::convert::Infallible;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn call(&self, request: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        self.headed.store(true, Ordering::Relaxed);
        // HTTP/1 answers one request at a time on a connection, so one flag is enough.
        self.busy.store(true, Ordering::Relaxed);
        let answer = self.service.call(request);
        let (edge, id, busy) = (self.edge.clone(), self.id, self.busy.clone());
        Box::pin(async move {
            let response = answer.await?;
            if response.status() != hyper::StatusCode::UNAUTHORIZED {
                edge.forget(id);
            }
            busy.store(false, Ordering::Relaxed);
            Ok(response)
        })
    }
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
    let edge = Arc::new(Edge::default());
    let connections = TaskTracker::new();
    let http = http_builder(&limits);
    let service = TowerToHyperService::new(app);
    tokio::spawn(give_memory_back(
        slots.clone(),
        limits.max_connections,
        stop.clone(),
    ));
    while let Some((stream, peer)) = accept(&listener, &stop).await {
        let Some(seat) = edge.enter(peer.ip(), limits.per_peer) else {
            tracing::debug!(peer = %peer.ip(), "closed: its address holds max_connections_per_peer");
            continue;
        };
        let Some(slot) = take_slot(&slots, &edge, &stop).await else {
            break;
        };
        let _ = stream.set_nodelay(true);
        let (id, closed, busy) = edge.register();
        let noted = Noted {
            service: service.clone(),
            edge: edge.clone(),
            id,
            headed: Arc::new(AtomicBool::new(false)),
            busy,
        };
        let run = handshake_and_serve(
            stream,
            tls.clone(),
            http.clone(),
            noted,
            limits,
            stop.clone(),
        );
        let edge = edge.clone();
        connections.spawn(async move {
            tokio::select! {
                () = run => {}
                () = closed.cancelled() => {}
            }
            edge.forget(id);
            drop(seat);
            drop(slot);
        });
    }
    drain(connections).await;
}

/// The HTTP/1 settings of every connection.
fn http_builder(limits: &EdgeLimits) -> hyper::server::conn::http1::Builder {
    let mut http = hyper::server::conn::http1::Builder::new();
    // The read buffer bounds a request head: at 64 KiB, hyper answers 431 itself; below that,
    // the API answers over its own smaller limits with a body and a request id.
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(64 << 10)
        .max_headers(2 * batch_api::MAX_HEADERS);
    http
}

/// The next connection, or `None` once `stop` is cancelled.
async fn accept(
    listener: &TcpListener,
    stop: &CancellationToken,
) -> Option<(tokio::net::TcpStream, std::net::SocketAddr)> {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return None,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => return Some(accepted),
                Err(e) => {
                    // Out of file descriptors, or a connection reset before it was taken: the
                    // listener itself is fine; wait a moment rather than spin.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

/// A slot under `max_connections` for a new connection, or `None` once `stop` is cancelled.
async fn take_slot(
    slots: &Arc<Semaphore>,
    edge: &Edge,
    stop: &CancellationToken,
) -> Option<OwnedSemaphorePermit> {
    if let Ok(slot) = slots.clone().try_acquire_owned() {
        return Some(slot);
    }
    // At the ceiling: the oldest connection not yet answered makes room; with none, this one
    // waits for a slot and further ones in the backlog.
    if edge.close_oldest() {
        tracing::debug!("closed the oldest unanswered connection: at max_connections");
    }
    tokio::select! {
        _ = stop.cancelled() => None,
        slot = slots.clone().acquire_owned() => slot.ok(),
    }
}

/// Serves one connection: its TLS handshake first when the server has TLS, both the handshake
/// and the first request head within `first_request_timeout`.
async fn handshake_and_serve(
    stream: tokio::net::TcpStream,
    tls: Option<TlsAcceptor>,
    http: hyper::server::conn::http1::Builder,
    noted: Noted,
    limits: EdgeLimits,
    stop: CancellationToken,
) {
    let first_by = Instant::now() + limits.first_request_timeout;
    let idle = limits.idle_timeout;
    match tls {
        None => connection(stream, http, noted, first_by, idle, stop).await,
        Some(tls) => match tokio::time::timeout_at(first_by.into(), tls.accept(stream)).await {
            Ok(Ok(stream)) => connection(stream, http, noted, first_by, idle, stop).await,
            Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
            Err(_) => tracing::debug!("TLS handshake not done within first_request_timeout"),
        },
    }
}

/// Lets the connections' requests in progress finish, waiting [`DRAIN_PATIENCE`] at most.
async fn drain(connections: TaskTracker) {
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

/// Drives one connection until it ends, its first request head is not in by `first_by`, it
/// stays idle too long, or the server stops.
async fn connection<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    stream: S,
    http: hyper::server::conn::http1::Builder,
    service: Noted,
    first_by: Instant,
    idle_timeout: Duration,
    stop: CancellationToken,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched {
        inner: stream,
        activity: activity.clone(),
    });
    let headed = service.headed.clone();
    let conn = http.serve_connection(io, service);
    tokio::pin!(conn);
    let mut closing = false;
    let mut first_in = false;
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
            _ = tokio::time::sleep_until(first_by.into()), if !first_in => {
                if !headed.load(Ordering::Relaxed) {
                    tracing::debug!("closing a connection without a whole request head by first_request_timeout");
                    return;
                }
                first_in = true;
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
