//! The `serve:` section: the service's listener, limits, tenants, storage and webhooks.

use std::path::{Path, PathBuf};

use super::{name_part, read_secret, Needs};
use crate::collect::{Collector, Table};
use crate::types::*;
use crate::values::check_http_url;

/// The longest an edge timeout may be set to.
const HOUR: std::time::Duration = std::time::Duration::from_secs(3600);

pub(super) fn serve(
    c: &mut Collector<'_>,
    root: &Table<'_>,
    work_dir: &Path,
    needs: Needs,
) -> ServeConfig {
    let t = c.table(root, "serve", ServeConfig::KEYS);
    // Each step overwrites the defaults with what is set; the steps run in the order of the
    // keys they read, so that the problems are reported in that order.
    let mut serve = ServeConfig::defaults(work_dir);
    tenant_naming(c, &t, needs, &mut serve);
    serve.webhooks = webhooks(c, &t);
    storage(c, &t, &mut serve);
    serve.s3 = s3(c, &t, needs);
    serve.tls = tls(c, &t);
    serve.listen = c.socket_addr(&t, "listen").unwrap_or(serve.listen);
    jobs_and_leases(c, &t, &mut serve);
    edge_limits(c, &t, &mut serve);
    tenant_quotas(c, &t, &mut serve);
    serve
}

/// How requests name their tenant: API keys (read for the service only), or a trusted header,
/// and the headers passed through to the model gateways.
fn tenant_naming(c: &mut Collector<'_>, t: &Table<'_>, needs: Needs, serve: &mut ServeConfig) {
    let api_keys_file = c.path(t, "api_keys_file");
    if let (Some(file), Needs::Service) = (&api_keys_file, needs) {
        serve.api_keys = read_api_keys(c, t, file);
    }
    let tenant_header =
        c.text(t, "tenant_header")
            .and_then(|name| match check_header_name(&name) {
                Ok(name) => Some(name),
                Err(problem) => {
                    c.at(t, "tenant_header", problem);
                    None
                }
            });
    if tenant_header.is_some() && api_keys_file.is_some() {
        c.at(
            t,
            "tenant_header",
            "set either tenant_header or api_keys_file, not both: they are two ways to name tenants",
        );
    }
    serve.pass_through_headers = pass_through_headers(c, t, tenant_header.as_deref());
    serve.api_keys_file = api_keys_file;
    serve.tenant_header = tenant_header;
}

/// Where files and the service's state live: the storage URL and the state's key prefix.
fn storage(c: &mut Collector<'_>, t: &Table<'_>, serve: &mut ServeConfig) {
    if let Some(url) = c.text(t, "storage") {
        match check_storage_url(&url) {
            Ok(()) => serve.storage = url,
            Err(problem) => c.at(t, "storage", problem),
        }
    }
    if let Some(prefix) = name_part(c, t, "state_prefix", "prefix") {
        serve.state_prefix = prefix;
    }
}

/// How many jobs this replica runs, and the leases and checkpoints that let another take over.
fn jobs_and_leases(c: &mut Collector<'_>, t: &Table<'_>, serve: &mut ServeConfig) {
    serve.max_active_jobs = c.bounded_count(t, "max_active_jobs", serve.max_active_jobs, 1, 10_000);
    serve.reaper_interval = c.positive_duration(t, "reaper_interval", serve.reaper_interval);
    if let Some(replica_id) = name_part(c, t, "replica_id", "replica id") {
        serve.replica_id = replica_id;
    }
    serve.lease_ttl = c.positive_duration(t, "lease_ttl", serve.lease_ttl);
    serve.checkpoint_interval =
        c.positive_duration(t, "checkpoint_interval", serve.checkpoint_interval);
}

/// What the listener accepts: its timeouts, connection caps and request sizes.
fn edge_limits(c: &mut Collector<'_>, t: &Table<'_>, serve: &mut ServeConfig) {
    serve.header_read_timeout =
        c.bounded_duration(t, "header_read_timeout", serve.header_read_timeout, HOUR);
    serve.first_request_timeout = c.bounded_duration(
        t,
        "first_request_timeout",
        serve.first_request_timeout,
        HOUR,
    );
    serve.idle_timeout = c.bounded_duration(t, "idle_timeout", serve.idle_timeout, HOUR);
    serve.max_connections = t
        .get("max_connections")
        .map(|_| c.bounded_count(t, "max_connections", 1, 1, 1 << 20));
    serve.max_connections_per_peer = t
        .get("max_connections_per_peer")
        .map(|_| c.bounded_count(t, "max_connections_per_peer", 0, 0, 1 << 20));
    serve.max_json_body_bytes =
        c.bounded_byte_size(t, "max_json_body_bytes", serve.max_json_body_bytes, 1 << 30);
    serve.max_form_field_bytes = c.bounded_byte_size(
        t,
        "max_form_field_bytes",
        serve.max_form_field_bytes,
        1 << 30,
    );
    serve.max_filename_bytes = c.bounded_count(
        t,
        "max_filename_bytes",
        serve.max_filename_bytes,
        1,
        1 << 20,
    );
    serve.max_id_bytes = c.bounded_count(t, "max_id_bytes", serve.max_id_bytes, 16, 1 << 16);
}

/// What one tenant may hold and run at once, and its share of the gateways.
fn tenant_quotas(c: &mut Collector<'_>, t: &Table<'_>, serve: &mut ServeConfig) {
    serve.tenant_max_batches = c.bounded_count(
        t,
        "tenant_max_batches",
        serve.tenant_max_batches,
        1,
        1 << 30,
    );
    serve.tenant_max_stored_bytes = c.bounded_byte_size(
        t,
        "tenant_max_stored_bytes",
        serve.tenant_max_stored_bytes,
        1 << 50,
    );
    serve.tenant_max_files =
        c.bounded_count(t, "tenant_max_files", serve.tenant_max_files, 1, 1 << 30);
    serve.tenant_max_running_batches = c.bounded_count(
        t,
        "tenant_max_running_batches",
        serve.tenant_max_running_batches,
        1,
        1 << 20,
    );
    serve.tenant_weights = tenant_weights(c, t);
    serve.tenant_preemption = c.boolean(t, "tenant_preemption", serve.tenant_preemption);
    serve.tenant_preemption_min_run = c.bounded_duration(
        t,
        "tenant_preemption_min_run",
        serve.tenant_preemption_min_run,
        HOUR,
    );
    serve.tenant_max_requests_in_flight = c.bounded_count(
        t,
        "tenant_max_requests_in_flight",
        serve.tenant_max_requests_in_flight,
        0,
        1_000_000,
    );
}

/// `serve.tenant_weights`: tenant name to a whole weight from 1 to 1,000.
fn tenant_weights(
    c: &mut Collector<'_>,
    serve: &Table<'_>,
) -> std::collections::BTreeMap<String, u32> {
    let t = c.table(serve, "tenant_weights", &[]);
    let names: Vec<String> = t.entries().map(|(name, _)| name.clone()).collect();
    names
        .into_iter()
        .map(|name| {
            let weight = c.bounded_count(&t, &name, 1, 1, 1_000);
            (name, weight)
        })
        .collect()
}

/// `serve.s3`; the key files are read for the service only.
fn s3(c: &mut Collector<'_>, serve: &Table<'_>, needs: Needs) -> S3Config {
    let t = c.table(serve, "s3", S3Config::KEYS);
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
    "proxy-authenticate",
    "proxy-connection",
    "trailer",
    "expect",
    "cookie",
    "set-cookie",
];

/// `serve.tls`: both files or neither.
fn tls(c: &mut Collector<'_>, serve: &Table<'_>) -> Option<ServeTls> {
    let t = c.table(serve, "tls", ServeTls::KEYS);
    match (c.path(&t, "cert_file"), c.path(&t, "key_file")) {
        (Some(cert_file), Some(key_file)) => Some(ServeTls {
            cert_file,
            key_file,
        }),
        (None, None) => None,
        (Some(_), None) => {
            c.at(&t, "key_file", "is needed with cert_file");
            None
        }
        (None, Some(_)) => {
            c.at(&t, "cert_file", "is needed with key_file");
            None
        }
    }
}

/// `serve.webhooks`.
fn webhooks(c: &mut Collector<'_>, serve: &Table<'_>) -> WebhooksConfig {
    let t = c.table(serve, "webhooks", WebhooksConfig::KEYS);
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
    let allowed_ports = match t.get("allowed_ports") {
        None => d.allowed_ports,
        Some(_) => port_ranges(c, &t, "allowed_ports"),
    };
    WebhooksConfig {
        allowed_hosts,
        allow_http: c.boolean(&t, "allow_http", d.allow_http),
        allowed_ports,
        timeout: c.bounded_duration(&t, "timeout", d.timeout, HOUR),
        retry_initial_backoff: c.bounded_duration(
            &t,
            "retry_initial_backoff",
            d.retry_initial_backoff,
            HOUR,
        ),
        give_up_after,
        max_endpoints_per_tenant: c.bounded_count(
            &t,
            "max_endpoints_per_tenant",
            d.max_endpoints_per_tenant,
            1,
            1000,
        ),
    }
}

/// A list of ports and `low-high` ranges (numbers or strings), none empty, each within 1-65535.
fn port_ranges(
    c: &mut Collector<'_>,
    t: &Table<'_>,
    key: &str,
) -> Vec<std::ops::RangeInclusive<u16>> {
    let Some(figment::value::Value::Array(_, items)) = t.get(key) else {
        c.at(
            t,
            key,
            "expected a list of ports or port ranges (`8000-8999`)",
        );
        return Vec::new();
    };
    let port = |text: &str| text.trim().parse::<u16>().ok().filter(|p| *p > 0);
    let mut out = Vec::new();
    for item in items {
        let text = match item {
            figment::value::Value::Num(_, n) => n.to_u128().map(|n| n.to_string()),
            other => other.as_str().map(str::to_owned),
        };
        let text = text.unwrap_or_default();
        let range = match text.split_once('-') {
            Some((low, high)) => port(low).zip(port(high)).map(|(l, h)| l..=h),
            None => port(&text).map(|p| p..=p),
        };
        match range {
            Some(range) if !range.is_empty() => out.push(range),
            _ => c.at(
                t,
                key,
                format!("{text:?} is not a port (1-65535) or a range of them (`8000-8999`)"),
            ),
        }
    }
    if out.is_empty() {
        c.at(t, key, "must allow at least one port");
    }
    out
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

/// `serve.pass_through_headers`: a list of header names, lower-cased, each once; none that the
/// service sets, that a hop uses (hop-by-hop), that carries a client's credentials or cookies,
/// or the tenant header (which names the tenant to this service, not to the gateway).
fn pass_through_headers(
    c: &mut Collector<'_>,
    t: &Table<'_>,
    tenant_header: Option<&str>,
) -> Vec<String> {
    let key = "pass_through_headers";
    let mut names: Vec<String> = Vec::new();
    for name in string_list(c, t, key) {
        match check_header_name(&name) {
            Ok(name) if RESERVED_HEADERS.contains(&name.as_str()) => {
                let problem = format!(
                    "{name:?} is a hop-by-hop, credential or service-set header and cannot be passed through"
                );
                c.at(t, key, problem);
            }
            Ok(name) if Some(name.as_str()) == tenant_header => {
                let problem = format!("{name:?} is the tenant_header and cannot be passed through");
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

/// A tenant name: 1 to 64 (`MAX_TENANT`) letters, digits, `-`, `_`, `.` and `@` (a user name from
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
