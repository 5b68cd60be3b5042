//! The resolved configuration: plain data, every default applied, every file path absolute.
//!
//! Each table of the file is declared with [`config_table!`], which also lists the keys the
//! file may set in it: adding an option is adding a field.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub use batch_limiter::Algorithm as LimiterAlgorithm;
use serde::{Deserialize, Serialize, Serializer};

/// Where the Redis URL secret is mounted when the config does not say otherwise.
pub const DEFAULT_REDIS_URL_FILE: &str = "/etc/.secrets/redis-url";

/// What secrets print as, everywhere.
pub const REDACTED: &str = "[redacted]";

/// How requests reach the inference gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DispatchMode {
    /// Direct HTTP to the gateway, with AIMD and semaphores (the default).
    #[default]
    Sync,
    /// Through the llm-d-async dispatcher's Redis request queue and result list.
    Async,
    /// No gateway: every request is answered locally with a fixed body naming its `custom_id`
    /// and model, to try a batch's files and the processor's plumbing without inference.
    DryRun,
}

impl DispatchMode {
    /// The config spelling: `sync`, `async` or `dry_run`.
    pub fn as_str(self) -> &'static str {
        match self {
            DispatchMode::Sync => "sync",
            DispatchMode::Async => "async",
            DispatchMode::DryRun => "dry_run",
        }
    }
}

impl fmt::Display for DispatchMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A secret read from a mounted file: its value is only reachable through [`Secret::expose`].
///
/// `Debug`, `Display` and `Serialize` all print `[redacted]`, so a secret cannot leak through a
/// log line or a config dump by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself; call this only where the value is handed to a client.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(REDACTED)
    }
}

/// Durations print the way they are written in the config (`5s`, `10m`).
fn ser_duration<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_str(&humantime::format_duration(*value))
}

/// An optional duration, printed as [`ser_duration`] prints one.
fn ser_opt_duration<S: Serializer>(
    value: &Option<Duration>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match value {
        Some(d) => ser_duration(d, serializer),
        None => serializer.serialize_none(),
    }
}

config_table! {
/// The whole processor configuration, as resolved by [`ProcessorConfig::load`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProcessorConfig {
    /// `sync` (default), `async` or `dry_run`.
    pub dispatch_mode: DispatchMode,
    /// Settings of the async mode (queues, polling); ignored in sync mode.
    pub async_dispatch: AsyncDispatchConfig,
    /// Model name → how to reach it. Names may contain `.` and `/` (`Qwen/Qwen3-0.6B`).
    pub model_gateways: BTreeMap<String, ModelGatewayConfig>,
    /// Sync-mode flow control.
    pub concurrency: ConcurrencyConfig,
    /// The mounted file holding the Redis URL (absolute).
    pub redis_url_file: PathBuf,
    /// The Redis URL read from `redis_url_file` (trimmed) in async mode; `None` in sync mode.
    @derived pub redis_url: Option<Secret>,
    /// TLS towards Redis, for a `rediss…` URL; `None`: the system's roots, no client certificate.
    pub redis_tls: Option<RedisTlsConfig>,
    /// Run on a Redis whose `maxmemory-policy` may evict keys (default false: refused at start).
    pub redis_allow_eviction: bool,
    /// Where jobs keep their plan and output files (absolute).
    pub work_dir: PathBuf,
    /// The health and metrics endpoint.
    pub observability: ObservabilityConfig,
    /// Limits on one input file (also on uploads to the service).
    pub input: InputLimits,
    /// `processor serve`.
    pub serve: ServeConfig,
}
}

config_table! {
/// Settings of the async (dispatcher) mode.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AsyncDispatchConfig {
    /// How long one blocking pop of the result list waits (default 5s, > 0).
    #[serde(serialize_with = "ser_duration")]
    pub result_poll_timeout: Duration,
    /// Key prefix of every queue (default `llm-d-async`).
    pub queue_prefix: String,
    /// This replica's result-list id (default `$batch`).
    pub consumer_id: String,
    /// Whether `consumer_id` was given. When it was not, a process whose `$batch` list another
    /// live process reads takes the next free one (`$batch-2`, `$batch-3`, ...) by itself.
    #[serde(skip)]
    @derived pub consumer_id_set: bool,
    /// The dispatcher's retry sorted set (its `retry_queue_name`, default `retry-sortedset`),
    /// looked into before a request is taken for lost.
    pub retry_queue_name: String,
    /// A request neither queued nor answered for this long is enqueued again (default 10m, > 0).
    #[serde(serialize_with = "ser_duration")]
    pub lost_request_timeout: Duration,
    /// Members per pipelined ZADD (default 1000, > 0).
    pub enqueue_chunk: usize,
    /// Results popped per round trip (default 1000, > 0).
    pub result_batch: usize,
    /// After a round of fewer than `result_batch` results, how long the consumer lets more
    /// gather before the next (default 10ms; 0 reads each result at once).
    #[serde(serialize_with = "ser_duration")]
    pub result_linger: Duration,
    /// What `processor queues` prints for the real dispatcher (`async_dispatch.dispatcher`).
    pub dispatcher: DispatcherSettings,
}
}

config_table! {
/// The real dispatcher's gate and pacing, as `processor queues` prints them
/// (`async_dispatch.dispatcher`). The processor itself never reads them: the dispatcher meters
/// requests into the pool, and these say how.
///
/// The unset ones are derived from the pool (`max_num_seqs`, `pods`, `headroom`): see
/// [`DispatcherSettings::sizing`]. Those three and the gate's `max_concurrency` and `baseline`
/// hold for every pool whose entry in `pools` does not set its own.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DispatcherSettings {
    /// The gate of every queue (default `endpoint-scrape` for the pools with `metrics_urls`,
    /// else `prometheus-budget`).
    pub gate_type: Option<String>,
    /// The model servers' `--max-num-seqs`: the most requests a pod runs at once. The
    /// `prometheus-budget` gate counts requests running, which never exceed it, so a
    /// `max_concurrency` above it can never close the gate.
    pub max_num_seqs: Option<usize>,
    /// Ready pods in each pool (default 1), to size the dispatcher's workers and batch size.
    pub pods: usize,
    /// Share of each pod's slots the batch leaves to online traffic (default 0.25, in [0, 1)).
    pub headroom: f64,
    /// The gate's `max_concurrency` per pod (default `max_num_seqs`, else the dispatcher's 100).
    pub max_concurrency: Option<usize>,
    /// The gate's `baseline` (default `headroom`): the budget kept back, so the gate closes
    /// once `max_concurrency × (1 − baseline)` requests run per pod.
    pub baseline: Option<f64>,
    /// How often the dispatcher polls each queue (default 200ms; the dispatcher's own is 1s).
    #[serde(serialize_with = "ser_duration")]
    pub poll_interval: Duration,
    /// Messages taken per poll of each queue at a full budget, one value for every queue
    /// (default: the smallest pool's `pods × max_concurrency`, so no poll brings a pool more
    /// than its pods run; else 10).
    pub batch_size: Option<usize>,
    /// The dispatcher's workers, `--concurrency`: the most batch requests in flight at once
    /// (default: each pool's `pods × max_num_seqs × (1 − headroom)`, summed, when every pool
    /// has `max_num_seqs`; else 64).
    pub concurrency: Option<usize>,
    /// The dispatcher's `--prometheus-cache-ttl`: how old a load reading the gate may act on
    /// (default 1s for a gate that reads Prometheus, whose readings are as old as its scrape
    /// anyway; `poll_interval` for one that reads the pods; the dispatcher's own is 5s).
    #[serde(serialize_with = "ser_opt_duration")]
    pub prometheus_cache_ttl: Option<Duration>,
    /// Pool → its model servers' `/metrics` pages. With them the default gate reads the pods
    /// directly (`endpoint-scrape`, one per pod, `composite` over several), fresh at every poll,
    /// instead of through Prometheus.
    pub metrics_urls: BTreeMap<String, Vec<String>>,
    /// With `metrics_urls`: the gate also closes while any request waits in a pod's queue
    /// (`vllm:num_requests_waiting`), so a burst of online traffic stops the batch at once
    /// (default true).
    pub waiting_gate: bool,
    /// Pool → what differs in that pool (`max_num_seqs`, `pods`, `headroom`, `max_concurrency`,
    /// `baseline`); each key it leaves out is the one above. Every pool named must be some
    /// model's `inference_pool_name`.
    pub pools: BTreeMap<String, PoolSettings>,
}
}

config_table! {
/// `async_dispatch.dispatcher.pools.<pool>`: one pool's own facts and gate, each overriding the
/// key of the same name in [`DispatcherSettings`] for that pool's queue.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PoolSettings {
    /// The pool's model servers' `--max-num-seqs`.
    pub max_num_seqs: Option<usize>,
    /// The pool's ready pods.
    pub pods: Option<usize>,
    /// The share of each of the pool's pods' slots left to online traffic, in [0, 1).
    pub headroom: Option<f64>,
    /// The pool's gate's `max_concurrency` per pod.
    pub max_concurrency: Option<usize>,
    /// The pool's gate's `baseline`, in [0, 1).
    pub baseline: Option<f64>,
}
}

impl Default for DispatcherSettings {
    fn default() -> Self {
        Self {
            gate_type: None,
            max_num_seqs: None,
            pods: 1,
            headroom: 0.25,
            max_concurrency: None,
            baseline: None,
            poll_interval: Duration::from_millis(200),
            batch_size: None,
            concurrency: None,
            prometheus_cache_ttl: None,
            metrics_urls: BTreeMap::new(),
            waiting_gate: true,
            pools: BTreeMap::new(),
        }
    }
}

impl Default for AsyncDispatchConfig {
    fn default() -> Self {
        Self {
            result_poll_timeout: Duration::from_secs(5),
            queue_prefix: batch_keys::DEFAULT_PREFIX.to_owned(),
            consumer_id: batch_keys::DEFAULT_CONSUMER_ID.to_owned(),
            consumer_id_set: false,
            retry_queue_name: "retry-sortedset".to_owned(),
            lost_request_timeout: Duration::from_secs(600),
            enqueue_chunk: 1000,
            result_batch: 1000,
            result_linger: Duration::from_millis(10),
            dispatcher: DispatcherSettings::default(),
        }
    }
}

config_table! {
/// How one model is reached.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelGatewayConfig {
    /// The gateway base URL (`http://` or `https://`); required in sync mode.
    pub url: Option<String>,
    /// The inference pool, which names the dispatcher queues; required in async mode.
    pub inference_pool_name: Option<String>,
    /// Timeout of one HTTP attempt (default 5m, > 0).
    #[serde(serialize_with = "ser_duration")]
    pub request_timeout: Duration,
    /// Retries after the first attempt (default 3).
    pub max_retries: u32,
    /// First retry delay (default 1s).
    #[serde(serialize_with = "ser_duration")]
    pub initial_backoff: Duration,
    /// Largest retry delay (default 60s, >= `initial_backoff`).
    #[serde(serialize_with = "ser_duration")]
    pub max_backoff: Duration,
    /// The mounted file holding the API key (absolute).
    pub api_key_file: Option<PathBuf>,
    /// The API key read from `api_key_file`, trimmed.
    @derived pub api_key: Option<Secret>,
    /// Sent as `x-gateway-inference-objective` when set.
    pub inference_objective: Option<String>,
    /// TLS towards the gateway; printed with the flat `tls_*` keys the config file uses.
    #[serde(flatten)]
    pub tls: TlsConfig,
    /// Sync mode: the batch's concurrency follows the room the pool's online traffic leaves,
    /// read from the model servers' metrics; the limiter alone when absent.
    pub load: Option<LoadConfig>,
}
}

config_table! {
/// `model_gateways.<m>.load`: where the pool's load is read and how much the batch leaves
/// free. Exactly one source: `metrics_urls`, or `prometheus_url` with `pool`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoadConfig {
    /// The model servers' own metrics pages (vLLM's `/metrics`), one per pod.
    pub metrics_urls: Vec<String>,
    /// Prometheus's base URL, read for the series labelled `inference_pool: <pool>`.
    pub prometheus_url: Option<String>,
    /// The `inference_pool` label of the pool's series in Prometheus.
    pub pool: Option<String>,
    /// Requests a pod runs at once (vLLM's `--max-num-seqs`); learnt from the metrics when
    /// absent (a pod with requests waiting runs all it can).
    pub max_running_per_pod: Option<usize>,
    /// How often the load is read (default 100ms: an answer lasts a fraction of a second, and
    /// online bursts come faster than a slower reading sees them).
    #[serde(serialize_with = "ser_duration")]
    pub interval: Duration,
    /// The share of the pool's capacity left free for online requests (default 0.15, in
    /// [0, 1)).
    pub headroom: f64,
    /// Sent as the body's `priority` when the line has none (vLLM serves lower numbers first;
    /// online requests have 0): for servers started with `--scheduling-policy priority`.
    pub priority: Option<i64>,
}
}

impl Default for LoadConfig {
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

impl Default for ModelGatewayConfig {
    fn default() -> Self {
        Self {
            url: None,
            inference_pool_name: None,
            request_timeout: Duration::from_secs(300),
            max_retries: 3,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
            api_key_file: None,
            api_key: None,
            inference_objective: None,
            tls: TlsConfig::default(),
            load: None,
        }
    }
}

config_table! {
/// TLS towards one gateway. Every file was readable at load time.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TlsConfig flat "tls_" {
    /// CA bundle to trust instead of the system roots.
    #[serde(rename = "tls_ca_cert_file")]
    pub ca_cert_file: Option<PathBuf>,
    /// Client certificate; set together with `client_key_file`.
    #[serde(rename = "tls_client_cert_file")]
    pub client_cert_file: Option<PathBuf>,
    /// Client private key; set together with `client_cert_file`.
    #[serde(rename = "tls_client_key_file")]
    pub client_key_file: Option<PathBuf>,
    /// Skip server certificate checks (default false; for tests only).
    #[serde(rename = "tls_insecure_skip_verify")]
    pub insecure_skip_verify: bool,
}
}

config_table! {
/// TLS towards Redis (`redis_tls`). Every file was readable at load time; paths are absolute.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RedisTlsConfig {
    /// CA bundle to trust instead of the system roots.
    pub ca_file: Option<PathBuf>,
    /// Client certificate for mutual TLS; set together with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// The client certificate's private key; set together with `cert_file`.
    pub key_file: Option<PathBuf>,
    /// The name the server certificate must carry, when it is not the URL's host.
    pub server_name: Option<String>,
}
}

impl RedisTlsConfig {
    /// The connection library's form of these settings.
    pub fn to_options(&self) -> batch_redis::RedisTls {
        batch_redis::RedisTls {
            ca_file: self.ca_file.clone(),
            cert_file: self.cert_file.clone(),
            key_file: self.key_file.clone(),
            server_name: self.server_name.clone(),
        }
    }
}

impl ProcessorConfig {
    /// [`batch_redis::ConnectOptions`] with the configured TLS (for a `rediss…` URL without
    /// `redis_tls`: the system's roots) and the library's defaults otherwise.
    pub fn redis_connect_options(&self) -> batch_redis::ConnectOptions {
        batch_redis::ConnectOptions {
            tls: self.redis_tls_options(),
            ..batch_redis::ConnectOptions::default()
        }
    }

    /// The TLS options to connect with: `redis_tls` when set, else `None`.
    pub fn redis_tls_options(&self) -> Option<batch_redis::RedisTls> {
        self.redis_tls.as_ref().map(RedisTlsConfig::to_options)
    }
}

config_table! {
/// Sync-mode concurrency limits.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConcurrencyConfig {
    /// Requests in flight across the whole process (default 100, >= 1).
    pub global: usize,
    /// Initial and largest limit per endpoint (default 10, >= 1).
    pub per_endpoint: usize,
    /// The per-endpoint adaptive limit.
    pub aimd: AimdConfig,
}
}

impl Default for ConcurrencyConfig {
    fn default() -> Self {
        Self {
            global: 100,
            per_endpoint: 10,
            aimd: AimdConfig::default(),
        }
    }
}

config_table! {
/// The per-endpoint adaptive limit: which limiter, and the reference AIMD's parameters.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AimdConfig {
    /// Adapt the limit (default true); when false the limit stays at `per_endpoint`.
    pub enabled: bool,
    /// `work` (default: the gradient limiter's rules on latency per unit of work, each answer
    /// weighed by its `usage.completion_tokens`, see `batch_limiter::Algorithm::Work`; it holds
    /// its targets whether answers are of one length or spread 10-100×, see
    /// docs/benchmarks.md), `gradient` (latency floor and in-flight count on raw latency,
    /// `batch_limiter::GradientLimiter`; taken in by answers of varied length) or `aimd` (the
    /// reference processor's additive increase, multiplicative decrease).
    #[serde(serialize_with = "algorithm_name")]
    pub algorithm: LimiterAlgorithm,
    /// Lowest limit (default 5, between 1 and `per_endpoint`).
    pub min: usize,
    /// Factor applied on overload (default 0.5, strictly between 0 and 1).
    pub backoff_factor: f64,
    /// Added after a full window of successes (default 1, >= 1).
    pub additive_increase: usize,
}
}

impl Default for AimdConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            algorithm: LimiterAlgorithm::Work,
            min: 5,
            backoff_factor: 0.5,
            additive_increase: 1,
        }
    }
}

fn algorithm_name<S: Serializer>(a: &LimiterAlgorithm, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(a.name())
}

config_table! {
/// The health and metrics endpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ObservabilityConfig {
    /// Listen address of `/health`, `/ready` and `/metrics`; none by default.
    pub addr: Option<SocketAddr>,
    /// Base URL of an OpenTelemetry collector's OTLP/HTTP receiver (`http://host:4318`; the
    /// traces path is added); none by default: no traces unless the `OTEL_EXPORTER_OTLP_*`
    /// variables name one.
    pub otlp_endpoint: Option<String>,
}
}

config_table! {
/// Limits on one input file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InputLimits {
    /// Request lines per file (default 50,000).
    pub max_requests: u64,
    /// File size in bytes (default 200 MiB).
    pub max_file_bytes: u64,
}
}

impl Default for InputLimits {
    fn default() -> Self {
        Self {
            max_requests: 50_000,
            max_file_bytes: 200 * 1024 * 1024,
        }
    }
}

/// One API key of the service and the tenant it stands for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApiKey {
    /// The bearer token.
    pub key: Secret,
    /// The tenant whose files and batches the key reaches.
    pub tenant: String,
}

config_table! {
/// `serve.s3`: settings of S3 storage that take precedence over the `AWS_*` environment and the
/// shared AWS files (`~/.aws/credentials`, `~/.aws/config`); each unset one is left to them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct S3Config {
    /// Endpoint of an S3-compatible store (`http://minio:9000`); requests are then path-style.
    pub endpoint: Option<String>,
    /// Region (the AWS default `us-east-1` when nothing names one).
    pub region: Option<String>,
    /// Allows a plain-http endpoint (required for one).
    pub allow_http: Option<bool>,
    /// Profile of the shared AWS files.
    pub profile: Option<String>,
    /// Mounted secret holding the access key id.
    pub access_key_id_file: Option<PathBuf>,
    /// Mounted secret holding the secret access key.
    pub secret_access_key_file: Option<PathBuf>,
    /// The key id read from `access_key_id_file` (only by [`ProcessorConfig::load_service`]).
    @derived pub access_key_id: Option<Secret>,
    /// The key read from `secret_access_key_file` (only by [`ProcessorConfig::load_service`]).
    @derived pub secret_access_key: Option<Secret>,
}
}

config_table! {
/// `serve.webhooks`: where tenants' webhook endpoints may point, and how deliveries are retried.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WebhooksConfig {
    /// Hosts a webhook URL may name: exact host names (case-insensitive), `*.domain` for its
    /// subdomains, or CIDRs (`10.0.0.0/8`) for IP literals. Empty (the default): no webhook
    /// endpoint can be created.
    pub allowed_hosts: Vec<String>,
    /// Allows `http://` URLs (default false: `https://` only).
    pub allow_http: bool,
    /// Ports a webhook URL may name, explicitly or by its scheme's default (default 80, 443,
    /// 8080 and 8443): an allowed host's other services (a database, an admin port) stay out
    /// of reach.
    pub allowed_ports: Vec<std::ops::RangeInclusive<u16>>,
    /// How long one delivery may take (default 10s).
    #[serde(serialize_with = "ser_duration")]
    pub timeout: Duration,
    /// The wait after a first failed delivery, doubled after each (default 5s, at most 1h).
    #[serde(serialize_with = "ser_duration")]
    pub retry_initial_backoff: Duration,
    /// How long after an event its delivery is retried before it is given up (default 25h).
    #[serde(serialize_with = "ser_duration")]
    pub give_up_after: Duration,
    /// Endpoints one tenant may have at once (default 16, as many as Stripe allows an
    /// account): each batch end sends one event per endpoint, so it bounds one tenant's share
    /// of deliveries, of the fan-out and of a listing.
    pub max_endpoints_per_tenant: u32,
}
}

impl WebhooksConfig {
    /// Whether a webhook may call `url`: `Err` names the rule it breaks. Only what the operator
    /// allowed is ever called (no request forgery towards internal services): the scheme, and
    /// the host by name or, for an IP literal, by CIDR. A host name is not resolved to match a
    /// CIDR, so a name pointing inside a network is only called when listed by name.
    pub fn check_url(&self, url: &str) -> Result<url::Url, String> {
        let parsed = url::Url::parse(url).map_err(|e| format!("the url is not a URL: {e}"))?;
        match parsed.scheme() {
            "https" => {}
            "http" if self.allow_http => {}
            "http" => {
                return Err("the url must be https (serve.webhooks.allow_http is false)".into())
            }
            other => return Err(format!("the url's scheme {other:?} is not https")),
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err("the url must not carry credentials".into());
        }
        let allowed = match parsed.host() {
            None => false,
            Some(url::Host::Domain(name)) => {
                let name = name.trim_end_matches('.').to_ascii_lowercase();
                self.allowed_hosts
                    .iter()
                    .any(|rule| match rule.strip_prefix("*.") {
                        Some(domain) => name.ends_with(&format!(".{domain}")),
                        None => *rule == name,
                    })
            }
            Some(url::Host::Ipv4(ip)) => self.allows_ip(std::net::IpAddr::V4(ip)),
            Some(url::Host::Ipv6(ip)) => self.allows_ip(std::net::IpAddr::V6(ip)),
        };
        if !allowed {
            return Err(format!(
                "the url's host {:?} is not in serve.webhooks.allowed_hosts",
                parsed.host_str().unwrap_or("")
            ));
        }
        let port = parsed.port_or_known_default().unwrap_or(0);
        if !self.allowed_ports.iter().any(|ports| ports.contains(&port)) {
            return Err(format!(
                "the url's port {port} is not in serve.webhooks.allowed_ports"
            ));
        }
        Ok(parsed)
    }

    /// Whether a webhook may connect to `ip`, an address its host *name* resolved to: one an
    /// `allowed_hosts` CIDR or address lists, or else a public one. A name is matched as a
    /// string when the endpoint is created; what it resolves to can change afterwards (DNS
    /// rebinding), so the address is checked again at each connection, and a name cannot
    /// lead inside a network the rules do not open by address.
    pub fn allows_address(&self, ip: std::net::IpAddr) -> bool {
        // An IPv4 address mapped into IPv6 is judged as the IPv4 address it is.
        let ip = ip.to_canonical();
        self.allows_ip(ip) || is_public(ip)
    }

    fn allows_ip(&self, ip: std::net::IpAddr) -> bool {
        self.allowed_hosts
            .iter()
            .any(|rule| match rule.parse::<ipnet::IpNet>() {
                Ok(net) => net.contains(&ip),
                Err(_) => rule.parse::<std::net::IpAddr>() == Ok(ip),
            })
    }
}

/// Whether `ip` is a global unicast address: not loopback, private, shared (CGNAT),
/// link-local, unique-local, documentation, benchmarking, reserved, multicast or unspecified;
/// IPv4 addresses inside IPv6 (mapped, NAT64) are judged as IPv4.
fn is_public(ip: std::net::IpAddr) -> bool {
    use std::net::IpAddr;
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, c, _] = v4.octets();
            !(v4.is_unspecified()
                || v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 192 && b == 0 && c == 0)
                || (a == 198 && (18..20).contains(&b))
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let s = v6.segments();
            if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0, 0, 0, 0] {
                let v4 = std::net::Ipv4Addr::from(((s[6] as u32) << 16) | s[7] as u32);
                return is_public(IpAddr::V4(v4));
            }
            !(v6.is_unspecified()
                || v6.is_loopback()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || (s[0] == 0x2001 && s[1] == 0x0db8)
                || s[0..6] == [0, 0, 0, 0, 0, 0])
        }
    }
}

impl Default for WebhooksConfig {
    fn default() -> Self {
        Self {
            allowed_hosts: Vec::new(),
            allow_http: false,
            allowed_ports: [80, 443, 8080, 8443].map(|p| p..=p).to_vec(),
            timeout: Duration::from_secs(10),
            retry_initial_backoff: Duration::from_secs(5),
            give_up_after: Duration::from_secs(25 * 3600),
            max_endpoints_per_tenant: 16,
        }
    }
}

config_table! {
/// `processor serve`: the OpenAI-compatible Batch API service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServeConfig {
    /// Listen address of the API (default `127.0.0.1:8080`).
    pub listen: SocketAddr,
    /// The mounted secret holding `<key> <tenant>` lines; none: one tenant `default`, no key,
    /// loopback only.
    pub api_keys_file: Option<PathBuf>,
    /// The keys read from `api_keys_file` (only by [`ProcessorConfig::load_service`]).
    @derived pub api_keys: Vec<ApiKey>,
    /// The header an authenticating proxy sets to the caller's user (`X-MaaS-Username`), lower
    /// case; its (last) value is the tenant. The other way to tell tenants apart than
    /// `api_keys_file`, and exclusive with it. None by default.
    pub tenant_header: Option<String>,
    /// Headers of `POST /v1/batches` kept with the batch and sent on each of its inference
    /// requests (lower case; none by default).
    pub pass_through_headers: Vec<String>,
    /// Webhooks the tenants manage through `/v1/webhook_endpoints`.
    pub webhooks: WebhooksConfig,
    /// Where files live: `file:///dir` (default `file://<work_dir>/storage`) or `s3://bucket/prefix`.
    pub storage: String,
    /// Jobs this replica runs at once (default 16).
    pub max_active_jobs: usize,
    /// Prefix of the service's own Redis keys (default `batch-processor`).
    pub state_prefix: String,
    /// How often expired files are deleted (default 60s).
    #[serde(serialize_with = "ser_duration")]
    pub reaper_interval: Duration,
    /// This replica's stable name (default: the host name; a StatefulSet pod keeps its name).
    /// A restarted replica resumes the jobs recorded under it.
    pub replica_id: String,
    /// How long a job's lease outlives its replica's last heartbeat (default 30s): another
    /// replica takes the job over after it.
    #[serde(serialize_with = "ser_duration")]
    pub lease_ttl: Duration,
    /// How often a running job's partial results are copied to storage (default 30s).
    #[serde(serialize_with = "ser_duration")]
    pub checkpoint_interval: Duration,
    /// How to reach S3 storage, over the `AWS_*` environment and the shared AWS files.
    pub s3: S3Config,
    /// How long a client has to send a request's headers, from its connection's opening or the
    /// end of its previous answer (default 10s): a slow or silent client is then closed. It also
    /// bounds how long a kept-alive connection waits for its next request.
    #[serde(serialize_with = "ser_duration")]
    pub header_read_timeout: Duration,
    /// How long a new connection has to send its first request's whole head, its TLS
    /// handshake included (default 3s); it is closed then. Later heads get
    /// `header_read_timeout`.
    #[serde(serialize_with = "ser_duration")]
    pub first_request_timeout: Duration,
    /// How long a connection may carry no byte either way (a stalled body, a client that does
    /// not read its answer) before it is closed, a request in progress first answered
    /// (default 60s).
    #[serde(serialize_with = "ser_duration")]
    pub idle_timeout: Duration,
    /// Connections served at once. Default (`None`): from the open-file limit, which the
    /// service raises to its hard limit at start: that limit less 1,024 for everything else,
    /// between 256 and 8,192 (an open connection not yet answered costs about 26 KiB). At the
    /// ceiling, a new connection closes the oldest one not yet answered anything but a 401;
    /// with none such, it waits in the listen backlog.
    pub max_connections: Option<usize>,
    /// Connections open at once from one peer address; more are closed at once. Default
    /// (`None`): 256, or none (0) when `tenant_header` says an authenticating proxy is in front
    /// (then every client comes from the proxy's few addresses).
    pub max_connections_per_peer: Option<usize>,
    /// The largest JSON request body (default 1 MiB); a larger one is a 413 before it is read.
    pub max_json_body_bytes: u64,
    /// The largest multipart form field other than `file` (default 64 KiB).
    pub max_form_field_bytes: u64,
    /// The longest `filename` of an upload, in bytes (default 255).
    pub max_filename_bytes: usize,
    /// The longest segment of a request path, such as an id (default 128 bytes).
    pub max_id_bytes: usize,
    /// Batches one tenant may have queued or running (default 1,000); over it, creating one
    /// is a 429.
    pub tenant_max_batches: u64,
    /// Bytes of files one tenant may store, its uploads and its batches' results (default
    /// 100 GiB); an upload over it is a 429.
    pub tenant_max_stored_bytes: u64,
    /// Files one tenant may store (default 10,000); an upload over it is a 429.
    pub tenant_max_files: u64,
    /// Batches of one tenant running at once on all replicas beyond which a free slot goes to
    /// every other tenant's queued batch first, when one waits (default 8). Below it, slots are
    /// shared by weight: a free slot goes to the tenant with the smallest share of the running
    /// batches, (running + 1) / weight.
    pub tenant_max_running_batches: usize,
    /// Each tenant's weight in the share of batch slots (default 1 for every tenant): a tenant
    /// of weight 3 runs three batches for one of a tenant of weight 1 while both have some
    /// queued. Keys are tenant names as `api_keys_file` gives them.
    pub tenant_weights: std::collections::BTreeMap<String, u32>,
    /// Whether a running batch gives its slot back when every slot is taken and another
    /// tenant, below its share of the running batches, has one waiting (default true): the
    /// batch of the most served tenant stops at a safe point (its requests in flight end),
    /// checkpoints, and waits in the queue again with its progress kept.
    pub tenant_preemption: bool,
    /// How long a batch that already gave its slot back runs again before it may be asked
    /// again (default 10 s); a batch's first run may give its slot back at once.
    #[serde(serialize_with = "ser_duration")]
    pub tenant_preemption_min_run: Duration,
    /// Requests of one tenant's batches in flight at once on a replica, in sync mode (default
    /// 0: no cap of its own, `concurrency.global` for all). Async mode leaves the metering to the
    /// dispatcher.
    pub tenant_max_requests_in_flight: usize,
    /// HTTPS on the API with this certificate and key (read again when they change); none:
    /// plain HTTP.
    pub tls: Option<ServeTls>,
}
}

config_table! {
/// `serve.tls`: PEM files, as a Kubernetes TLS secret mounts them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServeTls {
    /// The certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}
}

impl ServeConfig {
    /// Connections one peer address may hold open at once (0: no cap): `max_connections_per_peer`
    /// or its default.
    pub fn connections_per_peer(&self) -> usize {
        match (self.max_connections_per_peer, &self.tenant_header) {
            (Some(cap), _) => cap,
            (None, Some(_)) => 0,
            (None, None) => 256,
        }
    }

    /// The connection ceiling for a process allowed `open_files` descriptors:
    /// `max_connections`, or its default.
    pub fn connection_ceiling(&self, open_files: u64) -> usize {
        self.max_connections.unwrap_or_else(|| {
            let spare = open_files.saturating_sub(1024).clamp(256, 8_192);
            spare as usize
        })
    }

    /// The defaults, with storage under `work_dir`.
    pub fn defaults(work_dir: &std::path::Path) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            api_keys_file: None,
            api_keys: Vec::new(),
            tenant_header: None,
            pass_through_headers: Vec::new(),
            webhooks: WebhooksConfig::default(),
            storage: format!("file://{}", work_dir.join("storage").display()),
            s3: S3Config::default(),
            max_active_jobs: 16,
            state_prefix: "batch-processor".into(),
            reaper_interval: Duration::from_secs(60),
            replica_id: host_name(),
            lease_ttl: Duration::from_secs(30),
            checkpoint_interval: Duration::from_secs(30),
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            first_request_timeout: Duration::from_secs(3),
            max_connections: None,
            max_connections_per_peer: None,
            max_json_body_bytes: 1 << 20,
            max_form_field_bytes: 64 << 10,
            max_filename_bytes: 255,
            max_id_bytes: 128,
            tenant_max_batches: 1_000,
            tenant_max_stored_bytes: 100 << 30,
            tenant_max_files: 10_000,
            tenant_max_running_batches: 8,
            tenant_weights: std::collections::BTreeMap::new(),
            tenant_preemption: true,
            tenant_preemption_min_run: Duration::from_secs(10),
            tenant_max_requests_in_flight: 0,
            tls: None,
        }
    }
}

/// The host's name, or `replica` when it cannot be read; `:` and braces become `-` so that it
/// fits in a Redis key part.
fn host_name() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "replica".to_owned());
    name.chars()
        .map(|c| {
            if matches!(c, ':' | '{' | '}') || c.is_whitespace() {
                '-'
            } else {
                c
            }
        })
        .collect()
}
