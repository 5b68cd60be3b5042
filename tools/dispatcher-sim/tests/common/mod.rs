//! Helpers shared by the integration tests: a Redis client, envelopes, a rig of Redis, gateway
//! and client; polling and plain HTTP come from the shared test kit.
#![allow(dead_code, unused_imports)]

pub use batch_testkit::http::{eventually, get, post};

use std::future::Future;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use batch_testkit::RedisServer;
use batch_wire::ResultMessage;
use bytes::Bytes;
use dispatcher_sim::{
    Dispatcher, DispatcherConfig, DispatcherHandle, DispatcherVersion, Gateway, GatewayConfig,
    GatewayHandle, QueueEntry,
};
use fred::prelude::{Client, KeysInterface, ListInterface, SortedSetsInterface};
use http_body_util::{BodyExt, Full};
use hyper::header::HeaderMap;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

pub const QUEUE: &str = "llm-d-async:requests:pool-a";

/// Redis, a gateway, a client; a dispatcher serving [`QUEUE`] at the gateway is started per test.
/// Each suite adds its version's own helpers in an `impl Rig` of its file.
pub struct Rig {
    pub redis: RedisServer,
    pub client: Client,
    pub gw: GatewayHandle,
}

/// The simulated gateway on a free loopback port.
pub async fn gateway(config: GatewayConfig) -> GatewayHandle {
    Gateway::start("127.0.0.1:0".parse().unwrap(), config)
        .await
        .unwrap()
}

impl Rig {
    pub async fn new(gw_config: GatewayConfig) -> Self {
        let redis = RedisServer::start();
        let client = redis_client(&redis.url()).await;
        let gw = gateway(gw_config).await;
        Rig { redis, client, gw }
    }

    /// [`QUEUE`]'s entry, at the gateway.
    pub fn entry(&self) -> QueueEntry {
        entry(QUEUE, &self.gw.base_url())
    }

    pub async fn start(&self, config: DispatcherConfig) -> DispatcherHandle {
        Dispatcher::start(config, None).await.unwrap()
    }

    /// Adds an envelope of `payload` to [`QUEUE`] whose results go to `results`.
    pub async fn enqueue_to(
        &self,
        id: &str,
        deadline: i64,
        payload: &str,
        results: &str,
    ) -> String {
        enqueue(
            &self.client,
            QUEUE,
            id,
            deadline,
            payload,
            &internal_to(results),
        )
        .await
    }
}

/// An `internal` block routing results to `results`.
pub fn internal_to(results: &str) -> String {
    format!(r#"{{"request_token":"t","result_queue_name":"{results}"}}"#)
}

/// Unix seconds now.
pub fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// A connected Redis client for assertions and set-up.
pub async fn redis_client(url: &str) -> Client {
    batch_redis::connect(url, &Default::default())
        .await
        .unwrap()
}

/// A valid envelope; `internal` is the JSON object text of the internal block.
pub fn envelope(id: &str, deadline: i64, payload: &str, internal: &str) -> String {
    format!(
        r#"{{"internal":{internal},"request_kind":"plain","data":{{"id":"{id}","created":{},"deadline":{deadline},"payload":{payload},"metadata":{{"job_id":"job","request_index":"1"}}}}}}"#,
        now()
    )
}

/// A chat payload with a distinct prompt, written as Go's encoder writes it (keys sorted,
/// compact), so the gateway receives these very bytes after the dispatcher re-encodes them.
pub fn chat(prompt: &str) -> String {
    format!(r#"{{"max_tokens":4,"messages":[{{"content":"{prompt}","role":"user"}}],"model":"m"}}"#)
}

/// A `redis` gate as the real dispatcher accepts it (with `address`), reading `key`.
pub fn redis_gate(entry: &mut QueueEntry, redis_url: &str, key: &str) {
    entry.gate_type = Some("redis".into());
    let address = redis_url
        .trim_start_matches("redis://")
        .trim_end_matches('/');
    entry
        .gate_params
        .insert("address".into(), address.to_owned());
    entry
        .gate_params
        .insert("budget_key".into(), key.to_owned());
}

pub async fn zadd(client: &Client, key: &str, score: f64, member: &str) {
    let _: i64 = client
        .zadd(key, None, None, false, false, (score, member))
        .await
        .unwrap();
}

/// Adds an envelope at its deadline score, as the real producer does.
pub async fn enqueue(
    client: &Client,
    key: &str,
    id: &str,
    deadline: i64,
    payload: &str,
    internal: &str,
) -> String {
    let member = envelope(id, deadline, payload, internal);
    zadd(client, key, deadline as f64, &member).await;
    member
}

pub async fn zcard(client: &Client, key: &str) -> i64 {
    client.zcard(key).await.unwrap()
}

pub async fn llen(client: &Client, key: &str) -> i64 {
    client.llen(key).await.unwrap()
}

pub async fn set(client: &Client, key: &str, value: &str) {
    let _: () = client.set(key, value, None, None, false).await.unwrap();
}

/// Pops `n` results (oldest first), failing after `timeout`.
pub async fn results(
    client: &Client,
    list: &str,
    n: usize,
    timeout: Duration,
) -> Vec<ResultMessage> {
    let until = Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < n {
        let raw: Option<String> = client.rpop(list, None).await.unwrap();
        match raw {
            Some(r) => {
                assert!(!r.contains("\"metadata\""), "a result echoed metadata: {r}");
                out.push(ResultMessage::parse(&r).unwrap());
            }
            None => {
                assert!(
                    Instant::now() < until,
                    "only {} of {n} results on {list} after {timeout:?}",
                    out.len()
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    out
}

/// A v0.9 dispatcher configuration that runs fast: 50 ms polls, backoffs scaled by 0.01. The
/// tests of `dispatcher.rs` pin v0.9 behaviour; `fast_v0_10` is for those of v0.10.
pub fn fast(redis_url: &str, queues: Vec<QueueEntry>) -> DispatcherConfig {
    let mut c = DispatcherConfig::new(redis_url, queues);
    c.version = DispatcherVersion::V0_9;
    c.poll_interval = Duration::from_millis(50);
    c.sim.time_scale = 0.01;
    c.sim.seed = Some(42);
    c.shutdown_grace = Duration::from_secs(2);
    c
}

/// As [`fast`], behaving like v0.10.
pub fn fast_v0_10(redis_url: &str, queues: Vec<QueueEntry>) -> DispatcherConfig {
    let mut c = fast(redis_url, queues);
    c.version = DispatcherVersion::V0_10;
    c
}

/// A queue entry pointing at `base_url`.
pub fn entry(queue: &str, base_url: &str) -> QueueEntry {
    QueueEntry {
        igw_base_url: Some(base_url.to_owned()),
        request_path_url: Some("/v1/chat/completions".into()),
        ..QueueEntry::new(queue)
    }
}
