//! A `processor serve` child process and an HTTP client of its API, for the serve scenarios.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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

/// How long the service may take to print its `listening on` line.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the service may take to exit after SIGTERM (the interface promises 10 s).
const STOP_TIMEOUT: Duration = Duration::from_secs(15);
/// Chunks the upload body is read from disk in.
const UPLOAD_CHUNK: usize = 256 * 1024;

/// A running `processor serve`, killed when dropped (and when the bench dies:
/// `PR_SET_PDEATHSIG`).
pub(crate) struct Service {
    child: Option<Child>,
    base: String,
    log: PathBuf,
}

impl Service {
    /// Starts `processor serve --config CONFIG --listen 127.0.0.1:0` with its log in `log`
    /// and waits for its `listening on http://…` line.
    ///
    /// Spawned from an async worker thread, not a blocking one: `PR_SET_PDEATHSIG` follows the
    /// thread that spawned the child, and blocking threads exit when idle.
    pub(crate) async fn start(
        processor: &Path,
        config: &Path,
        log: &Path,
    ) -> Result<Self, BenchError> {
        let stderr = std::fs::File::create(log).map_err(|e| BenchError::io(log, e))?;
        let mut cmd = Command::new(processor);
        cmd.arg("serve")
            .arg("--config")
            .arg(config)
            .args(["--listen", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        // Only the config file decides: no PROCESSOR_* override from the caller's environment.
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("PROCESSOR_") {
                cmd.env_remove(key);
            }
        }
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| BenchError::Tool(format!("{} serve: {e}", processor.display())))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut first = String::new();
            let _ = reader.read_line(&mut first);
            let _ = tx.send(first);
            // Keep reading so a later write to stdout never fails.
            let _ = std::io::copy(&mut reader, &mut std::io::sink());
        });
        let mut service = Self {
            child: Some(child),
            base: String::new(),
            log: log.to_owned(),
        };
        let deadline = Instant::now() + START_TIMEOUT;
        let line = loop {
            match tokio::time::timeout(Duration::from_millis(50), &mut rx).await {
                Ok(Ok(line)) => break line,
                Err(_) if Instant::now() < deadline => {
                    if let Some(status) = service.exited() {
                        return Err(service.failed(&format!("exited ({status}) before listening")));
                    }
                }
                _ => return Err(service.failed("printed no `listening on` line")),
            }
        };
        match line.trim().strip_prefix("listening on ") {
            Some(url) if url.starts_with("http://127.0.0.1:") => {
                service.base = url.trim_end_matches('/').to_owned();
                Ok(service)
            }
            _ => Err(service.failed(&format!(
                "printed {:?} instead of `listening on http://127.0.0.1:PORT`",
                line.trim()
            ))),
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// The service's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The exit status, if it has exited.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    /// An error naming what went wrong, with the end of the service's log; kills it.
    fn failed(&mut self, what: &str) -> BenchError {
        self.kill();
        BenchError::Tool(format!(
            "processor serve {what}; last lines of its log ({}):\n{}",
            self.log.display(),
            log_tail(&self.log)
        ))
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends SIGTERM and waits for the exit (blocking, at most [`STOP_TIMEOUT`]); fails
    /// unless it exits 0 in time (then it is killed).
    pub(crate) fn stop(mut self) -> Result<Duration, BenchError> {
        let Some(child) = self.child.as_mut() else {
            return Ok(Duration::ZERO);
        };
        let started = Instant::now();
        // SAFETY: plain syscall on our own child's pid, which is not reaped yet.
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
        }
        loop {
            match child.try_wait() {
                Ok(Some(status)) if status.success() => {
                    self.child = None;
                    return Ok(started.elapsed());
                }
                Ok(Some(status)) => {
                    self.child = None;
                    return Err(BenchError::Tool(format!(
                        "processor serve exited {status} after SIGTERM; last lines of its log ({}):\n{}",
                        self.log.display(),
                        log_tail(&self.log)
                    )));
                }
                Ok(None) if started.elapsed() < STOP_TIMEOUT => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    return Err(
                        self.failed(&format!("did not exit within {STOP_TIMEOUT:?} of SIGTERM"))
                    )
                }
            }
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The last 15 lines of a log file.
fn log_tail(path: &Path) -> String {
    let mut text = String::new();
    if let Ok(mut f) = std::fs::File::open(path) {
        let _ = f.read_to_string(&mut text);
    }
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// `VmRSS` and `VmHWM` of `pid`, MiB.
pub(crate) fn rss_mib(pid: u32) -> Option<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?;
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<f64>()
                .ok()
        })
    };
    Some((field("VmRSS:")? / 1024.0, field("VmHWM:")? / 1024.0))
}

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
        let bytes = Bytes::from(body.to_string());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_of_this_process_is_read_from_proc() {
        let ballast = vec![1u8; 64 << 20];
        let (rss, hwm) = rss_mib(std::process::id()).expect("/proc/self/status");
        assert!(rss >= 64.0, "VmRSS {rss} MiB with 64 MiB in use");
        assert!(hwm >= rss, "VmHWM {hwm} below VmRSS {rss}");
        assert_eq!(ballast.iter().map(|&b| b as usize).sum::<usize>(), 64 << 20);
        assert!(rss_mib(u32::MAX).is_none());
    }

    #[tokio::test]
    async fn a_program_that_prints_no_listening_line_is_an_error_with_its_log() {
        let dir = batch_testkit::tempdir().unwrap();
        let script = dir.path().join("fake-processor");
        std::fs::write(
            &script,
            "#!/bin/sh\necho 'refused: bad config' >&2\necho nope\n",
        )
        .unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let log = dir.path().join("log");
        let err = Service::start(&script, Path::new("c.yaml"), &log)
            .await
            .err()
            .expect("no listening line")
            .to_string();
        assert!(
            err.contains("\"nope\"") && err.contains("refused: bad config"),
            "{err}"
        );
    }
}
