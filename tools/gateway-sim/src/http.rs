//! The HTTP plumbing the gateway and `dispatcher-sim` share: a small HTTP/1 server whose
//! handlers may ask for the connection to be reset (TCP RST), and the client the dispatcher
//! posts with.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::SimError;

/// A full response.
pub type Resp = Response<Full<Bytes>>;

/// The HTTP client the dispatcher uses.
pub type Client = hyper_util::client::legacy::Client<HttpConnector, Full<Bytes>>;

/// What a handler wants done with a request.
pub enum Reply {
    /// Send this response.
    Response(Resp),
    /// Send this response's head now and its body as it is produced.
    Stream(Response<ChunkBody>),
    /// Send nothing and reset the TCP connection.
    Reset,
}

/// A response with a body and content type.
pub fn response(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Resp {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        resp.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    resp
}

/// A response body sent piece by piece: each piece given to the sender goes out when it comes
/// (as a chunk of chunked encoding); the body ends when the sender is dropped. A sender whose
/// send fails knows the client went away.
pub struct ChunkBody(mpsc::Receiver<Bytes>);

impl ChunkBody {
    /// A body and the sender that feeds it; `buffer` pieces may wait unsent.
    pub fn channel(buffer: usize) -> (mpsc::Sender<Bytes>, Self) {
        let (tx, rx) = mpsc::channel(buffer);
        (tx, Self(rx))
    }
}

impl Body for ChunkBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|piece| piece.map(|b| Ok(Frame::data(b))))
    }
}

/// A JSON response.
pub fn json(status: StatusCode, body: impl Into<Bytes>) -> Resp {
    response(status, "application/json", body)
}

/// Binds a TCP listener, naming the address on failure.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, SimError> {
    TcpListener::bind(addr)
        .await
        .map_err(|error| SimError::Bind { addr, error })
}

/// Serves HTTP/1 on `listener` until `token` is cancelled; each request goes to `handler`.
pub fn serve<H, F>(
    listener: TcpListener,
    token: CancellationToken,
    handler: Arc<H>,
) -> JoinHandle<()>
where
    H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Reply> + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = token.cancelled() => return,
                a = listener.accept() => a,
            };
            let stream = match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: pause instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(serve_connection(stream, token.clone(), handler.clone()));
        }
    })
}

async fn serve_connection<H, F>(stream: TcpStream, token: CancellationToken, handler: Arc<H>)
where
    H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Reply> + Send + 'static,
{
    let reset = Arc::new(AtomicBool::new(false));
    let io = TokioIo::new(ResetOnDrop {
        stream,
        reset: reset.clone(),
    });
    let service = hyper::service::service_fn(move |req| {
        let handler = handler.clone();
        let reset = reset.clone();
        async move {
            match handler(req).await {
                Reply::Response(resp) => Ok(resp.map(Either::Left)),
                Reply::Stream(resp) => Ok(resp.map(Either::Right)),
                Reply::Reset => {
                    reset.store(true, Ordering::SeqCst);
                    Err(ResetRequested)
                }
            }
        }
    });
    let conn = hyper::server::conn::http1::Builder::new().serve_connection(io, service);
    tokio::select! {
        _ = token.cancelled() => {}
        _ = conn => {}
    }
}

/// The service error that makes hyper drop the connection.
#[derive(Debug)]
struct ResetRequested;

impl std::fmt::Display for ResetRequested {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection reset requested")
    }
}

impl std::error::Error for ResetRequested {}

/// A TCP stream that closes with RST instead of FIN when asked to: that is what a crashed or
/// overloaded gateway looks like to the client.
struct ResetOnDrop {
    stream: TcpStream,
    reset: Arc<AtomicBool>,
}

impl Drop for ResetOnDrop {
    fn drop(&mut self) {
        if self.reset.load(Ordering::SeqCst) {
            let _ = self.stream.set_zero_linger();
        }
    }
}

impl AsyncRead for ResetOnDrop {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for ResetOnDrop {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// A pooled HTTP/1 client (plain HTTP only: the simulator talks to loopback gateways).
pub fn client() -> Client {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(connector)
}

/// An error with its causes (the product's own, so the simulators report errors as it does).
pub use batch_http_client::error_chain;
