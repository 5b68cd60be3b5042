//! The fake OpenAI-compatible inference gateway: its server, state and counters.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Method, Request, StatusCode};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{FailureKind, GatewayConfig};
use crate::http::{self, Reply, Resp};
use crate::prefix::{self, Lru};
use crate::prom::Page;
use crate::reply::{self, Endpoint};
use crate::SimError;

mod engine;
mod serving;

use engine::{Arrival, Engine};
use serving::handle;

/// How many requests `/admin/requests` remembers.
const RECENT_LIMIT: usize = 1000;

/// The header the EPP sets on a request it dropped because its TTL ran out.
const DROPPED_REASON: &str = "x-llm-d-request-dropped-reason";

/// Starts gateways. See [`GatewayHandle`] for what a running one offers.
pub struct Gateway;

impl Gateway {
    /// Binds `listen` (port 0 picks a free port) and serves until the handle is shut down or
    /// dropped.
    pub async fn start(
        listen: SocketAddr,
        config: GatewayConfig,
    ) -> Result<GatewayHandle, SimError> {
        config.validate()?;
        let listener = http::bind(listen).await?;
        let addr = listener.local_addr().map_err(|error| SimError::Bind {
            addr: listen,
            error,
        })?;
        let state = Arc::new(GatewayState::new(config));
        let token = CancellationToken::new();
        let handler_state = state.clone();
        let task = http::serve(
            listener,
            token.clone(),
            Arc::new(move |req| handle(handler_state.clone(), req)),
        );
        tracing::info!(%addr, "gateway listening");
        Ok(GatewayHandle {
            addr,
            state,
            token,
            task: Some(task),
        })
    }
}

/// A running gateway. Dropping it stops the server too.
pub struct GatewayHandle {
    addr: SocketAddr,
    state: Arc<GatewayState>,
    token: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl GatewayHandle {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`, to use as a queue entry's `igw_base_url`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Replaces the configuration (as `POST /admin/config` does); failure-rule limits restart.
    pub fn set_config(&self, config: GatewayConfig) -> Result<(), SimError> {
        self.state.set_config(config)
    }

    /// The current configuration.
    pub fn config(&self) -> GatewayConfig {
        self.state.active().config.clone()
    }

    /// Counters since start.
    pub fn stats(&self) -> GatewayStats {
        self.state.stats()
    }

    /// The last inference requests received (at most 1000), oldest first.
    pub fn recent_requests(&self) -> Vec<SeenRequest> {
        lock(&self.state.recent).iter().cloned().collect()
    }

    /// A probe of the current in-flight count that does not keep the server running: what an
    /// in-process gate reads.
    pub fn load(&self) -> GatewayLoad {
        GatewayLoad(self.state.clone())
    }

    /// Stops accepting, drops open connections and waits for the server task.
    pub async fn shutdown(mut self) {
        self.token.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for GatewayHandle {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

/// Reads a gateway's in-flight count without owning the gateway.
#[derive(Clone)]
pub struct GatewayLoad(Arc<GatewayState>);

impl GatewayLoad {
    /// Inference requests being served now.
    pub fn in_flight(&self) -> usize {
        self.0.in_flight.load(Ordering::SeqCst)
    }

    /// Requests running now: in vLLM mode those in the model's batch (at most `max_num_seqs`,
    /// the waiting ones left out, as `vllm:num_requests_running` counts them); otherwise every
    /// request in flight.
    pub fn running(&self) -> usize {
        match self.0.active().config.max_num_seqs {
            Some(_) => self.0.engine.counts().0,
            None => self.in_flight(),
        }
    }
}

/// The gateway's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct GatewayStats {
    /// Inference requests admitted and not yet answered.
    pub in_flight: usize,
    /// Requests whose body is still being read.
    pub waiting: usize,
    /// The highest `in_flight` seen.
    pub max_in_flight_seen: usize,
    /// Inference requests received.
    pub total: u64,
    /// Inference responses sent, by HTTP status.
    pub responses_by_status: BTreeMap<u16, u64>,
    /// Connections reset instead of answered.
    pub resets: u64,
    /// Requests whose prompt prefix was in their endpoint's prefix cache.
    pub prefix_cache_hits: u64,
    /// Requests with a prompt prefix that was not cached (each charged `prefix_miss_latency`).
    pub prefix_cache_misses: u64,
    /// Inference answers served with 200 after their latency (the timed ones below).
    pub answered: u64,
    /// How long those answers took to serve, admission to reply, in microseconds.
    pub latency_micros_total: u64,
    /// What those answers would have taken unloaded (the latency model, not stretched).
    pub unloaded_micros_total: u64,
    /// Their `usage.completion_tokens`.
    pub completion_tokens_total: u64,
    /// The time spent producing their output tokens (the per-token part), in microseconds.
    pub token_micros_total: u64,
}

impl GatewayStats {
    /// The mean time an answer took to serve, if any was.
    pub fn mean_latency(&self) -> Option<Duration> {
        (self.answered > 0).then(|| micros(self.latency_micros_total / self.answered))
    }

    /// The mean time the answers would have taken unloaded, if any was served.
    pub fn mean_unloaded_latency(&self) -> Option<Duration> {
        (self.answered > 0).then(|| micros(self.unloaded_micros_total / self.answered))
    }

    /// The mean time per output token, if any token was produced.
    pub fn mean_token_time(&self) -> Option<Duration> {
        (self.completion_tokens_total > 0).then(|| {
            Duration::from_secs_f64(
                self.token_micros_total as f64 / 1e6 / self.completion_tokens_total as f64,
            )
        })
    }

    /// Responses sent with `status`.
    pub fn responses(&self, status: u16) -> u64 {
        self.responses_by_status.get(&status).copied().unwrap_or(0)
    }
}

/// One inference request as the gateway received it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeenRequest {
    /// HTTP method.
    pub method: String,
    /// Request path.
    pub path: String,
    /// Headers, names lowercased; repeated headers joined with `", "`.
    pub headers: BTreeMap<String, String>,
    /// [`batch_wire::hash::body_digest`] of the exact body bytes.
    pub body_digest: String,
    /// Body length in bytes.
    pub body_len: usize,
    /// When it arrived, Unix milliseconds.
    pub received_unix_ms: u64,
}

impl SeenRequest {
    /// A header's value by case-insensitive name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }
}

struct Active {
    config: GatewayConfig,
    /// How often each failure rule has fired, for `limit`.
    fired: Vec<AtomicU64>,
}

struct GatewayState {
    active: RwLock<Arc<Active>>,
    rng: Mutex<StdRng>,
    in_flight: AtomicUsize,
    waiting: AtomicUsize,
    max_in_flight: AtomicUsize,
    total: AtomicU64,
    resets: AtomicU64,
    by_status: Mutex<BTreeMap<u16, u64>>,
    recent: Mutex<VecDeque<SeenRequest>>,
    /// One prefix cache per endpoint, indexed by [`Endpoint::index`].
    prefixes: Mutex<[Lru; Endpoint::COUNT]>,
    prefix_hits: AtomicU64,
    prefix_misses: AtomicU64,
    answered: AtomicU64,
    latency_micros: AtomicU64,
    unloaded_micros: AtomicU64,
    completion_tokens: AtomicU64,
    token_micros: AtomicU64,
    /// vLLM mode's running requests and waiting queue.
    engine: Arc<Engine>,
    /// Requests in flight on each of `pod_factors`' pods.
    pods: Mutex<Vec<usize>>,
}

/// Locks a mutex, shrugging off poisoning: the data are counters, still meaningful.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl GatewayState {
    fn new(config: GatewayConfig) -> Self {
        let state = Self {
            active: RwLock::new(Arc::new(Active {
                config: GatewayConfig::default(),
                fired: Vec::new(),
            })),
            rng: Mutex::new(StdRng::from_os_rng()),
            in_flight: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            total: AtomicU64::new(0),
            resets: AtomicU64::new(0),
            by_status: Mutex::new(BTreeMap::new()),
            recent: Mutex::new(VecDeque::new()),
            prefixes: Mutex::new(Default::default()),
            prefix_hits: AtomicU64::new(0),
            prefix_misses: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            latency_micros: AtomicU64::new(0),
            unloaded_micros: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            token_micros: AtomicU64::new(0),
            engine: Arc::default(),
            pods: Mutex::new(Vec::new()),
        };
        // Validated by the caller.
        let _ = state.set_config(config);
        state
    }

    fn active(&self) -> Arc<Active> {
        self.active
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_config(&self, config: GatewayConfig) -> Result<(), SimError> {
        config.validate()?;
        if let Some(seed) = config.seed {
            *lock(&self.rng) = StdRng::seed_from_u64(seed);
        }
        for lru in lock(&self.prefixes).iter_mut() {
            lru.shrink(config.prefix_cache_size);
        }
        let fired = config.failures.iter().map(|_| AtomicU64::new(0)).collect();
        *self.active.write().unwrap_or_else(|e| e.into_inner()) =
            Arc::new(Active { config, fired });
        Ok(())
    }

    fn stats(&self) -> GatewayStats {
        GatewayStats {
            in_flight: self.in_flight.load(Ordering::SeqCst),
            waiting: self.waiting.load(Ordering::SeqCst),
            max_in_flight_seen: self.max_in_flight.load(Ordering::SeqCst),
            total: self.total.load(Ordering::SeqCst),
            responses_by_status: lock(&self.by_status).clone(),
            resets: self.resets.load(Ordering::SeqCst),
            prefix_cache_hits: self.prefix_hits.load(Ordering::SeqCst),
            prefix_cache_misses: self.prefix_misses.load(Ordering::SeqCst),
            answered: self.answered.load(Ordering::SeqCst),
            latency_micros_total: self.latency_micros.load(Ordering::SeqCst),
            unloaded_micros_total: self.unloaded_micros.load(Ordering::SeqCst),
            completion_tokens_total: self.completion_tokens.load(Ordering::SeqCst),
            token_micros_total: self.token_micros.load(Ordering::SeqCst),
        }
    }

    /// Looks the request's prompt prefix up in its endpoint's cache (and caches it); true on a
    /// miss that costs latency. Nothing is counted when the model is off or there is no prefix.
    fn prefix_miss(
        &self,
        config: &GatewayConfig,
        endpoint: Endpoint,
        body: &serde_json::Map<String, Value>,
    ) -> bool {
        if config.prefix_cache_size == 0 {
            return false;
        }
        let Some(key) = prefix::prefix_key(body) else {
            return false;
        };
        let hit = lock(&self.prefixes)[endpoint.index()].touch(key, config.prefix_cache_size);
        if hit {
            self.prefix_hits.fetch_add(1, Ordering::SeqCst);
        } else {
            self.prefix_misses.fetch_add(1, Ordering::SeqCst);
        }
        !hit
    }

    /// The pod of `config.pod_factors` with the fewest in flight, taken until the returned
    /// guard drops; `None` with one pod.
    fn route(self: &Arc<Self>, config: &GatewayConfig) -> Option<OnPod> {
        if config.pod_factors.is_empty() {
            return None;
        }
        let mut pods = lock(&self.pods);
        // A new config may name more pods; their counts start at 0.
        if pods.len() < config.pod_factors.len() {
            pods.resize(config.pod_factors.len(), 0);
        }
        let index = (0..config.pod_factors.len()).min_by_key(|&i| pods[i])?;
        pods[index] += 1;
        Some(OnPod {
            state: self.clone(),
            index,
            factor: config.pod_factors[index],
        })
    }

    /// Takes an in-flight slot unless `limit` is reached; returns it with the in-flight count
    /// it made.
    fn admit(self: &Arc<Self>, limit: Option<usize>) -> Option<(InFlight, usize)> {
        let before = self.in_flight.fetch_add(1, Ordering::SeqCst);
        if limit.is_some_and(|c| before >= c) {
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        self.max_in_flight.fetch_max(before + 1, Ordering::SeqCst);
        Some((InFlight(self.clone()), before + 1))
    }

    /// The failure to inject into this request, if any.
    fn pick_failure(&self, active: &Active, path: &str) -> Option<FailureKind> {
        let mut rng = lock(&self.rng);
        for (rule, fired) in active.config.failures.iter().zip(&active.fired) {
            if rule.path.as_deref().is_some_and(|p| p != path) {
                continue;
            }
            if rule
                .limit
                .is_some_and(|l| fired.load(Ordering::SeqCst) >= l)
            {
                continue;
            }
            if rng.random::<f64>() < rule.rate {
                let before = fired.fetch_add(1, Ordering::SeqCst);
                if rule.limit.is_some_and(|l| before >= l) {
                    continue;
                }
                return Some(rule.kind);
            }
        }
        None
    }

    fn record(&self, seen: SeenRequest) {
        let mut recent = lock(&self.recent);
        if recent.len() == RECENT_LIMIT {
            recent.pop_front();
        }
        recent.push_back(seen);
    }

    fn count(&self, resp: Resp) -> Reply {
        *lock(&self.by_status)
            .entry(resp.status().as_u16())
            .or_insert(0) += 1;
        Reply::Response(resp)
    }

    /// Counts a streamed answer's 200, sent with its head before its events.
    fn count_stream(&self, body: http::ChunkBody) -> Reply {
        *lock(&self.by_status).entry(200).or_insert(0) += 1;
        let mut resp = hyper::Response::new(body);
        resp.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("text/event-stream"),
        );
        Reply::Stream(resp)
    }

    /// Counts an answer served whole: its time from admission, what it would have taken
    /// unloaded, and its tokens and their time.
    fn answered(&self, admitted: Instant, unloaded: Duration, token_time: Duration, tokens: u64) {
        self.answered.fetch_add(1, Ordering::SeqCst);
        let add =
            |counter: &AtomicU64, d: Duration| counter.fetch_add(as_micros(d), Ordering::SeqCst);
        add(&self.latency_micros, admitted.elapsed());
        add(&self.unloaded_micros, unloaded);
        add(&self.token_micros, token_time);
        self.completion_tokens.fetch_add(tokens, Ordering::SeqCst);
    }

    fn metrics_page(&self) -> String {
        let s = self.stats();
        let mut page = Page::default();
        page.family(
            "gateway_in_flight_requests",
            "gauge",
            "Inference requests being served.",
        )
        .sample("gateway_in_flight_requests", &[], s.in_flight as f64)
        .family(
            "gateway_waiting_requests",
            "gauge",
            "Requests whose body is still being read.",
        )
        .sample("gateway_waiting_requests", &[], s.waiting as f64)
        .family(
            "gateway_max_in_flight_requests",
            "gauge",
            "Highest in-flight count seen.",
        )
        .sample(
            "gateway_max_in_flight_requests",
            &[],
            s.max_in_flight_seen as f64,
        )
        .family(
            "gateway_requests_total",
            "counter",
            "Inference requests received.",
        )
        .sample("gateway_requests_total", &[], s.total as f64)
        .family(
            "gateway_responses_total",
            "counter",
            "Inference responses by HTTP status.",
        );
        for (status, n) in &s.responses_by_status {
            page.sample(
                "gateway_responses_total",
                &[("status", &status.to_string())],
                *n as f64,
            );
        }
        page.family(
            "gateway_connection_resets_total",
            "counter",
            "Connections reset unanswered.",
        )
        .sample("gateway_connection_resets_total", &[], s.resets as f64)
        .family(
            "sim_gateway_prefix_cache_hits_total",
            "counter",
            "Requests whose prompt prefix was cached.",
        )
        .sample(
            "sim_gateway_prefix_cache_hits_total",
            &[],
            s.prefix_cache_hits as f64,
        )
        .family(
            "sim_gateway_prefix_cache_misses_total",
            "counter",
            "Requests whose prompt prefix was not cached.",
        )
        .sample(
            "sim_gateway_prefix_cache_misses_total",
            &[],
            s.prefix_cache_misses as f64,
        );
        let config = &self.active().config;
        if let Some(seqs) = config.max_num_seqs {
            let (running, waiting) = self.engine.counts();
            let model = [("model_name", config.served_model_name.as_str())];
            page.family(
                "vllm:num_requests_running",
                "gauge",
                "Number of requests in model execution batches.",
            )
            .sample("vllm:num_requests_running", &model, running as f64)
            .family(
                "vllm:num_requests_waiting",
                "gauge",
                "Number of requests waiting to be processed.",
            )
            .sample("vllm:num_requests_waiting", &model, waiting as f64)
            .family(
                "vllm:kv_cache_usage_perc",
                "gauge",
                "KV-cache usage. 1 means 100 percent usage.",
            )
            .sample(
                "vllm:kv_cache_usage_perc",
                &model,
                running as f64 / seqs as f64,
            );
        }
        page.finish()
    }
}

/// An admitted request; releases its slot when dropped, also if the client goes away.
struct InFlight(Arc<GatewayState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request on one of the pods behind the URL; leaves it when dropped.
struct OnPod {
    state: Arc<GatewayState>,
    index: usize,
    /// The pod's latency factor.
    factor: f64,
}

impl Drop for OnPod {
    fn drop(&mut self) {
        if let Some(n) = lock(&self.state.pods).get_mut(self.index) {
            *n = n.saturating_sub(1);
        }
    }
}

fn micros(n: u64) -> Duration {
    Duration::from_micros(n)
}

fn as_micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
