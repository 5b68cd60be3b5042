//! Loading: figment providers → value tree → validated [`ProcessorConfig`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use batch_keys::validate_part;
use figment::providers::{Env, Format, Yaml};
use figment::value::Value;
use figment::Figment;

use crate::collect::{Collector, Table};
use crate::error::{ConfigError, ConfigErrors};
use crate::types::*;
use crate::values::{check_http_url, check_redis_url};

mod serve;

pub use serve::check_tenant;
use serve::serve;

/// Prefix of the environment variables that override the file (`PROCESSOR_DISPATCH_MODE=async`).
pub const ENV_PREFIX: &str = "PROCESSOR_";

/// Separator of nested keys in environment variable names
/// (`PROCESSOR_ASYNC_DISPATCH__RESULT_POLL_TIMEOUT=1s`).
pub const ENV_NESTING: &str = "__";

/// A model's keys: its fields, and its TLS settings also written flat beside `tls:`
/// (`tls_ca_cert_file`, as the issue and the Go processor spell them).
static MODEL_KEYS: LazyLock<Vec<&'static str>> = LazyLock::new(|| {
    let flat_after = |key: &str| match key {
        "tls" => TlsConfig::FLAT_KEYS,
        _ => &[],
    };
    ModelGatewayConfig::KEYS
        .iter()
        .flat_map(|&key| std::iter::once(key).chain(flat_after(key).iter().copied()))
        .collect()
});

impl ProcessorConfig {
    /// Loads `path` (YAML) with `PROCESSOR_…` environment overrides, and validates everything.
    ///
    /// Secret files (the Redis URL in async mode, API keys) are read here, so an unreadable one is
    /// a config error naming the field and the file.
    pub fn load(path: &Path) -> Result<Self, ConfigErrors> {
        Self::load_as(path, Needs::Run)
    }

    /// Like [`ProcessorConfig::load`] for `processor serve`: the Redis URL is read in both
    /// dispatch modes (the service keeps its jobs in Redis), and `serve.api_keys_file` is read.
    pub fn load_service(path: &Path) -> Result<Self, ConfigErrors> {
        Self::load_as(path, Needs::Service)
    }

    fn load_as(path: &Path, needs: Needs) -> Result<Self, ConfigErrors> {
        let source = || path.display().to_string();
        // figment would report a missing file as a parse error deep in its provider; say it plainly.
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigErrors::single(source(), format!("cannot read the config file: {e}"))
        })?;
        // figment's YAML provider keeps the last of two equal keys; a YAML mapping refuses them,
        // and its syntax errors carry line and column.
        match serde_yaml::from_str::<serde_yaml::Value>(&text) {
            Err(e) => return Err(ConfigErrors::single(source(), format!("invalid YAML: {e}"))),
            Ok(serde_yaml::Value::Mapping(_) | serde_yaml::Value::Null) => {}
            Ok(_) => {
                let problem = "expected a mapping of settings (key: value) at the top level";
                return Err(ConfigErrors::single(source(), problem));
            }
        }
        Self::build_from(Self::figment(path), needs)
    }

    /// The providers [`ProcessorConfig::load`] reads: the YAML file, then the environment.
    ///
    /// Embedders may merge more providers on top before calling [`ProcessorConfig::from_figment`].
    pub fn figment(path: &Path) -> Figment {
        Figment::new()
            .merge(Yaml::file_exact(path))
            .merge(Env::prefixed(ENV_PREFIX).split(ENV_NESTING))
    }

    /// Validates whatever `figment` holds. Relative paths resolve against the directory of the
    /// file a value came from, or the current directory for other sources.
    pub fn from_figment(figment: Figment) -> Result<Self, ConfigErrors> {
        Self::build_from(figment, Needs::Run)
    }

    /// [`ProcessorConfig::from_figment`] for `processor serve` (see [`ProcessorConfig::load_service`]).
    pub fn service_from_figment(figment: Figment) -> Result<Self, ConfigErrors> {
        Self::build_from(figment, Needs::Service)
    }

    fn build_from(figment: Figment, needs: Needs) -> Result<Self, ConfigErrors> {
        let root = match figment.find_value("") {
            Ok(root) => root,
            Err(e) => return Err(provider_error(&figment, e)),
        };
        let mut collector = Collector::new(&figment);
        let config = build(&mut collector, &root, needs);
        let errors = collector.into_errors();
        if errors.is_empty() {
            Ok(config)
        } else {
            Err(ConfigErrors { errors })
        }
    }
}

/// A file that does not parse: one error naming the file, with figment's (serde's) message.
fn provider_error(figment: &Figment, error: figment::Error) -> ConfigErrors {
    let source = Collector::new(figment).fallback_source().to_owned();
    let source = error
        .metadata
        .as_ref()
        .and_then(|md| md.source.as_ref())
        .and_then(figment::Source::file_path)
        .map_or(source, |p| p.display().to_string());
    let path = error.path.join(".");
    ConfigErrors {
        errors: vec![ConfigError {
            source,
            path,
            problem: format!("cannot parse: {}", error.kind),
        }],
    }
}

/// What the command being configured reads beyond the common settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Needs {
    /// `processor run` and the other one-job commands.
    Run,
    /// `processor serve`: Redis in both modes, API keys.
    Service,
}

fn build(c: &mut Collector<'_>, root: &Value, needs: Needs) -> ProcessorConfig {
    let root = c.root(root, ProcessorConfig::KEYS);
    let dispatch_mode = dispatch_mode(c, &root);
    let (async_dispatch, dispatcher_pools) = async_dispatch(c, &root);
    let model_gateways = model_gateways(c, &root, dispatch_mode);
    check_dispatcher_pools(c, &dispatcher_pools, &model_gateways);
    let concurrency = concurrency(c, &root);

    let redis_url_file = c
        .path(&root, "redis_url_file")
        .unwrap_or_else(|| PathBuf::from(DEFAULT_REDIS_URL_FILE));
    let mut parsed_url = None;
    let need_redis = dispatch_mode == DispatchMode::Async || needs == Needs::Service;
    let redis_url = match need_redis {
        true => read_secret(c, &root, "redis_url_file", &redis_url_file).and_then(|url| {
            match check_redis_url(url.expose()) {
                Ok(parsed) => {
                    parsed_url = Some(parsed);
                    Some(url)
                }
                Err(problem) => {
                    let problem = format!("{} {problem}", redis_url_file.display());
                    c.at(&root, "redis_url_file", problem);
                    None
                }
            }
        }),
        false => None,
    };
    let redis_tls = redis_tls(c, &root, parsed_url.as_ref());
    let redis_allow_eviction = c.boolean(&root, "redis_allow_eviction", false);
    let work_dir = c
        .path(&root, "work_dir")
        .unwrap_or_else(|| std::env::temp_dir().join("batch-processor"));

    let observability_table = c.table(&root, "observability", ObservabilityConfig::KEYS);
    let observability = ObservabilityConfig {
        addr: c.socket_addr(&observability_table, "addr"),
        otlp_endpoint: c
            .text(&observability_table, "otlp_endpoint")
            .and_then(|url| match url::Url::parse(url.trim()) {
                // The exporter is built without TLS: a collector beside the pod.
                Ok(u) if u.scheme() == "http" => Some(url.trim().to_owned()),
                _ => {
                    c.at(
                        &observability_table,
                        "otlp_endpoint",
                        format!("expected an http:// URL such as http://127.0.0.1:4318 (no TLS to the collector), got {url:?}"),
                    );
                    None
                }
            }),
    };
    let input_table = c.table(&root, "input", InputLimits::KEYS);
    let defaults = InputLimits::default();
    let input = InputLimits {
        max_requests: c.count(&input_table, "max_requests", defaults.max_requests, 1),
        max_file_bytes: c.byte_size(&input_table, "max_file_bytes", defaults.max_file_bytes),
    };

    let serve = serve(c, &root, &work_dir, needs);

    ProcessorConfig {
        dispatch_mode,
        async_dispatch,
        model_gateways,
        concurrency,
        redis_url_file,
        redis_url,
        redis_tls,
        redis_allow_eviction,
        work_dir,
        observability,
        input,
        serve,
    }
}

fn dispatch_mode(c: &mut Collector<'_>, root: &Table<'_>) -> DispatchMode {
    match c.string(root, "dispatch_mode").as_deref() {
        None | Some("sync") => DispatchMode::Sync,
        Some("async") => DispatchMode::Async,
        Some("dry_run") => DispatchMode::DryRun,
        Some(other) => {
            let problem =
                format!("unknown dispatch mode {other:?} (expected sync, async or dry_run)");
            c.at(root, "dispatch_mode", problem);
            DispatchMode::Sync
        }
    }
}

/// `async_dispatch`, and its dispatcher's `pools` table (see [`check_dispatcher_pools`]).
fn async_dispatch<'v>(c: &mut Collector<'_>, root: &Table<'v>) -> (AsyncDispatchConfig, Table<'v>) {
    let t = c.table(root, "async_dispatch", AsyncDispatchConfig::KEYS);
    let d = AsyncDispatchConfig::default();
    let result_poll_timeout = c.positive_duration(&t, "result_poll_timeout", d.result_poll_timeout);
    let queue_prefix = name_part(c, &t, "queue_prefix", "prefix").unwrap_or(d.queue_prefix);
    let consumer_id = name_part(c, &t, "consumer_id", "consumer id");
    let (dispatcher, pools_table) = dispatcher_settings(c, &t);
    let config = AsyncDispatchConfig {
        result_poll_timeout,
        queue_prefix,
        consumer_id_set: consumer_id.is_some(),
        consumer_id: consumer_id.unwrap_or(d.consumer_id),
        retry_queue_name: c
            .string(&t, "retry_queue_name")
            .unwrap_or(d.retry_queue_name),
        lost_request_timeout: c.positive_duration(
            &t,
            "lost_request_timeout",
            d.lost_request_timeout,
        ),
        enqueue_chunk: c.count(&t, "enqueue_chunk", d.enqueue_chunk, 1),
        result_batch: c.count(&t, "result_batch", d.result_batch, 1),
        result_linger: c.duration(&t, "result_linger", d.result_linger),
        dispatcher,
    };
    (config, pools_table)
}

/// `async_dispatch.dispatcher`: what `processor queues` prints for the real dispatcher; also
/// its `pools` table, checked against the models' pools once they are read.
fn dispatcher_settings<'v>(
    c: &mut Collector<'_>,
    parent: &Table<'v>,
) -> (DispatcherSettings, Table<'v>) {
    let t = c.table(parent, "dispatcher", DispatcherSettings::KEYS);
    let d = DispatcherSettings::default();
    let facts = pool_settings(c, &t);
    let batch_size = optional_count(c, &t, "batch_size");
    let concurrency = optional_count(c, &t, "concurrency");
    let metrics = c.table(&t, "metrics_urls", &[]);
    let mut metrics_urls = BTreeMap::new();
    for (pool, _) in metrics.entries() {
        if let Err(problem) = validate_part("pool name", pool) {
            c.at(&metrics, pool, problem);
            continue;
        }
        let urls = c.strings(&metrics, pool);
        for (i, url) in urls.iter().enumerate() {
            if let Err(problem) = check_http_url(url) {
                c.at(&metrics, pool, format!("[{i}] {url:?}: {problem}"));
            }
        }
        metrics_urls.insert(pool.clone(), urls);
    }
    let pools_table = c.table(&t, "pools", &[]);
    let mut pools = BTreeMap::new();
    for (pool, value) in pools_table.entries() {
        if let Err(problem) = validate_part("pool name", pool) {
            c.at(&pools_table, pool, problem);
            continue;
        }
        let entry = c.entry(&pools_table, pool, value, PoolSettings::KEYS);
        pools.insert(pool.clone(), pool_settings(c, &entry));
    }
    let settings = DispatcherSettings {
        gate_type: c.text(&t, "gate_type").or(d.gate_type),
        max_num_seqs: facts.max_num_seqs,
        pods: facts.pods.unwrap_or(d.pods),
        headroom: facts.headroom.unwrap_or(d.headroom),
        max_concurrency: facts.max_concurrency,
        baseline: facts.baseline,
        poll_interval: c.bounded_duration(
            &t,
            "poll_interval",
            d.poll_interval,
            std::time::Duration::from_secs(60),
        ),
        batch_size,
        concurrency,
        prometheus_cache_ttl: t
            .get("prometheus_cache_ttl")
            .map(|_| c.duration(&t, "prometheus_cache_ttl", std::time::Duration::ZERO)),
        metrics_urls,
        waiting_gate: c.boolean(&t, "waiting_gate", d.waiting_gate),
        pools,
    };
    (settings, pools_table)
}

/// The keys a pool may override, as set in `t`: the dispatcher's table (the defaults of every
/// pool) or one entry of its `pools`.
fn pool_settings(c: &mut Collector<'_>, t: &Table<'_>) -> PoolSettings {
    let mut fraction = |key: &str, why: &str| {
        let value = t.get(key).map(|_| c.float(t, key, 0.0));
        if let Some(v) = value.filter(|v| !(0.0..1.0).contains(v)) {
            c.at(t, key, format!("must be in [0, 1){why}, got {v}"));
        }
        value
    };
    let headroom = fraction("headroom", "");
    let baseline = fraction("baseline", " (at 1 the gate never opens)");
    PoolSettings {
        max_num_seqs: optional_count(c, t, "max_num_seqs"),
        pods: t
            .get("pods")
            .map(|_| c.bounded_count(t, "pods", 1usize, 1, 100_000)),
        headroom,
        max_concurrency: optional_count(c, t, "max_concurrency"),
        baseline,
    }
}

/// A count from 1 to a million, `None` when unset.
fn optional_count(c: &mut Collector<'_>, t: &Table<'_>, key: &str) -> Option<usize> {
    t.get(key)
        .map(|_| c.bounded_count(t, key, 1usize, 1, 1_000_000))
}

/// Each pool of `async_dispatch.dispatcher.pools` must be some model's pool: an override of a
/// pool no queue serves is a typo that would otherwise be silently ignored.
fn check_dispatcher_pools(
    c: &mut Collector<'_>,
    pools_table: &Table<'_>,
    models: &BTreeMap<String, ModelGatewayConfig>,
) {
    let known: std::collections::BTreeSet<&str> = models
        .values()
        .filter_map(|m| m.inference_pool_name.as_deref())
        .collect();
    for (pool, _) in pools_table.entries() {
        if !known.contains(pool.as_str()) && validate_part("pool name", pool).is_ok() {
            let problem = match known.is_empty() {
                true => format!("no model has inference_pool_name {pool} (no model names a pool)"),
                false => format!(
                    "no model has inference_pool_name {pool} (the models' pools: {})",
                    known.iter().copied().collect::<Vec<_>>().join(", ")
                ),
            };
            c.at(pools_table, pool, problem);
        }
    }
}

/// A string that becomes one `:`-separated part of a Redis key.
fn name_part(
    c: &mut Collector<'_>,
    t: &Table<'_>,
    key: &str,
    what: &'static str,
) -> Option<String> {
    let value = c.string(t, key)?;
    match validate_part(what, &value) {
        Ok(()) => Some(value),
        Err(e) => {
            c.at(t, key, e);
            None
        }
    }
}

fn model_gateways(
    c: &mut Collector<'_>,
    root: &Table<'_>,
    mode: DispatchMode,
) -> BTreeMap<String, ModelGatewayConfig> {
    let t = c.table(root, "model_gateways", &[]);
    let mut models = BTreeMap::new();
    for (name, value) in t.entries() {
        if name.trim().is_empty() || name.trim() != name {
            c.at(
                &t,
                name,
                "a model name must be non-empty, without surrounding spaces",
            );
        }
        let entry = c.entry(&t, name, value, &MODEL_KEYS);
        models.insert(name.clone(), model(c, &entry, mode));
    }
    if models.is_empty() {
        c.error(
            t.tag(),
            t.path(),
            "no model configured (add at least one model under model_gateways)",
        );
    }
    models
}

fn model(c: &mut Collector<'_>, t: &Table<'_>, mode: DispatchMode) -> ModelGatewayConfig {
    let d = ModelGatewayConfig::default();

    let url = c.text(t, "url");
    match &url {
        Some(url) => {
            if let Err(problem) = check_http_url(url) {
                c.at(t, "url", problem);
            }
        }
        None if mode == DispatchMode::Sync && t.get("url").is_none() => {
            c.at(t, "url", "missing (every model needs a url in sync mode)");
        }
        None => {}
    }

    let inference_pool_name = name_part(c, t, "inference_pool_name", "pool name");
    if mode == DispatchMode::Async && t.get("inference_pool_name").is_none() {
        c.at(
            t,
            "inference_pool_name",
            "missing (every model needs an inference_pool_name in async mode)",
        );
    }

    let request_timeout = c.positive_duration(t, "request_timeout", d.request_timeout);
    let max_retries = c.bounded_count(t, "max_retries", d.max_retries, 0, 1_000);
    let initial_backoff = c.duration(t, "initial_backoff", d.initial_backoff);
    let max_backoff = c.duration(t, "max_backoff", d.max_backoff);
    if max_backoff < initial_backoff {
        let problem = format!(
            "must be at least initial_backoff ({})",
            humantime::format_duration(initial_backoff)
        );
        c.at(t, "max_backoff", problem);
    }

    let api_key_file = c.path(t, "api_key_file");
    let api_key = api_key_file
        .as_ref()
        .and_then(|file| read_secret(c, t, "api_key_file", file));
    let inference_objective = c.text(t, "inference_objective");
    let tls = tls(c, t);
    let load = load_config(c, t, mode);

    ModelGatewayConfig {
        url,
        inference_pool_name,
        request_timeout,
        max_retries,
        initial_backoff,
        max_backoff,
        api_key_file,
        api_key,
        inference_objective,
        tls,
        load,
    }
}

/// `load`: one source of the pool's load, in sync mode only.
fn load_config(c: &mut Collector<'_>, model: &Table<'_>, mode: DispatchMode) -> Option<LoadConfig> {
    model.get("load")?;
    let t = c.table(model, "load", LoadConfig::KEYS);
    let d = LoadConfig::default();
    if mode == DispatchMode::Async {
        c.at(
            model,
            "load",
            "is read in sync mode only (in async mode the dispatcher's gate reads the pool's load: see processor queues)",
        );
    }
    let metrics_urls = c.strings(&t, "metrics_urls");
    for (i, url) in metrics_urls.iter().enumerate() {
        if let Err(problem) = check_http_url(url) {
            c.at(&t, "metrics_urls", format!("[{i}] {url:?}: {problem}"));
        }
    }
    let prometheus_url = c.text(&t, "prometheus_url");
    if let Some(Err(problem)) = prometheus_url.as_deref().map(check_http_url) {
        c.at(&t, "prometheus_url", problem);
    }
    let pool = name_part(c, &t, "pool", "pool name");
    match (metrics_urls.is_empty(), prometheus_url.is_some()) {
        (true, false) if t.get("metrics_urls").is_none() => c.at(
            model,
            "load",
            "set metrics_urls (the model servers' /metrics) or prometheus_url with pool",
        ),
        (false, true) => c.at(
            &t,
            "prometheus_url",
            "set metrics_urls or prometheus_url, not both",
        ),
        (_, true) if pool.is_none() && t.get("pool").is_none() => c.at(
            &t,
            "pool",
            "missing (prometheus_url needs the pool's inference_pool label)",
        ),
        _ => {}
    }
    let max_running_per_pod = t
        .get("max_running_per_pod")
        .map(|_| c.bounded_count(&t, "max_running_per_pod", 1usize, 1, 1_000_000));
    let interval = c.bounded_duration(
        &t,
        "interval",
        d.interval,
        std::time::Duration::from_secs(60),
    );
    let headroom = c.float(&t, "headroom", d.headroom);
    if !(0.0..1.0).contains(&headroom) {
        c.at(&t, "headroom", format!("must be in [0, 1), got {headroom}"));
    }
    let priority = c.signed(&t, "priority");
    Some(LoadConfig {
        metrics_urls,
        prometheus_url,
        pool,
        max_running_per_pod,
        interval,
        headroom,
        priority,
    })
}

/// TLS settings, written either flat (`tls_ca_cert_file`, as the issue and the Go processor spell
/// them) or nested (`tls: {ca_cert_file}`); setting one field both ways is an error.
fn tls(c: &mut Collector<'_>, model: &Table<'_>) -> TlsConfig {
    let nested = c.table(model, "tls", TlsConfig::KEYS);
    let ca_cert_file = tls_file(c, model, &nested, "ca_cert_file").map(|(path, ..)| path);
    let client_cert = tls_file(c, model, &nested, "client_cert_file");
    let client_key = tls_file(c, model, &nested, "client_key_file");
    match (&client_cert, &client_key) {
        (Some((_, table, key)), None) => {
            c.at(table, key, "set tls_client_key_file too (both or neither)")
        }
        (None, Some((_, table, key))) => {
            c.at(table, key, "set tls_client_cert_file too (both or neither)")
        }
        _ => {}
    }
    let (table, key) = tls_field(c, model, &nested, "insecure_skip_verify");
    TlsConfig {
        ca_cert_file,
        client_cert_file: client_cert.map(|(path, ..)| path),
        client_key_file: client_key.map(|(path, ..)| path),
        insecure_skip_verify: c.boolean(&table, &key, false),
    }
}

/// Where a TLS field is set: `(model, "tls_<field>")` or `(tls, "<field>")`.
fn tls_field<'v>(
    c: &mut Collector<'_>,
    model: &Table<'v>,
    nested: &Table<'v>,
    field: &str,
) -> (Table<'v>, String) {
    let flat = format!("tls_{field}");
    match (model.get(&flat).is_some(), nested.get(field).is_some()) {
        (true, true) => {
            c.at(model, &flat, format!("also set as tls.{field}; keep one"));
            (model.clone(), flat)
        }
        (false, true) => (nested.clone(), field.to_owned()),
        _ => (model.clone(), flat),
    }
}

/// A TLS file, which must be readable now rather than at the first request.
fn tls_file<'v>(
    c: &mut Collector<'_>,
    model: &Table<'v>,
    nested: &Table<'v>,
    field: &str,
) -> Option<(PathBuf, Table<'v>, String)> {
    let (table, key) = tls_field(c, model, nested, field);
    let path = c.path(&table, &key)?;
    if let Err(e) = std::fs::File::open(&path) {
        c.at(&table, &key, format!("cannot read {}: {e}", path.display()));
    }
    Some((path, table, key))
}

/// `redis_tls`: readable files, cert and key together, only with a TLS URL, and (with one)
/// usable by the connection library exactly as connecting would use them.
fn redis_tls(
    c: &mut Collector<'_>,
    root: &Table<'_>,
    url: Option<&batch_redis::RedisUrl>,
) -> Option<RedisTlsConfig> {
    let t = c.table(root, "redis_tls", RedisTlsConfig::KEYS);
    let mut usable = true;
    let mut file = |c: &mut Collector<'_>, key: &str| {
        let path = c.path(&t, key)?;
        if let Err(e) = std::fs::File::open(&path) {
            c.at(&t, key, format!("cannot read {}: {e}", path.display()));
            usable = false;
        }
        Some(path)
    };
    let ca_file = file(c, "ca_file");
    let cert_file = file(c, "cert_file");
    let key_file = file(c, "key_file");
    match (&cert_file, &key_file) {
        (Some(_), None) => {
            c.at(&t, "cert_file", "set key_file too (both or neither)");
            usable = false;
        }
        (None, Some(_)) => {
            c.at(&t, "key_file", "set cert_file too (both or neither)");
            usable = false;
        }
        _ => {}
    }
    let server_name = c.text(&t, "server_name");
    root.get("redis_tls")?;
    let config = RedisTlsConfig {
        ca_file,
        cert_file,
        key_file,
        server_name,
    };
    match url {
        Some(url) if !url.is_tls() => {
            let problem = "redis_tls is set but the URL in redis_url_file is not rediss:// \
                (nor rediss-cluster://, rediss-sentinel://); use a TLS URL or remove redis_tls";
            c.at(root, "redis_tls", problem);
        }
        Some(_) if usable => {
            if let Err(e) = config.to_options().check() {
                c.at(root, "redis_tls", e);
            }
        }
        _ => {}
    }
    Some(config)
}

fn concurrency(c: &mut Collector<'_>, root: &Table<'_>) -> ConcurrencyConfig {
    let t = c.table(root, "concurrency", ConcurrencyConfig::KEYS);
    let d = ConcurrencyConfig::default();
    let global = c.bounded_count(&t, "global", d.global, 1, 1_000_000);
    let per_endpoint = c.bounded_count(&t, "per_endpoint", d.per_endpoint, 1, 1_000_000);

    let a = c.table(&t, "aimd", AimdConfig::KEYS);
    let enabled = c.boolean(&a, "enabled", d.aimd.enabled);
    let algorithm = match c.string(&a, "algorithm") {
        None => d.aimd.algorithm,
        Some(name) => name.parse().unwrap_or_else(|_| {
            let names: Vec<_> = LimiterAlgorithm::ALL.iter().map(|a| a.name()).collect();
            let problem = format!(
                "unknown limiter algorithm {name:?} (expected {})",
                names.join(" or ")
            );
            c.at(&a, "algorithm", problem);
            d.aimd.algorithm
        }),
    };
    let min = c.count(&a, "min", d.aimd.min, 1);
    if enabled && min > per_endpoint {
        let problem = format!("{min} is above concurrency.per_endpoint ({per_endpoint})");
        c.at(&a, "min", problem);
    }
    let backoff_factor = c.float(&a, "backoff_factor", d.aimd.backoff_factor);
    // `!(x > 0 && x < 1)` also rejects NaN.
    if !(backoff_factor > 0.0 && backoff_factor < 1.0) {
        let problem = format!("must be strictly between 0 and 1, got {backoff_factor}");
        c.at(&a, "backoff_factor", problem);
    }
    let additive_increase = c.count(&a, "additive_increase", d.aimd.additive_increase, 1);

    ConcurrencyConfig {
        global,
        per_endpoint,
        aimd: AimdConfig {
            enabled,
            algorithm,
            min,
            backoff_factor,
            additive_increase,
        },
    }
}

/// Reads a mounted secret, trimmed. Errors name the field and the file, never the content.
fn read_secret(c: &mut Collector<'_>, t: &Table<'_>, key: &str, file: &Path) -> Option<Secret> {
    match std::fs::read_to_string(file) {
        Ok(text) if text.trim().is_empty() => {
            c.at(t, key, format!("secret file {} is empty", file.display()));
            None
        }
        Ok(text) => Some(Secret::new(text.trim())),
        Err(e) => {
            c.at(
                t,
                key,
                format!("cannot read secret file {}: {e}", file.display()),
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flat TLS keys a model accepts are the ones the resolved config prints (the serde
    /// renames of [`TlsConfig`]), so a config printed can be read back.
    #[test]
    fn the_flat_tls_keys_are_the_printed_ones() {
        let printed = serde_yaml::to_value(TlsConfig::default()).unwrap();
        let printed: Vec<_> = printed
            .as_mapping()
            .unwrap()
            .keys()
            .map(|k| k.as_str().unwrap())
            .collect();
        assert_eq!(printed, TlsConfig::FLAT_KEYS);
        assert!(MODEL_KEYS.contains(&"tls"));
        assert!(TlsConfig::FLAT_KEYS.iter().all(|k| MODEL_KEYS.contains(k)));
    }
}
