//! Plain HTTP against a server under test, and polling: for tests that talk to a simulator or a
//! service on 127.0.0.1.

use std::future::Future;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::HeaderMap;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Waits until `check` returns true, failing with `what` after `timeout`.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let until = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < until, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A plain-HTTP client.
fn http_client() -> hyper_util::client::legacy::Client<HttpConnector, Full<Bytes>> {
    hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// POSTs `body`; `Err` when no response came back.
pub async fn post(
    url: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> Result<(u16, HeaderMap, String), String> {
    let mut req = hyper::Request::post(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
        .unwrap();
    let resp = http_client()
        .request(req)
        .await
        .map_err(|e| format!("{e:?}"))?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, headers, String::from_utf8_lossy(&body).into_owned()))
}

/// GETs `url`: its status and body as text (panics when no response came back).
pub async fn get(url: &str) -> (u16, String) {
    let req = hyper::Request::get(url)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = http_client().request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}
