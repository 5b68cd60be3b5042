//! The endpoint over real HTTP on 127.0.0.1. All recorder-touching tests live in this one binary,
//! because the recorder is global per process.

use std::net::SocketAddr;
use std::time::Duration;

use batch_observability::{
    install_recorder, names, serve, ObservabilityError, Readiness, ServerHandle,
};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::header::{ALLOW, CONTENT_TYPE};
use hyper::{HeaderMap, Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// Guards against a hang only; no test asserts how fast anything is.
const HANG_GUARD: Duration = Duration::from_secs(60);

struct Running {
    server: ServerHandle,
    readiness: Readiness,
    shutdown: CancellationToken,
}

impl Running {
    async fn start() -> Self {
        let readiness = Readiness::default();
        let shutdown = CancellationToken::new();
        let server = serve(
            "127.0.0.1:0".parse().unwrap(),
            install_recorder().expect("recorder"),
            readiness.clone(),
            shutdown.clone(),
        )
        .await
        .expect("bind 127.0.0.1:0");
        Self {
            server,
            readiness,
            shutdown,
        }
    }

    fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(HANG_GUARD, self.server.join())
            .await
            .expect("server stopped")
            .expect("server task ended cleanly");
    }
}

async fn request(addr: SocketAddr, method: Method, path: &str) -> (StatusCode, HeaderMap, String) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let request = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .body(Empty::new())
        .unwrap();
    let response = client.request(request).await.expect("HTTP request");
    let status = response.status();
    let headers = response.headers().clone();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (
        status,
        headers,
        String::from_utf8(body.to_vec()).expect("UTF-8 body"),
    )
}

async fn get(addr: SocketAddr, path: &str) -> (StatusCode, HeaderMap, String) {
    request(addr, Method::GET, path).await
}

#[tokio::test]
async fn health_is_ok_even_when_not_ready() {
    let running = Running::start().await;
    let (status, _, body) = get(running.addr(), "/health").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "ok");
    assert!(!running.readiness.is_ready());
    running.stop().await;
}

#[tokio::test]
async fn ready_follows_the_readiness_flag() {
    let running = Running::start().await;
    let addr = running.addr();
    assert_eq!(get(addr, "/ready").await.0, StatusCode::SERVICE_UNAVAILABLE);
    running.readiness.set_ready(true);
    assert_eq!(get(addr, "/ready").await.0, StatusCode::OK);
    // A clone shares the flag: the binary flips it from its shutdown path.
    running.readiness.clone().set_ready(false);
    assert_eq!(get(addr, "/ready").await.0, StatusCode::SERVICE_UNAVAILABLE);
    running.stop().await;
}

#[tokio::test]
async fn metrics_shows_counters_with_their_description() {
    let running = Running::start().await;
    metrics::counter!(names::JOBS_PROCESSED_TOTAL, "result" => "completed", "reason" => "endpoint-test")
        .increment(3);
    let (status, headers, body) = get(running.addr(), "/metrics").await;
    assert_eq!(status, StatusCode::OK);
    let content_type = headers[CONTENT_TYPE].to_str().unwrap();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    assert!(
        body.contains("# HELP jobs_processed_total Batch jobs"),
        "{body}"
    );
    assert!(
        body.contains("# TYPE jobs_processed_total counter"),
        "{body}"
    );
    assert!(
        body.contains(r#"jobs_processed_total{result="completed",reason="endpoint-test"} 3"#),
        "{body}"
    );
    running.stop().await;
}

#[tokio::test]
async fn metrics_shows_request_durations_as_a_bucketed_histogram() {
    let running = Running::start().await;
    metrics::histogram!(names::MODEL_REQUEST_EXECUTION_DURATION_SECONDS, "model" => "endpoint-test")
        .record(0.3);
    let (_, _, body) = get(running.addr(), "/metrics").await;
    let name = names::MODEL_REQUEST_EXECUTION_DURATION_SECONDS;
    assert!(body.contains(&format!("# HELP {name} ")), "{body}");
    assert!(
        body.contains(&format!(
            r#"{name}_bucket{{model="endpoint-test",le="0.25"}} 0"#
        )),
        "{body}"
    );
    assert!(
        body.contains(&format!(
            r#"{name}_bucket{{model="endpoint-test",le="0.5"}} 1"#
        )),
        "{body}"
    );
    running.stop().await;
}

#[tokio::test]
async fn install_recorder_returns_the_same_recorder_every_time() {
    let first = install_recorder().expect("first install");
    let second = install_recorder().expect("second install");
    metrics::counter!(names::REQUESTS_ENQUEUED_TOTAL, "pool" => "idempotence-test").increment(7);
    let line = r#"batch_requests_enqueued_total{pool="idempotence-test"} 7"#;
    assert!(first.render().contains(line), "{}", first.render());
    assert!(second.render().contains(line), "{}", second.render());
}

#[tokio::test]
async fn other_paths_are_not_found_and_other_methods_not_allowed() {
    let running = Running::start().await;
    let addr = running.addr();
    for path in ["/", "/healthz", "/metrics/extra", "/READY"] {
        assert_eq!(get(addr, path).await.0, StatusCode::NOT_FOUND, "{path}");
    }
    let (status, headers, _) = request(addr, Method::POST, "/ready").await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(headers[ALLOW], "GET, HEAD");
    // Probes may add a query string; it does not change the route.
    assert_eq!(get(addr, "/health?probe=kubelet").await.0, StatusCode::OK);
    running.stop().await;
}

#[tokio::test]
async fn shutdown_closes_the_listener() {
    let running = Running::start().await;
    let addr = running.addr();
    assert_eq!(get(addr, "/health").await.0, StatusCode::OK);
    running.stop().await;
    let refused = TcpStream::connect(addr)
        .await
        .expect_err("listener should be closed");
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
}

#[tokio::test]
async fn shutdown_closes_idle_keep_alive_connections() {
    let running = Running::start().await;
    let mut stream = TcpStream::connect(running.addr()).await.unwrap();
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0; 1024];
    let n = stream.read(&mut buf).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    // The connection stays open (keep-alive) until shutdown, which must close it.
    running.stop().await;
    let mut rest = Vec::new();
    tokio::time::timeout(HANG_GUARD, stream.read_to_end(&mut rest))
        .await
        .expect("server closed the connection")
        .expect("clean EOF");
    assert!(rest.is_empty(), "no further bytes expected: {rest:?}");
}

#[tokio::test]
async fn shutdown_lets_a_request_in_progress_finish() {
    let running = Running::start().await;
    let addr = running.addr();
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: te")
        .await
        .unwrap();
    // Connections are accepted in order, so once a later one is answered the slow one is being served.
    assert_eq!(get(addr, "/health").await.0, StatusCode::OK);
    running.shutdown.cancel();
    slow.write_all(b"st\r\n\r\n").await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(HANG_GUARD, slow.read_to_end(&mut response))
        .await
        .expect("response and close")
        .expect("read");
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with("\r\n\r\nok"), "{response}");
    running.stop().await;
}

#[tokio::test]
async fn bind_failure_names_the_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let error = serve(
        addr,
        install_recorder().unwrap(),
        Readiness::default(),
        CancellationToken::new(),
    )
    .await
    .expect_err("address in use");
    assert!(
        matches!(error, ObservabilityError::Bind { addr: a, .. } if a == addr),
        "{error:?}"
    );
    assert_eq!(
        error.to_string(),
        format!("observability server: cannot bind {addr}: Address already in use (os error 98)")
    );
    // The cause is in the message once, not again as a source.
    assert!(std::error::Error::source(&error).is_none());
}
