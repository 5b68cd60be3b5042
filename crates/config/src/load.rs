//! Loading: figment providers → value tree → validated [`ProcessorConfig`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use batch_queue_names::validate_part;
use figment::providers::{Env, Format, Yaml};
use figment::value::Value;
use figment::Figment;

use crate::collect::{Collector, Table};
use crate::error::{ConfigError, ConfigErrors};
use crate::types::*;
use crate::values::{check_http_url, check_redis_url};

/// Prefix of the environment variables that override the file (`PROCESSOR_DISPATCH_MODE=async`).
pub const ENV_PREFIX: &str = "PROCESSOR_";

/// Separator of nested keys in environment variable names
/// (`PROCESSOR_ASYNC_DISPATCH__RESULT_POLL_TIMEOUT=1s`).
pub const ENV_NESTING: &str = "__";

const ROOT_KEYS: &[&str] = &[
    "dispatch_mode",
    "async_dispatch",
    "model_gateways",
    "concurrency",
    "redis_url_file",
    "redis_tls",
    "redis_allow_eviction",
    "work_dir",
    "observability",
    "input",
    "serve",
];
const ASYNC_KEYS: &[&str] = &[
    "result_poll_timeout",
    "queue_prefix",
    "consumer_id",
    "retry_queue_name",
    "lost_request_timeout",
    "enqueue_chunk",
    "result_batch",
    "result_linger",
];
const MODEL_KEYS: &[&str] = &[
    "url",
    "inference_pool_name",
    "request_timeout",
    "max_retries",
    "initial_backoff",
    "max_backoff",
    "api_key_file",
    "inference_objective",
    "tls",
    "tls_ca_cert_file",
    "tls_client_cert_file",
    "tls_client_key_file",
    "tls_insecure_skip_verify",
];
const TLS_KEYS: &[&str] = &[
    "ca_cert_file",
    "client_cert_file",
    "client_key_file",
    "insecure_skip_verify",
];
const REDIS_TLS_KEYS: &[&str] = &["ca_file", "cert_file", "key_file", "server_name"];
const CONCURRENCY_KEYS: &[&str] = &["global", "per_endpoint", "aimd"];
const AIMD_KEYS: &[&str] = &[
    "enabled",
    "algorithm",
    "min",
    "backoff_factor",
    "additive_increase",
];
const OBSERVABILITY_KEYS: &[&str] = &["addr"];
const INPUT_KEYS: &[&str] = &["max_requests", "max_file_bytes"];
const SERVE_KEYS: &[&str] = &[
    "listen",
    "api_keys_file",
    "tenant_header",
    "pass_through_headers",
    "webhooks",
    "storage",
    "max_active_jobs",
    "state_prefix",
    "reaper_interval",
    "replica_id",
    "lease_ttl",
    "checkpoint_interval",
    "s3",
    "header_read_timeout",
    "idle_timeout",
    "max_connections",
    "max_json_body_bytes",
    "max_form_field_bytes",
    "max_filename_bytes",
    "max_id_bytes",
    "tenant_max_batches",
    "tenant_max_stored_bytes",
    "tenant_max_files",
    "tenant_max_running_batches",
    "tenant_max_requests_in_flight",
];
const WEBHOOKS_KEYS: &[&str] = &[
    "allowed_hosts",
    "allow_http",
    "timeout",
    "retry_initial_backoff",
    "give_up_after",
];
const S3_KEYS: &[&str] = &[
    "endpoint",
    "region",
    "allow_http",
    "profile",
    "access_key_id_file",
    "secret_access_key_file",
];

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
    let root = c.root(root, ROOT_KEYS);
    let dispatch_mode = dispatch_mode(c, &root);
    let async_dispatch = async_dispatch(c, &root);
    let model_gateways = model_gateways(c, &root, dispatch_mode);
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

    let observability_table = c.table(&root, "observability", OBSERVABILITY_KEYS);
    let observability = ObservabilityConfig {
        addr: c.socket_addr(&observability_table, "addr"),
    };
    let input_table = c.table(&root, "input", INPUT_KEYS);
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

/// The longest an edge timeout may be set to.
const HOUR: std::time::Duration = std::time::Duration::from_secs(3600);

fn serve(c: &mut Collector<'_>, root: &Table<'_>, work_dir: &Path, needs: Needs) -> ServeConfig {
    let t = c.table(root, "serve", SERVE_KEYS);
    let d = ServeConfig::defaults(work_dir);
    let api_keys_file = c.path(&t, "api_keys_file");
    let api_keys = match (&api_keys_file, needs) {
        (Some(file), Needs::Service) => read_api_keys(c, &t, file),
        _ => Vec::new(),
    };
    let tenant_header =
        c.text(&t, "tenant_header")
            .and_then(|name| match check_header_name(&name) {
                Ok(name) => Some(name),
                Err(problem) => {
                    c.at(&t, "tenant_header", problem);
                    None
                }
            });
    if tenant_header.is_some() && api_keys_file.is_some() {
        c.at(
            &t,
            "tenant_header",
            "set either tenant_header or api_keys_file, not both: they are two ways to name tenants",
        );
    }
    let pass_through_headers = pass_through_headers(c, &t);
    let webhooks = webhooks(c, &t);
    let storage = match c.text(&t, "storage") {
        None => d.storage,
        Some(url) => match check_storage_url(&url) {
            Ok(()) => url,
            Err(problem) => {
                c.at(&t, "storage", problem);
                d.storage
            }
        },
    };
    let state_prefix = name_part(c, &t, "state_prefix", "prefix").unwrap_or(d.state_prefix);
    let s3 = s3(c, &t, needs);
    ServeConfig {
        listen: c.socket_addr(&t, "listen").unwrap_or(d.listen),
        api_keys_file,
        api_keys,
        tenant_header,
        pass_through_headers,
        webhooks,
        storage,
        s3,
        max_active_jobs: c.bounded_count(&t, "max_active_jobs", d.max_active_jobs, 1, 10_000),
        state_prefix,
        reaper_interval: c.positive_duration(&t, "reaper_interval", d.reaper_interval),
        replica_id: name_part(c, &t, "replica_id", "replica id").unwrap_or(d.replica_id),
        lease_ttl: c.positive_duration(&t, "lease_ttl", d.lease_ttl),
        checkpoint_interval: c.positive_duration(&t, "checkpoint_interval", d.checkpoint_interval),
        header_read_timeout: c.bounded_duration(
            &t,
            "header_read_timeout",
            d.header_read_timeout,
            HOUR,
        ),
        idle_timeout: c.bounded_duration(&t, "idle_timeout", d.idle_timeout, HOUR),
        max_connections: c.bounded_count(&t, "max_connections", d.max_connections, 1, 1 << 20),
        max_json_body_bytes: c.bounded_byte_size(
            &t,
            "max_json_body_bytes",
            d.max_json_body_bytes,
            1 << 30,
        ),
        max_form_field_bytes: c.bounded_byte_size(
            &t,
            "max_form_field_bytes",
            d.max_form_field_bytes,
            1 << 30,
        ),
        max_filename_bytes: c.bounded_count(
            &t,
            "max_filename_bytes",
            d.max_filename_bytes,
            1,
            1 << 20,
        ),
        max_id_bytes: c.bounded_count(&t, "max_id_bytes", d.max_id_bytes, 16, 1 << 16),
        tenant_max_batches: c.bounded_count(
            &t,
            "tenant_max_batches",
            d.tenant_max_batches,
            1,
            1 << 30,
        ),
        tenant_max_stored_bytes: c.bounded_byte_size(
            &t,
            "tenant_max_stored_bytes",
            d.tenant_max_stored_bytes,
            1 << 50,
        ),
        tenant_max_files: c.bounded_count(&t, "tenant_max_files", d.tenant_max_files, 1, 1 << 30),
        tenant_max_running_batches: c.bounded_count(
            &t,
            "tenant_max_running_batches",
            d.tenant_max_running_batches,
            1,
            1 << 20,
        ),
        tenant_max_requests_in_flight: c.bounded_count(
            &t,
            "tenant_max_requests_in_flight",
            d.tenant_max_requests_in_flight,
            0,
            1_000_000,
        ),
    }
}

/// `serve.s3`; the key files are read for the service only.
fn s3(c: &mut Collector<'_>, serve: &Table<'_>, needs: Needs) -> S3Config {
    let t = c.table(serve, "s3", S3_KEYS);
    let allow_http = t
        .get("allow_http")
        .map(|_| c.boolean(&t, "allow_http", false));
    let endpoint = c.text(&t, "endpoint").filter(|e| {
        let authority = e.split("://").nth(1).unwrap_or_default();
        let authority = authority.split(['/', '?', '#']).next().unwrap_or_default();
        let problem = match check_http_url(e) {
            Err(problem) => format!("{problem}, such as http://minio:9000"),
            Ok(()) if authority.contains('@') || e.contains('?') => {
                "expected no credentials or query in the endpoint: use the key files".to_owned()
            }
            Ok(()) if e.starts_with("http://") && allow_http != Some(true) => {
                "a plain-http endpoint also needs allow_http: true".to_owned()
            }
            Ok(()) => return true,
        };
        c.at(&t, "endpoint", problem);
        false
    });
    let access_key_id_file = c.path(&t, "access_key_id_file");
    let secret_access_key_file = c.path(&t, "secret_access_key_file");
    if access_key_id_file.is_some() != secret_access_key_file.is_some() {
        let missing = match access_key_id_file {
            Some(_) => "secret_access_key_file",
            None => "access_key_id_file",
        };
        c.at(
            &t,
            missing,
            "access_key_id_file and secret_access_key_file go together",
        );
    }
    let read = |c: &mut Collector<'_>, key: &str, file: &Option<PathBuf>| match (file, needs) {
        (Some(file), Needs::Service) => read_secret(c, &t, key, file),
        _ => None,
    };
    let access_key_id = read(c, "access_key_id_file", &access_key_id_file);
    let secret_access_key = read(c, "secret_access_key_file", &secret_access_key_file);
    S3Config {
        endpoint,
        region: c.text(&t, "region"),
        allow_http,
        profile: c.text(&t, "profile"),
        access_key_id_file,
        secret_access_key_file,
        access_key_id,
        secret_access_key,
    }
}

/// `file:///abs/dir`, or `s3://bucket[/prefix]`.
fn check_storage_url(url: &str) -> Result<(), String> {
    if let Some(path) = url.strip_prefix("file://") {
        if !path.starts_with('/') {
            return Err(format!(
                "expected an absolute directory URL such as file:///var/lib/batch/storage, got {url:?}"
            ));
        }
        return Ok(());
    }
    if let Some(rest) = url.strip_prefix("s3://") {
        if rest.split('/').next().is_some_and(|b| !b.is_empty()) {
            return Ok(());
        }
        return Err(format!("expected s3://bucket[/prefix], got {url:?}"));
    }
    Err(format!(
        "expected file:///directory or s3://bucket[/prefix], got {url:?}"
    ))
}

/// Headers the service itself sets on an inference request, or that would change how it is
/// carried: never passed through from a client.
const RESERVED_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "authorization",
    "te",
    "upgrade",
    "keep-alive",
    "proxy-authorization",
];

/// `serve.webhooks`.
fn webhooks(c: &mut Collector<'_>, serve: &Table<'_>) -> WebhooksConfig {
    let t = c.table(serve, "webhooks", WEBHOOKS_KEYS);
    let d = WebhooksConfig::default();
    let mut allowed_hosts = Vec::new();
    for host in string_list(c, &t, "allowed_hosts") {
        match check_allowed_host(&host) {
            Ok(()) => allowed_hosts.push(host.to_ascii_lowercase()),
            Err(problem) => c.at(&t, "allowed_hosts", problem),
        }
    }
    let give_up_after = c.positive_duration(&t, "give_up_after", d.give_up_after);
    if give_up_after < std::time::Duration::from_secs(24 * 3600) {
        c.at(
            &t,
            "give_up_after",
            "must be at least 24h: a receiver gets a day to come back",
        );
    }
    WebhooksConfig {
        allowed_hosts,
        allow_http: c.boolean(&t, "allow_http", d.allow_http),
        timeout: c.bounded_duration(&t, "timeout", d.timeout, HOUR),
        retry_initial_backoff: c.bounded_duration(
            &t,
            "retry_initial_backoff",
            d.retry_initial_backoff,
            HOUR,
        ),
        give_up_after,
    }
}

/// An entry of `serve.webhooks.allowed_hosts`: a CIDR, a host name or `*.` and a domain.
fn check_allowed_host(host: &str) -> Result<(), String> {
    if host.contains('/') {
        return host
            .parse::<ipnet::IpNet>()
            .map(|_| ())
            .map_err(|_| format!("{host:?} is not a CIDR such as 10.0.0.0/8"));
    }
    let name = host.strip_prefix("*.").unwrap_or(host);
    let label = |l: &str| {
        !l.is_empty() && l.len() <= 63 && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    if name.parse::<std::net::IpAddr>().is_ok() || (name.len() <= 253 && name.split('.').all(label))
    {
        return Ok(());
    }
    Err(format!(
        "{host:?} is not a host name, *.domain, IP address or CIDR"
    ))
}

/// A list of non-empty strings under `key`.
fn string_list(c: &mut Collector<'_>, t: &Table<'_>, key: &str) -> Vec<String> {
    let items = match t.get(key) {
        None => return Vec::new(),
        Some(figment::value::Value::Array(_, items)) => items,
        Some(_) => {
            c.at(t, key, "expected a list of strings");
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for item in items {
        match item.as_str() {
            Some(text) if !text.trim().is_empty() => out.push(text.trim().to_owned()),
            _ => c.at(t, key, "expected a list of non-empty strings"),
        }
    }
    out
}

/// `serve.pass_through_headers`: a list of header names, lower-cased, each once.
fn pass_through_headers(c: &mut Collector<'_>, t: &Table<'_>) -> Vec<String> {
    let key = "pass_through_headers";
    let mut names: Vec<String> = Vec::new();
    for name in string_list(c, t, key) {
        match check_header_name(&name) {
            Ok(name) if RESERVED_HEADERS.contains(&name.as_str()) => {
                let problem =
                    format!("{name:?} is set by the service and cannot be passed through");
                c.at(t, key, problem);
            }
            Ok(name) if names.contains(&name) => {
                c.at(t, key, format!("{name:?} is listed twice"));
            }
            Ok(name) => names.push(name),
            Err(problem) => c.at(t, key, problem),
        }
    }
    names
}

/// An HTTP header name (an RFC 9110 token), lower-cased.
fn check_header_name(name: &str) -> Result<String, String> {
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if name.is_empty() || name.len() > 128 || !name.bytes().all(token) {
        return Err(format!(
            "{name:?} is not a header name (1 to 128 letters, digits and -_.!#$%&'*+^`|~)"
        ));
    }
    Ok(name.to_ascii_lowercase())
}

/// `<key> <tenant>` per line; `#` starts a comment. Errors name the file and line, never a key.
fn read_api_keys(c: &mut Collector<'_>, t: &Table<'_>, file: &Path) -> Vec<ApiKey> {
    let text = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(e) => {
            let problem = format!("cannot read secret file {}: {e}", file.display());
            c.at(t, "api_keys_file", problem);
            return Vec::new();
        }
    };
    let mut keys: Vec<ApiKey> = Vec::new();
    let mut lines = 0;
    // An editor's byte order mark would otherwise become part of the first key, which then
    // never matches: the key file's first tenant would be locked out without a word.
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        lines += 1;
        let mut parts = line.split_whitespace();
        let (Some(key), Some(tenant), None) = (parts.next(), parts.next(), parts.next()) else {
            let problem = format!(
                "{} line {}: expected \"<key> <tenant>\"",
                file.display(),
                n + 1
            );
            c.at(t, "api_keys_file", problem);
            continue;
        };
        if let Err(problem) = check_tenant(tenant) {
            let problem = format!("{} line {}: {problem}", file.display(), n + 1);
            c.at(t, "api_keys_file", problem);
            continue;
        }
        if keys.iter().any(|k| k.key.expose() == key) {
            let problem = format!("{} line {}: the same key twice", file.display(), n + 1);
            c.at(t, "api_keys_file", problem);
            continue;
        }
        keys.push(ApiKey {
            key: Secret::new(key),
            tenant: tenant.to_owned(),
        });
    }
    if lines == 0 {
        let problem = format!("{} holds no key", file.display());
        c.at(t, "api_keys_file", problem);
    }
    keys
}

/// The longest tenant name.
const MAX_TENANT: usize = 64;

/// A tenant name: 1 to [`MAX_TENANT`] letters, digits, `-`, `_`, `.` and `@` (a user name from
/// a proxy may be an e-mail address), neither starting with `.` nor holding `..`.
/// Tenants are parts of Redis keys and of log lines, where `/`, `..` or glob characters
/// (`*`, `?`, `[`) would read as something else.
pub fn check_tenant(tenant: &str) -> Result<(), String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@');
    if tenant.is_empty() || tenant.len() > MAX_TENANT {
        return Err(format!(
            "a tenant name has 1 to {MAX_TENANT} characters, got {}",
            tenant.len()
        ));
    }
    if let Some(found) = tenant.chars().find(|c| !allowed(*c)) {
        return Err(format!(
            "tenant {tenant:?} contains {found:?}; use ASCII letters, digits, '-', '_', '.' or '@'"
        ));
    }
    if tenant.starts_with('.') || tenant.contains("..") {
        return Err(format!("tenant {tenant:?} starts with '.' or holds '..'"));
    }
    Ok(())
}

fn dispatch_mode(c: &mut Collector<'_>, root: &Table<'_>) -> DispatchMode {
    match c.string(root, "dispatch_mode").as_deref() {
        None | Some("sync") => DispatchMode::Sync,
        Some("async") => DispatchMode::Async,
        Some(other) => {
            let problem = format!("unknown dispatch mode {other:?} (expected sync or async)");
            c.at(root, "dispatch_mode", problem);
            DispatchMode::Sync
        }
    }
}

fn async_dispatch(c: &mut Collector<'_>, root: &Table<'_>) -> AsyncDispatchConfig {
    let t = c.table(root, "async_dispatch", ASYNC_KEYS);
    let d = AsyncDispatchConfig::default();
    let result_poll_timeout = c.positive_duration(&t, "result_poll_timeout", d.result_poll_timeout);
    let queue_prefix = name_part(c, &t, "queue_prefix", "prefix").unwrap_or(d.queue_prefix);
    let consumer_id = name_part(c, &t, "consumer_id", "consumer id");
    AsyncDispatchConfig {
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
        let entry = c.entry(&t, name, value, MODEL_KEYS);
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
    }
}

/// TLS settings, written either flat (`tls_ca_cert_file`, as the issue and the Go processor spell
/// them) or nested (`tls: {ca_cert_file}`); setting one field both ways is an error.
fn tls(c: &mut Collector<'_>, model: &Table<'_>) -> TlsConfig {
    let nested = c.table(model, "tls", TLS_KEYS);
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
    let t = c.table(root, "redis_tls", REDIS_TLS_KEYS);
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
    let t = c.table(root, "concurrency", CONCURRENCY_KEYS);
    let d = ConcurrencyConfig::default();
    let global = c.bounded_count(&t, "global", d.global, 1, 1_000_000);
    let per_endpoint = c.bounded_count(&t, "per_endpoint", d.per_endpoint, 1, 1_000_000);

    let a = c.table(&t, "aimd", AIMD_KEYS);
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
