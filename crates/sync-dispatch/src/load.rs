//! Yielding to online traffic: the endpoint's concurrency follows the room the pool's model
//! servers have left, read from their own metrics, instead of waiting for latency or 429s
//! that only come after online requests were already queued behind the batch.
//!
//! Every `interval` the endpoint reads each model server's `vllm:num_requests_running` and
//! `vllm:num_requests_waiting` (from the servers' `/metrics` pages, or from Prometheus), and
//! [`Yield`] turns them into the batch's limit:
//!
//! ```text
//! online = running + waiting - the batch's own requests in flight
//! limit  = capacity × (1 - headroom) - online        (at least 1, at most the global limit)
//! ```
//!
//! The capacity is `max_running_per_pod` × pods when configured; otherwise it is learnt: a
//! server only queues when it runs all it can, so a pod's running count while it has requests
//! waiting is its capacity (vLLM's `max_num_seqs`, or less when the KV cache is the bound).
//! Until a pod has queued once, the limit grows by a quarter per reading from the limiter's
//! floor (`concurrency.aimd.min`), as long as nothing waits. A reading that fails, or none for three
//! intervals, hands the endpoint back to its limiter (with one warning) until readings come
//! again.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Uri;

use crate::client::HttpClient;

/// vLLM's gauge of the requests in the running batch.
pub const RUNNING: &str = "vllm:num_requests_running";
/// vLLM's gauge of the requests waiting in its queue.
pub const WAITING: &str = "vllm:num_requests_waiting";

/// Where the pool's load is read, and how much the batch leaves free (`model_gateways.<m>.load`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadOptions {
    /// The model servers' own metrics pages (`http://pod:8000/metrics`), one per pod.
    pub metrics_urls: Vec<String>,
    /// Prometheus, instead of `metrics_urls`: the series of `pool` are read, one per pod.
    pub prometheus_url: Option<String>,
    /// The `inference_pool` label of the pool's series in Prometheus.
    pub pool: Option<String>,
    /// Requests one pod runs at once (vLLM's `max_num_seqs`); learnt when absent.
    pub max_running_per_pod: Option<usize>,
    /// How often the load is read.
    pub interval: Duration,
    /// The share of the pool's capacity the batch leaves free for online requests to arrive
    /// into without waiting, in [0, 1).
    pub headroom: f64,
    /// Sent as the body's `priority` (vLLM: lower is served first; online requests have 0),
    /// unless the body has one, so that a server scheduling by priority serves online first.
    pub priority: Option<i64>,
}

impl Default for LoadOptions {
    /// No source; every 100 ms; 15 % headroom; no priority.
    fn default() -> Self {
        Self {
            metrics_urls: Vec::new(),
            prometheus_url: None,
            pool: None,
            max_running_per_pod: None,
            interval: Duration::from_millis(100),
            headroom: 0.15,
            priority: None,
        }
    }
}

impl LoadOptions {
    /// Exactly one source, URLs that parse, a headroom in [0, 1), an interval above 0.
    pub(crate) fn validate(&self) -> Result<(), String> {
        match (self.metrics_urls.is_empty(), &self.prometheus_url) {
            (true, None) => return Err("load needs metrics_urls or prometheus_url".into()),
            (false, Some(_)) => {
                return Err("load takes metrics_urls or prometheus_url, not both".into())
            }
            (true, Some(_)) if self.pool.is_none() => {
                return Err("load.prometheus_url needs load.pool (the inference_pool label)".into())
            }
            _ => {}
        }
        for url in self.metrics_urls.iter().chain(&self.prometheus_url) {
            let uri: Uri = url.parse().map_err(|e| format!("load URL {url:?}: {e}"))?;
            if !matches!(uri.scheme_str(), Some("http" | "https")) {
                return Err(format!("load URL {url:?} must be http:// or https://"));
            }
        }
        if !(0.0..1.0).contains(&self.headroom) {
            return Err(format!(
                "load.headroom must be in [0, 1), got {}",
                self.headroom
            ));
        }
        if self.interval.is_zero() {
            return Err("load.interval must be above 0".into());
        }
        if self.max_running_per_pod == Some(0) {
            return Err("load.max_running_per_pod must be at least 1".into());
        }
        Ok(())
    }
}

/// One pod's load at a reading.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PodLoad {
    /// Requests running.
    pub running: f64,
    /// Requests waiting in the server's queue.
    pub waiting: f64,
}

/// Turns readings into the batch's limit; pure, so that its rule can be tested alone.
#[derive(Debug, Clone)]
pub struct Yield {
    configured: Option<usize>,
    headroom: f64,
    max: usize,
    /// A pod's capacity as last seen at a pod with requests waiting.
    learnt: Option<f64>,
    /// Readings in a row with nothing waiting anywhere while some pod ran at `learnt`.
    full_without_queue: u32,
    /// The limit before any pod queued.
    probing: usize,
}

/// Readings with nothing waiting at a pod running its learnt capacity before that capacity
/// is taken to be one more (the KV cache, which bounds it below `max_num_seqs`, frees up).
const RELEARN_AFTER: u32 = 20;

impl Yield {
    /// A rule with the configured per-pod capacity (if any), the headroom, the highest limit
    /// it may give and the limit to start probing from.
    pub fn new(configured: Option<usize>, headroom: f64, max: usize, start: usize) -> Self {
        Self {
            configured,
            headroom,
            max: max.max(1),
            learnt: None,
            full_without_queue: 0,
            probing: start.clamp(1, max.max(1)),
        }
    }

    /// The pods' capacity in total, when known.
    pub fn capacity(&self, pods: usize) -> Option<f64> {
        let per_pod = self.configured.map(|c| c as f64).or(self.learnt)?;
        Some(per_pod * pods as f64)
    }

    /// The batch's limit after a reading of every pod, with `ours` of the batch's requests in
    /// flight at the endpoint.
    pub fn limit(&mut self, pods: &[PodLoad], ours: usize) -> usize {
        self.learn(pods);
        let running: f64 = pods.iter().map(|p| p.running).sum();
        let waiting: f64 = pods.iter().map(|p| p.waiting).sum();
        let Some(capacity) = self.capacity(pods.len()) else {
            if waiting == 0.0 {
                self.probing = (self.probing + self.probing.div_ceil(4)).min(self.max);
            }
            return self.probing;
        };
        let online = (running + waiting - ours as f64).max(0.0);
        let room = (capacity * (1.0 - self.headroom) - online).floor();
        (room.max(1.0) as usize).min(self.max)
    }

    fn learn(&mut self, pods: &[PodLoad]) {
        if self.configured.is_some() {
            return;
        }
        let queued = pods.iter().filter(|p| p.waiting > 0.0);
        if let Some(seen) = queued.map(|p| p.running).reduce(f64::max) {
            if seen >= 1.0 {
                self.learnt = Some(seen);
            }
            self.full_without_queue = 0;
            return;
        }
        let Some(learnt) = self.learnt else { return };
        if pods.iter().any(|p| p.running >= learnt) {
            self.full_without_queue += 1;
            if self.full_without_queue >= RELEARN_AFTER {
                self.learnt = Some(learnt + 1.0);
                self.full_without_queue = 0;
            }
        }
    }
}

/// Reads every pod's load once: the metrics pages, or Prometheus.
///
/// With Prometheus the counts are as old as its last scrape, which the answer's time says
/// (`timestamp()`, the oldest pod's); the caller then takes off the batch's requests in flight
/// at that time, not now, or a reading a second old would count the batch's newest requests
/// as gone. A metrics page is read now: no time.
pub(crate) async fn read(
    client: &HttpClient,
    options: &LoadOptions,
    timeout: Duration,
) -> Result<(Vec<PodLoad>, Option<SystemTime>), String> {
    let fetch = async {
        if let (Some(prometheus), Some(pool)) = (&options.prometheus_url, &options.pool) {
            return from_prometheus(client, prometheus, pool).await;
        }
        let mut pods = Vec::with_capacity(options.metrics_urls.len());
        for url in &options.metrics_urls {
            let page = get(client, url).await?;
            pods.push(parse_page(&page).map_err(|e| format!("{url}: {e}"))?);
        }
        Ok((pods, None))
    };
    tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| format!("no answer within {timeout:?}"))?
}

async fn get(client: &HttpClient, url: &str) -> Result<String, String> {
    let uri: Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let request = hyper::Request::get(uri)
        .body(Full::new(Bytes::new()))
        .map_err(|e| format!("{url}: {e}"))?;
    let response = client
        .request(request)
        .await
        .map_err(|e| format!("{url}: {}", batch_http_client::error_chain(&e)))?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("{url}: reading the answer: {e}"))?
        .to_bytes();
    if !status.is_success() {
        return Err(format!("{url}: HTTP {status}"));
    }
    String::from_utf8(body.to_vec()).map_err(|_| format!("{url}: the page is not UTF-8"))
}

/// A model server's page: the sums of its running and waiting samples (one per model it
/// serves). A page without the running gauge is not a vLLM page, and an error.
pub fn parse_page(page: &str) -> Result<PodLoad, String> {
    let mut load = PodLoad::default();
    let mut found = false;
    for line in page.lines() {
        let line = line.trim_start();
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let name_end = line.find(['{', ' ', '\t']).unwrap_or(line.len());
        let name = &line[..name_end];
        if name != RUNNING && name != WAITING {
            continue;
        }
        // The value follows the labels (whose values may hold spaces), then maybe a timestamp.
        let rest = match line[name_end..].strip_prefix('{') {
            Some(labelled) => labelled.rsplit_once('}').map_or("", |(_, v)| v),
            None => &line[name_end..],
        };
        let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            return Err(format!("{name}: no number in {line:?}"));
        };
        if !value.is_finite() || value < 0.0 {
            return Err(format!("{name}: {value} is not a count"));
        }
        if name == RUNNING {
            load.running += value;
            found = true;
        } else {
            load.waiting += value;
        }
    }
    if !found {
        return Err(format!("no {RUNNING} on the page (is it a vLLM server?)"));
    }
    Ok(load)
}

/// Both gauges of the pool's series from Prometheus's instant-query API, one pod per series
/// of the running gauge (its labels other than the name identify it).
async fn from_prometheus(
    client: &HttpClient,
    prometheus: &str,
    pool: &str,
) -> Result<(Vec<PodLoad>, Option<SystemTime>), String> {
    let pool = pool.replace('\\', "\\\\").replace('"', "\\\"");
    let base = prometheus.trim_end_matches('/');
    let query = async |q: String| {
        let encoded: String = url::form_urlencoded::byte_serialize(q.as_bytes()).collect();
        get(client, &format!("{base}/api/v1/query?query={encoded}")).await
    };
    let mut pods: Vec<(String, PodLoad)> = Vec::new();
    for (gauge, waiting) in [(RUNNING, false), (WAITING, true)] {
        let page = query(format!("{gauge}{{inference_pool=\"{pool}\"}}")).await?;
        for (labels, value) in parse_vector(&page)? {
            let pod = match pods.iter_mut().find(|(l, _)| *l == labels) {
                Some((_, pod)) => pod,
                None if waiting => continue,
                None => {
                    pods.push((labels, PodLoad::default()));
                    &mut pods.last_mut().expect("just pushed").1
                }
            };
            if waiting {
                pod.waiting += value;
            } else {
                pod.running += value;
            }
        }
    }
    if pods.is_empty() {
        return Err(format!(
            "Prometheus has no {RUNNING} series with inference_pool=\"{pool}\""
        ));
    }
    let page = query(format!("timestamp({RUNNING}{{inference_pool=\"{pool}\"}})")).await?;
    let scraped = parse_vector(&page)?
        .into_iter()
        .map(|(_, at)| at)
        .reduce(f64::min)
        .and_then(|at| Duration::try_from_secs_f64(at).ok())
        .map(|at| SystemTime::UNIX_EPOCH + at);
    Ok((pods.into_iter().map(|(_, pod)| pod).collect(), scraped))
}

/// An instant vector's series: their labels but the name (as a sorted key) and values.
fn parse_vector(page: &str) -> Result<Vec<(String, f64)>, String> {
    let answer: serde_json::Value =
        serde_json::from_str(page).map_err(|e| format!("Prometheus answer: {e}"))?;
    if answer["status"] != "success" {
        return Err(format!("Prometheus: {}", answer["error"]));
    }
    let Some(series) = answer["data"]["result"].as_array() else {
        return Err("Prometheus answer without data.result".into());
    };
    let mut out = Vec::with_capacity(series.len());
    for s in series {
        let mut labels: Vec<(String, String)> = s["metric"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter(|(k, _)| *k != "__name__")
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        labels.sort();
        let value = s["value"][1]
            .as_str()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| format!("Prometheus series without a count: {s}"))?;
        out.push((format!("{labels:?}"), value));
    }
    Ok(out)
}

/// `body` with `"priority":n` as its first member, unless it is not a JSON object or names a
/// priority itself (then it is sent as it is).
pub(crate) fn with_priority(body: &Bytes, priority: i64) -> Bytes {
    let Ok(top) = serde_json::from_slice::<
        std::collections::HashMap<String, &serde_json::value::RawValue>,
    >(body) else {
        return body.clone();
    };
    if top.contains_key("priority") {
        return body.clone();
    }
    let text = body.trim_ascii_start();
    let inner = &text[1..];
    let empty = top.is_empty();
    let mut out = Vec::with_capacity(body.len() + 24);
    out.extend_from_slice(format!("{{\"priority\":{priority}").as_bytes());
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(inner);
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(running: f64, waiting: f64) -> PodLoad {
        PodLoad { running, waiting }
    }

    #[test]
    fn a_page_sums_the_models_and_ignores_other_series() {
        let page = "# HELP vllm:num_requests_running x\n\
            vllm:num_requests_running{model_name=\"a b\",engine=\"0\"} 3\n\
            vllm:num_requests_running{model_name=\"c\"} 2 1700000000000\n\
            vllm:num_requests_waiting{model_name=\"a b\"} 4\n\
            vllm:num_requests_waiting_by_reason{reason=\"x\"} 9\n\
            vllm:kv_cache_usage_perc 0.5\n";
        assert_eq!(parse_page(page), Ok(pod(5.0, 4.0)));
        assert!(parse_page("up 1\n").unwrap_err().contains(RUNNING));
        assert!(parse_page("vllm:num_requests_running{a=\"b\"} x\n").is_err());
        assert!(parse_page("vllm:num_requests_running NaN\n").is_err());
    }

    #[test]
    fn prometheus_series_are_read_with_their_labels() {
        let page = r#"{"status":"success","data":{"resultType":"vector","result":[
            {"metric":{"__name__":"vllm:num_requests_running","pod":"a"},"value":[1,"3"]},
            {"metric":{"__name__":"vllm:num_requests_running","pod":"b"},"value":[1,"5"]}]}}"#;
        let series = parse_vector(page).unwrap();
        assert_eq!(series.len(), 2);
        assert_eq!(series[1].1, 5.0);
        assert_ne!(series[0].0, series[1].0);
        assert!(parse_vector(r#"{"status":"error","error":"bad query"}"#)
            .unwrap_err()
            .contains("bad query"));
    }

    #[test]
    fn the_limit_is_the_room_online_traffic_leaves_under_the_headroom() {
        let mut rule = Yield::new(Some(16), 0.25, 100, 10);
        // 16 per pod, 2 pods, 25 % kept free: 24 for everyone; online runs 10, the batch 4.
        assert_eq!(rule.limit(&[pod(8.0, 0.0), pod(6.0, 0.0)], 4), 14);
        // Online requests waiting count as online: the batch gives them its room.
        assert_eq!(rule.limit(&[pod(16.0, 6.0), pod(16.0, 0.0)], 12), 1);
        // Never below 1 (the batch moves on), never above the global limit.
        assert_eq!(
            Yield::new(Some(1000), 0.0, 50, 10).limit(&[pod(0.0, 0.0)], 0),
            50
        );
    }

    #[test]
    fn the_capacity_is_learnt_where_a_pod_queues_and_probed_before() {
        let mut rule = Yield::new(None, 0.0, 100, 8);
        assert_eq!(rule.capacity(1), None);
        // Nothing queues: the limit grows by a quarter per reading.
        assert_eq!(rule.limit(&[pod(8.0, 0.0)], 8), 10);
        assert_eq!(rule.limit(&[pod(10.0, 0.0)], 10), 13);
        // The pod queues at 12 running: that is its capacity.
        assert_eq!(rule.limit(&[pod(12.0, 1.0)], 13), 12);
        assert_eq!(rule.capacity(2), Some(24.0));
        // Running at it for long without a queue: one more is tried.
        for _ in 0..RELEARN_AFTER {
            rule.limit(&[pod(12.0, 0.0)], 12);
        }
        assert_eq!(rule.capacity(1), Some(13.0));
        // A pod bound lower (its KV cache full at 9) brings the capacity down at once.
        rule.limit(&[pod(9.0, 3.0)], 9);
        assert_eq!(rule.capacity(1), Some(9.0));
    }

    #[test]
    fn a_priority_goes_first_in_an_object_that_has_none() {
        let b = |s: &str| Bytes::from(s.to_owned());
        assert_eq!(
            with_priority(&b(r#" {"model":"m","n":1}"#), 5),
            b(r#"{"priority":5,"model":"m","n":1}"#)
        );
        assert_eq!(with_priority(&b("{}"), -1), b(r#"{"priority":-1}"#));
        for kept in [r#"{"priority":0,"model":"m"}"#, "[1]", "not json"] {
            assert_eq!(with_priority(&b(kept), 5), b(kept));
        }
        // A nested priority is the request's own business.
        assert_eq!(
            with_priority(&b(r#"{"tools":[{"priority":1}]}"#), 5),
            b(r#"{"priority":5,"tools":[{"priority":1}]}"#)
        );
    }
}
