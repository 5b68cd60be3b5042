//! A keep-alive HTTP/1 client of the service's API.

use std::path::Path;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::io::AsyncReadExt;

use crate::BenchError;

/// Chunks the upload body is read from disk in.
const UPLOAD_CHUNK: usize = 256 * 1024;

/// The body every request of the client carries.
type Body = BoxBody<Bytes, std::io::Error>;

/// A keep-alive HTTP/1 client of the service's API.
#[derive(Clone)]
pub(crate) struct Api {
    client: Client<HttpConnector, Body>,
    base: String,
}

/// A finished request: status and body.
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) body: Bytes,
}

impl Reply {
    /// The body as JSON, or an error naming `what` unless the status is 200.
    pub(crate) fn json(self, what: &str) -> Result<Value, BenchError> {
        if self.status != StatusCode::OK {
            return Err(BenchError::Tool(format!(
                "{what}: {} {}",
                self.status,
                String::from_utf8_lossy(&self.body[..self.body.len().min(500)])
            )));
        }
        serde_json::from_slice(&self.body)
            .map_err(|e| BenchError::Tool(format!("{what}: the reply is not JSON: {e}")))
    }
}

impl Api {
    /// A client of `base` (`http://127.0.0.1:PORT`) keeping up to `idle` connections open.
    pub(crate) fn new(base: &str, idle: usize) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(idle)
            .build(connector);
        Self {
            client,
            base: base.to_owned(),
        }
    }

    /// Sends one request; `what` names it in errors.
    async fn send(
        &self,
        what: &str,
        request: Request<Body>,
        timeout: Duration,
    ) -> Result<Reply, BenchError> {
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| BenchError::Tool(format!("{what}: {e}")))?;
            let status = response.status();
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| BenchError::Tool(format!("{what}: reading the reply: {e}")))?
                .to_bytes();
            Ok(Reply { status, body })
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| BenchError::Tool(format!("{what}: no reply within {timeout:?}")))?
    }

    fn request(&self, method: Method, path: &str, body: Body) -> Request<Body> {
        Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .body(body)
            .expect("a valid request")
    }

    /// `GET path`.
    pub(crate) async fn get(&self, path: &str) -> Result<Reply, BenchError> {
        let req = self.request(Method::GET, path, empty());
        self.send(&format!("GET {path}"), req, Duration::from_secs(60))
            .await
    }

    /// `DELETE path`.
    pub(crate) async fn delete(&self, path: &str) -> Result<Reply, BenchError> {
        let req = self.request(Method::DELETE, path, empty());
        self.send(&format!("DELETE {path}"), req, Duration::from_secs(60))
            .await
    }

    /// `POST path` with a JSON body.
    pub(crate) async fn post_json(&self, path: &str, body: &Value) -> Result<Reply, BenchError> {
        self.post_json_bytes(path, Bytes::from(body.to_string()))
            .await
    }

    /// `POST path` with a JSON body given as its bytes.
    pub(crate) async fn post_json_bytes(
        &self,
        path: &str,
        bytes: Bytes,
    ) -> Result<Reply, BenchError> {
        let mut req = self.request(Method::POST, path, full(bytes));
        req.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        self.send(&format!("POST {path}"), req, Duration::from_secs(60))
            .await
    }

    /// `POST /v1/files` (purpose `batch`) with `file` streamed from disk as the multipart
    /// part `file`; the File object.
    pub(crate) async fn upload(&self, file: &Path, timeout: Duration) -> Result<Value, BenchError> {
        let len = std::fs::metadata(file)
            .map_err(|e| BenchError::io(file, e))?
            .len();
        let boundary = format!("bench-boundary-{:016x}", rand_u64());
        let name = file
            .file_name()
            .map_or("input.jsonl".into(), |n| n.to_string_lossy().into_owned());
        let head = Bytes::from(format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
             --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n\
             Content-Type: application/jsonl\r\n\r\n"
        ));
        let tail = Bytes::from(format!("\r\n--{boundary}--\r\n"));
        let total = head.len() as u64 + len + tail.len() as u64;
        let reader = tokio::fs::File::open(file)
            .await
            .map_err(|e| BenchError::io(file, e))?;
        let chunks = futures::stream::unfold(Some(reader), |reader| async move {
            let mut reader = reader?;
            let mut buf = BytesMut::with_capacity(UPLOAD_CHUNK);
            match reader.read_buf(&mut buf).await {
                Ok(0) => None,
                Ok(_) => Some((Ok(buf.freeze()), Some(reader))),
                Err(e) => Some((Err(e), None)),
            }
        });
        use futures::StreamExt;
        let stream = futures::stream::once(async move { Ok(head) })
            .chain(chunks)
            .chain(futures::stream::once(async move { Ok(tail) }))
            .map(|chunk: Result<Bytes, std::io::Error>| chunk.map(Frame::data));
        let mut req = self.request(
            Method::POST,
            "/v1/files",
            BodyExt::boxed(StreamBody::new(stream)),
        );
        let headers = req.headers_mut();
        headers.insert(
            hyper::header::CONTENT_TYPE,
            format!("multipart/form-data; boundary={boundary}")
                .parse()
                .expect("a valid header"),
        );
        headers.insert(hyper::header::CONTENT_LENGTH, total.into());
        let what = format!("POST /v1/files ({}, {len} bytes)", file.display());
        self.send(&what, req, timeout).await?.json(&what)
    }

    /// Every batch, through the list's cursor pages of 100.
    pub(crate) async fn all_batches(&self) -> Result<Vec<Value>, BenchError> {
        let mut all = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let path = match &after {
                None => "/v1/batches?limit=100".to_owned(),
                Some(id) => format!("/v1/batches?limit=100&after={id}"),
            };
            let page = self.get(&path).await?.json(&format!("GET {path}"))?;
            let data = page["data"].as_array().cloned().unwrap_or_default();
            let last = data
                .last()
                .and_then(|b| b["id"].as_str())
                .map(str::to_owned);
            all.extend(data);
            match (page["has_more"].as_bool(), last) {
                (Some(true), Some(last)) if after.as_deref() != Some(&last) => after = Some(last),
                (Some(true), _) => {
                    return Err(BenchError::Tool(format!(
                        "GET {path}: has_more without a new last id"
                    )))
                }
                _ => return Ok(all),
            }
        }
    }
}

fn empty() -> Body {
    full(Bytes::new())
}

fn full(bytes: Bytes) -> Body {
    Full::new(bytes).map_err(|never| match never {}).boxed()
}

/// A random number for multipart boundaries.
fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}
