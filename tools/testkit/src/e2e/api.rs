//! A service of the OpenAI-style API under test, as its clients see it: a config with a
//! `serve:` section, a small HTTP client ([`Api`]) and its answers ([`Resp`]), input files and
//! what storage holds. Whether the service runs in this process or as `processor serve` is the
//! test's choice: both listen on a loopback port.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// How long one HTTP exchange with the service may take on a loaded 2-core machine.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(60);

/// Appends a `serve:` section to the processor config at `config`: storage in `storage`, the
/// reaper every 200 ms, and, when `keys` is not empty, an API keys file of `(key, tenant)`
/// pairs. `serve_extra` holds more lines of the `serve:` section (indented by two spaces),
/// `top_extra` more top-level YAML (such as an `input:` section).
pub fn add_serve_section(
    config: &Path,
    storage: &Path,
    keys: &[(&str, &str)],
    serve_extra: &str,
    top_extra: &str,
) {
    let mut yaml = std::fs::read_to_string(config).expect("reading the processor config");
    if !yaml.ends_with('\n') {
        yaml.push('\n');
    }
    yaml.push_str(&format!(
        "serve:\n  storage: file://{}\n  reaper_interval: 200ms\n",
        storage.display()
    ));
    if !keys.is_empty() {
        let keys_file = config.with_file_name("api-keys");
        let mut text = String::from("# key tenant\n\n");
        for (key, tenant) in keys {
            text.push_str(&format!("{key} {tenant}\n"));
        }
        std::fs::write(&keys_file, text).expect("writing the api keys file");
        yaml.push_str(&format!("  api_keys_file: {}\n", keys_file.display()));
    }
    yaml.push_str(serve_extra);
    yaml.push_str(top_extra);
    std::fs::write(config, yaml).expect("writing the processor config");
}

/// An async-mode service config for `env` (model `llama-3` on pool `pool-a`, model `ghost`
/// nowhere), storage in `<env>/storage`.
pub fn async_service(
    env: &super::Env,
    keys: &[(&str, &str)],
    serve_extra: &str,
    top_extra: &str,
) -> PathBuf {
    let config = env.async_config(&[("llama-3", "pool-a")], "");
    let storage = env.path("storage");
    std::fs::create_dir_all(&storage).unwrap();
    add_serve_section(&config, &storage, keys, serve_extra, top_extra);
    config
}

/// An answer of the service.
#[derive(Debug)]
pub struct Resp {
    /// The HTTP status.
    pub status: u16,
    /// The answer's headers.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
}

impl Resp {
    /// The body as JSON; panics (showing the body) when it is not.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}), status {}: {}", self.status, self.text()))
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body's JSON after checking the status.
    #[track_caller]
    pub fn expect(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "body: {}", self.text());
        self.json()
    }

    /// Panics unless the answer has `status` and OpenAI's error shape
    /// `{"error":{"message","type","param","code"}}`; returns the `error` object.
    #[track_caller]
    pub fn expect_error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "body: {}", self.text());
        let body = self.json();
        let error = &body["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "no error.message: {body}"
        );
        assert!(error["type"].is_string(), "no error.type: {body}");
        let fields = error.as_object().unwrap();
        assert!(
            fields.contains_key("param") && fields.contains_key("code"),
            "error.param and error.code must be present (null allowed): {body}"
        );
        error.clone()
    }

    /// The body as JSON lines.
    pub fn jsonl(&self) -> Vec<Value> {
        self.text()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }
}

/// A client of the service's HTTP API.
#[derive(Clone)]
pub struct Api {
    base: String,
    key: Option<String>,
    /// Headers sent on every request (a proxy's user header, pass-through headers).
    always: Vec<(String, String)>,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Api {
    /// A client of `base` (`http://host:port`) sending `key` as its bearer token.
    pub fn new(base: &str, key: Option<&str>) -> Api {
        Api {
            base: base.trim_end_matches('/').to_owned(),
            key: key.map(str::to_owned),
            always: Vec::new(),
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    /// This client, also sending `name: value` on every request (once more for each call).
    pub fn with_header(&self, name: &str, value: &str) -> Api {
        let mut always = self.always.clone();
        always.push((name.to_owned(), value.to_owned()));
        Api {
            base: self.base.clone(),
            key: self.key.clone(),
            always,
            client: self.client.clone(),
        }
    }

    /// Sends one request; `path` starts with `/`. Panics when the service does not answer.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Resp {
        let m = method.clone();
        self.try_send(method, path, headers, body)
            .await
            .unwrap_or_else(|e| panic!("{m} {}{path}: {e}", self.base))
    }

    /// Like [`Api::send`], with an error instead of a panic when the service does not answer
    /// (within [`HTTP_TIMEOUT`]).
    pub async fn try_send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Result<Resp, String> {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        if let Some(key) = &self.key {
            req = req.header("authorization", format!("Bearer {key}"));
        }
        let always = self.always.iter().map(|(n, v)| (n.as_str(), v.as_str()));
        for (name, value) in always.chain(headers.iter().copied()) {
            req = req.header(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        let req = req.body(Full::new(body)).unwrap();
        let exchange = async {
            let resp = self.client.request(req).await?;
            let (parts, body) = resp.into_parts();
            let body = body.collect().await?.to_bytes();
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Resp {
                status: parts.status.as_u16(),
                headers: parts.headers,
                body,
            })
        };
        match tokio::time::timeout(HTTP_TIMEOUT, exchange).await {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => Err(format!("{e:?}")),
            Err(_) => Err(format!("no answer within {HTTP_TIMEOUT:?}")),
        }
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> Resp {
        self.send(Method::GET, path, &[], Bytes::new()).await
    }

    /// `DELETE path`.
    pub async fn delete(&self, path: &str) -> Resp {
        self.send(Method::DELETE, path, &[], Bytes::new()).await
    }

    /// `POST path` without a body.
    pub async fn post_empty(&self, path: &str) -> Resp {
        self.send(Method::POST, path, &[], Bytes::new()).await
    }

    /// `POST path` with a JSON body.
    pub async fn post_json(&self, path: &str, body: &Value) -> Resp {
        self.send(
            Method::POST,
            path,
            &[("content-type", "application/json")],
            Bytes::from(body.to_string()),
        )
        .await
    }

    /// `POST path` with a `multipart/form-data` body of `(name, filename, bytes)` parts (a
    /// filename makes it a file part).
    pub async fn post_multipart(&self, path: &str, parts: &[(&str, Option<&str>, &[u8])]) -> Resp {
        let boundary = "----servetests-boundary-7d1f3c";
        let mut body = Vec::new();
        for (name, filename, bytes) in parts {
            body.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
            match filename {
                Some(f) => body.extend_from_slice(
                    format!(
                        "Content-Disposition: form-data; name=\"{name}\"; filename=\"{f}\"\r\n\
                         Content-Type: application/octet-stream\r\n\r\n"
                    )
                    .as_bytes(),
                ),
                None => body.extend_from_slice(
                    format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes(),
                ),
            }
            body.extend_from_slice(bytes);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        let content_type = format!("multipart/form-data; boundary={boundary}");
        self.send(
            Method::POST,
            path,
            &[("content-type", &content_type)],
            Bytes::from(body),
        )
        .await
    }

    /// Uploads `bytes` as a batch input file named `filename`, expiring after `expires` seconds
    /// when given; returns the answer as it came.
    pub async fn upload(&self, filename: &str, bytes: &[u8], expires: Option<u64>) -> Resp {
        let seconds = expires.map(|s| s.to_string());
        let mut parts: Vec<(&str, Option<&str>, &[u8])> =
            vec![("purpose", None, b"batch"), ("file", Some(filename), bytes)];
        if let Some(s) = &seconds {
            parts.push(("expires_after[anchor]", None, b"created_at"));
            parts.push(("expires_after[seconds]", None, s.as_bytes()));
        }
        self.post_multipart("/v1/files", &parts).await
    }

    /// Uploads `bytes` and returns the new file's id; panics unless the upload succeeded.
    pub async fn upload_ok(&self, filename: &str, bytes: &[u8]) -> String {
        let file = self.upload(filename, bytes, None).await.expect(200);
        file["id"].as_str().expect("a file id").to_owned()
    }

    /// Creates a `/v1/chat/completions` batch of `file_id`, completion window `window`; returns
    /// the answer as it came.
    pub async fn create_batch(&self, file_id: &str, window: &str) -> Resp {
        self.post_json(
            "/v1/batches",
            &serde_json::json!({
                "input_file_id": file_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": window,
            }),
        )
        .await
    }

    /// Creates a batch and returns it; panics unless that succeeded.
    pub async fn create_batch_ok(&self, file_id: &str) -> Value {
        self.create_batch(file_id, "24h").await.expect(200)
    }

    /// `GET /v1/batches/{id}`, which must succeed.
    pub async fn batch(&self, id: &str) -> Value {
        self.get(&format!("/v1/batches/{id}")).await.expect(200)
    }

    /// Polls the batch every 100 ms until `done` holds for it, for at most `limit`; returns it.
    pub async fn wait_batch(
        &self,
        id: &str,
        limit: Duration,
        what: &str,
        mut done: impl FnMut(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            let batch = self.batch(id).await;
            if done(&batch) {
                return batch;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {limit:?} waiting for {what}; the batch: {batch}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the batch reaches a final status (`completed`, `failed`, `expired`,
    /// `cancelled`) and returns it.
    pub async fn wait_final(&self, id: &str, limit: Duration) -> Value {
        self.wait_batch(id, limit, "a final status", |b| {
            is_final(b["status"].as_str().unwrap_or(""))
        })
        .await
    }

    /// `POST /v1/batches/{id}/cancel`, which must succeed; returns the batch.
    pub async fn cancel(&self, id: &str) -> Value {
        self.post_empty(&format!("/v1/batches/{id}/cancel"))
            .await
            .expect(200)
    }

    /// The JSON lines of file `id`'s content (none when `id` is null).
    pub async fn file_lines(&self, id: &Value) -> Vec<Value> {
        match id.as_str() {
            Some(id) => {
                let resp = self.get(&format!("/v1/files/{id}/content")).await;
                assert_eq!(resp.status, 200, "content of {id}: {}", resp.text());
                resp.jsonl()
            }
            None => Vec::new(),
        }
    }

    /// The output and error lines of a finished batch, read through its files.
    pub async fn results(&self, batch: &Value) -> super::Results {
        super::Results {
            output: self.file_lines(&batch["output_file_id"]).await,
            error: self.file_lines(&batch["error_file_id"]).await,
        }
    }

    /// GETs one page of a listing at `path` and checks it holds exactly `ids`, with
    /// `first_id`, `last_id` and `has_more` to match.
    pub async fn expect_page(&self, path: &str, ids: &[String], has_more: bool) {
        let page = self.get(path).await.expect(200);
        let got: Vec<&str> = page["data"]
            .as_array()
            .expect("a data array")
            .iter()
            .map(|item| item["id"].as_str().expect("an id"))
            .collect();
        assert_eq!(got, ids, "{path}: {page}");
        assert_eq!(page["has_more"], has_more, "{path}: {page}");
        assert_eq!(
            page["first_id"],
            serde_json::json!(ids.first()),
            "{path}: {page}"
        );
        assert_eq!(
            page["last_id"],
            serde_json::json!(ids.last()),
            "{path}: {page}"
        );
    }

    /// Checks that `after=cursor` on `route` is a 400 naming `after` and the cursor.
    pub async fn expect_unknown_cursor(&self, route: &str, cursor: &str) {
        let error = self
            .get(&format!("{route}?after={cursor}"))
            .await
            .expect_error(400);
        assert_eq!(error["param"], "after", "{error}");
        assert!(
            error["message"].as_str().unwrap().contains(cursor),
            "{error}"
        );
    }

    /// Every item of a list route (`/v1/files` or `/v1/batches`, with `query` such as
    /// `order=asc`), page by page of `limit`, following `after` while `has_more`.
    pub async fn list_all(&self, route: &str, query: &str, limit: usize) -> Vec<Value> {
        let mut all = Vec::new();
        let mut after: Option<String> = None;
        for _ in 0..10_000 {
            let mut q = format!("limit={limit}");
            if !query.is_empty() {
                q.push('&');
                q.push_str(query);
            }
            if let Some(a) = &after {
                q.push_str(&format!("&after={a}"));
            }
            let page = self.get(&format!("{route}?{q}")).await.expect(200);
            let data = page["data"].as_array().expect("a data array").clone();
            assert!(data.len() <= limit, "a page longer than its limit: {page}");
            let more = page["has_more"].as_bool().expect("has_more");
            if let Some(last) = data.last() {
                assert_eq!(page["last_id"], last["id"], "{page}");
                assert_eq!(page["first_id"], data[0]["id"], "{page}");
            }
            after = data.last().map(|l| l["id"].as_str().unwrap().to_owned());
            all.extend(data);
            if !more {
                return all;
            }
            assert!(after.is_some(), "has_more on an empty page: {page}");
        }
        panic!("{route} never ended its pages");
    }
}

/// Whether a batch status is final: `completed`, `failed`, `expired` or `cancelled`.
pub fn is_final(status: &str) -> bool {
    matches!(status, "completed" | "failed" | "expired" | "cancelled")
}

/// The ids of the items of a list.
pub fn ids(items: &[Value]) -> Vec<String> {
    items
        .iter()
        .map(|i| i["id"].as_str().expect("an id").to_owned())
        .collect()
}

/// `n` chat requests as JSONL (`custom_id` `<prefix>-<i>`, model `model`) and their lines.
pub fn input_jsonl(prefix: &str, n: usize, model: &str) -> (String, Vec<String>) {
    let lines: Vec<String> = (0..n)
        .map(|i| {
            serde_json::json!({
                "custom_id": format!("{prefix}-{i}"),
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [
                        {"role": "system", "content": "You are terse."},
                        {"role": "user", "content": format!("{prefix} question {i}")}
                    ],
                    "max_tokens": 8
                }
            })
            .to_string()
        })
        .collect();
    (lines.join("\n") + "\n", lines)
}

/// Every regular file under `dir`, recursively.
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(path),
                Ok(t) if t.is_file() => out.push(path),
                _ => {}
            }
        }
    }
    out
}

/// The files under `dir` whose content is exactly `bytes`.
pub fn stored_copies(dir: &Path, bytes: &[u8]) -> Vec<PathBuf> {
    files_under(dir)
        .into_iter()
        .filter(|p| std::fs::read(p).is_ok_and(|b| b == bytes))
        .collect()
}
