//! A scriptable inference gateway for tests: a real hyper server on 127.0.0.1 that records what
//! it receives, counts concurrent requests, and answers what the test's handler says.

#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use batch_sync_dispatch::{EndpointOptions, SyncRequest};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::HeaderMap;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

/// What the gateway received.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub at: Instant,
}

/// What the gateway answers.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
    pub delay: Duration,
}

impl Reply {
    pub fn status(status: u16) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: format!(r#"{{"status":{status}}}"#),
            delay: Duration::ZERO,
        }
    }

    pub fn ok() -> Self {
        Self::status(200)
    }

    pub fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    pub fn after(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
}

/// Counters shared by one or more gateways.
#[derive(Debug, Default)]
pub struct Counters {
    pub requests: AtomicUsize,
    pub connections: AtomicUsize,
    pub inflight: AtomicUsize,
    pub peak: AtomicUsize,
    /// Handlers dropped before answering: the client went away.
    pub aborted: AtomicUsize,
    pub seen: Mutex<Vec<Seen>>,
}

impl Counters {
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }
}

type Handler = Arc<dyn Fn(usize, &Seen) -> Reply + Send + Sync>;

pub struct Gateway {
    pub url: String,
    pub addr: SocketAddr,
    pub counters: Arc<Counters>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        // Aborting the accept loop drops its JoinSet, which aborts every connection.
        self.task.abort();
    }
}

impl Gateway {
    /// A plain-HTTP gateway; `handler(n, seen)` answers the n-th request (0-based).
    pub async fn start(handler: impl Fn(usize, &Seen) -> Reply + Send + Sync + 'static) -> Self {
        Self::start_shared(Arc::new(Counters::default()), handler).await
    }

    /// Like [`start`](Self::start), counting into `counters` (shared with other gateways).
    pub async fn start_shared(
        counters: Arc<Counters>,
        handler: impl Fn(usize, &Seen) -> Reply + Send + Sync + 'static,
    ) -> Self {
        Self::spawn(counters, Arc::new(handler), None, "http").await
    }

    /// An HTTPS gateway.
    pub async fn start_tls(
        acceptor: tokio_rustls::TlsAcceptor,
        handler: impl Fn(usize, &Seen) -> Reply + Send + Sync + 'static,
    ) -> Self {
        Self::spawn(
            Arc::new(Counters::default()),
            Arc::new(handler),
            Some(acceptor),
            "https",
        )
        .await
    }

    async fn spawn(
        counters: Arc<Counters>,
        handler: Handler,
        tls: Option<tokio_rustls::TlsAcceptor>,
        scheme: &str,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn({
            let counters = counters.clone();
            async move {
                let mut connections = JoinSet::new();
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    counters.connections.fetch_add(1, Ordering::SeqCst);
                    let (counters, handler, tls) = (counters.clone(), handler.clone(), tls.clone());
                    connections.spawn(async move {
                        let service =
                            service_fn(move |req| handle(counters.clone(), handler.clone(), req));
                        match tls {
                            Some(acceptor) => {
                                // A refused handshake just ends the connection.
                                if let Ok(stream) = acceptor.accept(stream).await {
                                    let _ = http1::Builder::new()
                                        .serve_connection(TokioIo::new(stream), service)
                                        .await;
                                }
                            }
                            None => {
                                let _ = http1::Builder::new()
                                    .serve_connection(TokioIo::new(stream), service)
                                    .await;
                            }
                        }
                    });
                }
            }
        });
        Self {
            url: format!("{scheme}://127.0.0.1:{}", addr.port()),
            addr,
            counters,
            task,
        }
    }
}

struct InflightGuard {
    counters: Arc<Counters>,
    answered: bool,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.counters.inflight.fetch_sub(1, Ordering::SeqCst);
        if !self.answered {
            self.counters.aborted.fetch_add(1, Ordering::SeqCst);
        }
    }
}

async fn handle(
    counters: Arc<Counters>,
    handler: Handler,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = request.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let seen = Seen {
        method: parts.method.to_string(),
        path: parts.uri.path().to_owned(),
        headers: parts.headers,
        body,
        at: Instant::now(),
    };
    let n = counters.requests.fetch_add(1, Ordering::SeqCst);
    counters.seen.lock().unwrap().push(seen.clone());
    let now = counters.inflight.fetch_add(1, Ordering::SeqCst) + 1;
    counters.peak.fetch_max(now, Ordering::SeqCst);
    let mut guard = InflightGuard {
        counters: counters.clone(),
        answered: false,
    };
    let reply = handler(n, &seen);
    tokio::time::sleep(reply.delay).await;
    guard.answered = true;
    drop(guard);

    let mut response = Response::builder().status(reply.status);
    for (name, value) in reply.headers {
        response = response.header(name, value);
    }
    Ok(response.body(Full::new(Bytes::from(reply.body))).unwrap())
}

/// Endpoint options with millisecond backoffs, for tests.
pub fn fast_options(url: &str) -> EndpointOptions {
    let mut options = EndpointOptions::new(url);
    options.request_timeout = Duration::from_secs(10);
    options.max_retries = 3;
    options.initial_backoff = Duration::from_millis(1);
    options.max_backoff = Duration::from_millis(20);
    options
}

pub const BODY: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

/// A request with an SLO an hour away and no pass-through headers.
pub fn request(id: &str) -> SyncRequest<'_> {
    SyncRequest {
        id,
        path: "/v1/chat/completions",
        body: Bytes::from_static(BODY),
        slo_deadline: SystemTime::now() + Duration::from_secs(3600),
        headers: &[],
        flow: Default::default(),
    }
}

/// Waits until `check` holds, polling, for at most `limit`.
pub async fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    check()
}
