#![doc = include_str!("../README.md")]

mod durability;
mod fault;

use std::time::{Duration, Instant};

use fred::prelude::*;
use fred::types::config::ServerConfig;

mod tls;
mod url;

pub use crate::tls::{RedisTls, TlsSetupError};
pub use crate::url::{parse_url, RedisUrl, Topology, UrlError};
pub use durability::{check_durability, durability, Durability, EvictionRefused};
pub use fault::{is_transient, Backoff, Retry, RetryError};

/// How [`connect`] connects and how hard it tries.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Attempts before giving up (at least 1), unless `until` is later.
    pub attempts: u32,
    /// Keep trying until this instant, however many attempts that takes (a job waits out a
    /// Redis that is down when it starts, as it does one that goes down while it runs, until
    /// its own deadline). `None`: `attempts` alone bounds the tries.
    pub until: Option<Instant>,
    /// Wait after the first failure; doubled after each, up to `max_backoff`.
    pub initial_backoff: Duration,
    /// Longest wait between attempts.
    pub max_backoff: Duration,
    /// Time allowed for one connection attempt.
    pub connect_timeout: Duration,
    /// How long a command may wait for its answer (default 30 s; zero: forever). Blocking
    /// commands that wait longer set their own timeout per command.
    pub command_timeout: Duration,
    /// TLS settings for a `rediss…` URL; `None` there means the system's roots. Must be `None`
    /// for a plaintext URL.
    pub tls: Option<RedisTls>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            attempts: 6,
            until: None,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            command_timeout: Duration::from_secs(30),
            tls: None,
        }
    }
}

/// Why no connection was made. Every message names the URL without its secrets.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL is not an accepted Redis URL, or does not go with the options.
    #[error("invalid Redis URL {url}: {reason}")]
    BadUrl {
        /// The URL, secrets removed.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The TLS settings cannot be used (a file is missing or holds no certificate or key).
    #[error("TLS settings for {url} are unusable: {reason}")]
    TlsSetup {
        /// The URL, secrets removed.
        url: String,
        /// What is wrong, naming the field and file.
        reason: String,
    },
    /// The TLS handshake failed; retrying would not help.
    #[error("TLS handshake with {addresses} ({url}) failed: {reason}")]
    Tls {
        /// The URL, secrets removed.
        url: String,
        /// The server(s) of the URL.
        addresses: String,
        /// What failed.
        reason: String,
    },
    /// The server refused the credentials, or the user may not run a command the client needs
    /// to set up its connection.
    #[error("Redis at {url} refused the user or its rights: {reason}")]
    Auth {
        /// The URL, secrets removed.
        url: String,
        /// The server's answer.
        reason: String,
    },
    /// Every attempt failed.
    #[error("cannot reach Redis at {url} after {attempts} attempts: {last}")]
    Unreachable {
        /// The URL, secrets removed.
        url: String,
        /// Attempts made.
        attempts: u32,
        /// The last error.
        last: String,
    },
}

/// Query parameters whose values are shown as they are.
const SHOWN_PARAMS: [&str; 2] = ["node", "sentinelServiceName"];
/// Query parameters shown by name only; any other (even its name) is `***`.
const MASKED_PARAMS: [&str; 2] = ["sentinelUsername", "sentinelPassword"];

/// `url` with its secrets replaced by `***`, for logs and errors: the user name and password, and
/// the values of `sentinelUsername` and `sentinelPassword`, and any unknown query parameter whole
/// (`node` and `sentinelServiceName` are shown).
/// Something that does not parse as a URL is shown as `<redacted>`.
///
/// ```
/// use batch_redis::redact_url;
/// assert_eq!(
///     redact_url("redis-sentinel://u:pw@h:26379/0?sentinelServiceName=m&sentinelPassword=x"),
///     "redis-sentinel://***@h:26379/0?sentinelServiceName=m&sentinelPassword=***"
/// );
/// ```
pub fn redact_url(url: &str) -> String {
    let Ok(parsed) = ::url::Url::parse(url) else {
        return "<redacted>".into();
    };
    let mut out = format!("{}://", parsed.scheme());
    if !parsed.username().is_empty() || parsed.password().is_some() {
        out.push_str("***@");
    }
    out.push_str(parsed.host_str().unwrap_or_default());
    if let Some(port) = parsed.port() {
        out.push_str(&format!(":{port}"));
    }
    let path = parsed.path();
    if path.chars().all(|c| c == '/' || c.is_ascii_digit()) {
        out.push_str(path);
    } else {
        out.push_str("/***");
    }
    let mut separator = '?';
    for (key, value) in parsed.query_pairs() {
        out.push(separator);
        separator = '&';
        if SHOWN_PARAMS.contains(&key.as_ref()) {
            out.push_str(&format!("{key}={value}"));
        } else if MASKED_PARAMS.contains(&key.as_ref()) {
            out.push_str(&format!("{key}=***"));
        } else {
            out.push_str("***");
        }
    }
    out
}

/// A fred [`Builder`] for `url` with TLS and the timeouts of `options` applied, for callers that
/// connect on their own terms (in the background, with their own policy). [`connect`] uses it.
pub fn builder(url: &str, options: &ConnectOptions) -> Result<Builder, ConnectError> {
    let shown = redact_url(url);
    let parsed = parse_url(url).map_err(|e| ConnectError::BadUrl {
        url: shown.clone(),
        reason: e.reason,
    })?;
    let mut config = parsed.config.clone();
    match (parsed.is_tls(), &options.tls) {
        (true, tls) => {
            let tls = tls.clone().unwrap_or_default();
            config.tls = Some(tls.to_fred().map_err(|reason| ConnectError::TlsSetup {
                url: shown.clone(),
                reason,
            })?);
            if let Some(name) = &tls.server_name {
                // Sent as SNI to the configured hosts; the verifier checks this name everywhere.
                for server in servers_mut(&mut config.server) {
                    server.tls_server_name = Some(name.as_str().into());
                }
            }
        }
        (false, Some(_)) => {
            return Err(ConnectError::BadUrl {
                url: shown,
                reason: "TLS settings are given but the URL is not rediss:// (nor rediss-cluster://, rediss-sentinel://)".into(),
            })
        }
        (false, None) => {}
    }
    let mut builder = Builder::from_config(config);
    builder
        .with_connection_config(|c| {
            c.connection_timeout = options.connect_timeout;
            c.max_command_attempts = 10;
        })
        .with_performance_config(|p| p.default_command_timeout = options.command_timeout)
        // Reconnects at most 2 s apart: after an outage ends the client is back within 2 s,
        // not the 10 s a longer cap would leave it waiting (a cheap attempt on a dead link).
        .set_policy(ReconnectPolicy::new_exponential(0, 100, 2_000, 2));
    Ok(builder)
}

fn servers_mut(server: &mut ServerConfig) -> Vec<&mut fred::types::config::Server> {
    match server {
        ServerConfig::Centralized { server } => vec![server],
        ServerConfig::Clustered { hosts, .. } | ServerConfig::Sentinel { hosts, .. } => {
            hosts.iter_mut().collect()
        }
        #[allow(unreachable_patterns)]
        _ => Vec::new(),
    }
}

/// Builds a client for `url` and waits for its first connection, retrying as `options` say.
///
/// TLS handshake and login failures end the attempts at once: they do not heal by waiting.
pub async fn connect(url: &str, options: &ConnectOptions) -> Result<Client, ConnectError> {
    let shown = redact_url(url);
    let builder = builder(url, options)?;
    let parsed = parse_url(url).map_err(|e| ConnectError::BadUrl {
        url: shown.clone(),
        reason: e.reason,
    })?;
    let tls = options.tls.clone().unwrap_or_default();
    let mut backoff = Backoff::new(options.initial_backoff, options.max_backoff);
    let mut last = String::new();
    let mut attempt = 0;
    let more = |attempt: u32| {
        attempt < options.attempts.max(1) || options.until.is_some_and(|u| Instant::now() < u)
    };
    while more(attempt) {
        attempt += 1;
        let client = builder.build().map_err(|e| ConnectError::BadUrl {
            url: shown.clone(),
            reason: e.details().to_string(),
        })?;
        match client.init().await {
            Ok(_) => return Ok(client),
            Err(e) => {
                let _ = client.quit().await;
                last = e.details().to_string();
                if let Some(error) = lasting_failure(&last, &parsed, &tls, &shown).await {
                    return Err(error);
                }
                if more(attempt) {
                    wait_to_retry(&mut backoff, options, attempt, &shown, &last).await;
                }
            }
        }
    }
    Err(ConnectError::Unreachable {
        url: shown,
        attempts: attempt,
        last,
    })
}

/// The error of a failed first connection that waiting does not heal (a TLS handshake, a
/// login, a plaintext server behind a TLS URL), if `last` is one.
async fn lasting_failure(
    last: &str,
    parsed: &RedisUrl,
    tls: &RedisTls,
    shown: &str,
) -> Option<ConnectError> {
    if parsed.is_tls() {
        if let Some(reason) = tls::explain_handshake(last, tls) {
            return Some(ConnectError::Tls {
                url: shown.to_owned(),
                addresses: parsed.addresses(),
                reason,
            });
        }
    }
    if is_auth_failure(last) {
        return Some(ConnectError::Auth {
            url: shown.to_owned(),
            reason: last.to_owned(),
        });
    }
    if parsed.is_tls() {
        // A plaintext server just waits for a command that never comes: ask it.
        if let Some((host, port)) = plaintext_node(parsed).await {
            return Some(ConnectError::Tls {
                url: shown.to_owned(),
                addresses: format!("{host}:{port}"),
                reason: "the server answers in plaintext, not TLS (does the server speak TLS? \
                    use redis:// for a plaintext server, or the server's TLS port)"
                    .into(),
            });
        }
    }
    None
}

/// Sleeps the backoff before the next attempt (never past `options.until`), saying so once.
async fn wait_to_retry(
    backoff: &mut Backoff,
    options: &ConnectOptions,
    attempt: u32,
    shown: &str,
    last: &str,
) {
    let mut wait = backoff.next_wait();
    if let Some(until) = options.until {
        wait = wait.min(until.saturating_duration_since(Instant::now()));
    }
    if attempt == 1 {
        match options.until {
            Some(until) => {
                tracing::warn!(url = %shown, error = %last, "Redis not reachable; waiting for it for up to {:?} (the jobs' deadline), logged once", until.saturating_duration_since(Instant::now()))
            }
            None => {
                tracing::warn!(url = %shown, error = %last, "Redis not reachable; retrying (logged once)")
            }
        }
    } else {
        tracing::debug!(url = %shown, attempt, error = %last, "Redis still not reachable, retrying in {wait:?}");
    }
    tokio::time::sleep(wait).await;
}

/// The first node of `url` that answers a plaintext `PING` with a Redis reply, if any.
async fn plaintext_node(url: &RedisUrl) -> Option<(String, u16)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for (host, port) in url.nodes() {
        let probe = async {
            let mut stream = tokio::net::TcpStream::connect((host.as_str(), *port))
                .await
                .ok()?;
            stream.write_all(b"PING\r\n").await.ok()?;
            let mut first = [0u8; 1];
            stream.read_exact(&mut first).await.ok()?;
            // +PONG, or -NOAUTH when a password is required: a RESP reply either way.
            matches!(first[0], b'+' | b'-').then_some(())
        };
        if let Ok(Some(())) = tokio::time::timeout(Duration::from_secs(2), probe).await {
            return Some((host.clone(), *port));
        }
    }
    None
}

fn is_auth_failure(detail: &str) -> bool {
    [
        "WRONGPASS",
        "NOAUTH",
        "NOPERM",
        "invalid password",
        "invalid username-password",
    ]
    .iter()
    .any(|s| detail.contains(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_hides_credentials_only() {
        assert_eq!(
            redact_url("redis://127.0.0.1:6390/0"),
            "redis://127.0.0.1:6390/0"
        );
        assert_eq!(
            redact_url("redis://user:s3cret@127.0.0.1:6390/2"),
            "redis://***@127.0.0.1:6390/2"
        );
        assert_eq!(redact_url("rediss://:p%40ss@host"), "rediss://***@host");
        assert_eq!(redact_url("garbage s3cret"), "<redacted>");
    }

    #[test]
    fn redaction_covers_cluster_and_sentinel_urls() {
        assert_eq!(
            redact_url(
                "rediss-cluster://batch:s3cret@10.0.0.1:7000?node=10.0.0.2:7000&node=10.0.0.3:7000"
            ),
            "rediss-cluster://***@10.0.0.1:7000?node=10.0.0.2:7000&node=10.0.0.3:7000"
        );
        let shown = redact_url(
            "redis-sentinel://:s3cret@h:26379/2?sentinelServiceName=main&sentinelUsername=admin\
             &sentinelPassword=t0p&node=h2:26379",
        );
        assert_eq!(
            shown,
            "redis-sentinel://***@h:26379/2?sentinelServiceName=main&sentinelUsername=***\
             &sentinelPassword=***&node=h2:26379"
        );
        // Whatever else could hide a secret is masked too.
        assert_eq!(redact_url("redis://h/s3cret"), "redis://h/***");
        assert_eq!(redact_url("redis://h?s3cret"), "redis://h?***");
        assert_eq!(redact_url("redis://h?x=s3cret"), "redis://h?***");
        assert_eq!(redact_url("redis://:s3cret@h#frag"), "redis://***@h");
        for url in [
            "redis://u:s3cret@[::1]:6379",
            "redis://user@h",
            "redis://:p%2Fss@h",
        ] {
            let shown = redact_url(url);
            assert!(
                !shown.contains("s3cret") && !shown.contains("user") && !shown.contains("p%2Fss"),
                "{shown}"
            );
        }
    }

    #[tokio::test]
    async fn connects_to_a_real_server() {
        let redis = batch_testkit::RedisServer::start();
        let client = connect(&redis.url(), &ConnectOptions::default())
            .await
            .unwrap();
        let pong: String = client.ping(None).await.unwrap();
        assert_eq!(pong, "PONG");
    }

    #[tokio::test]
    async fn gives_up_after_bounded_attempts_without_leaking_the_password() {
        let port = batch_testkit::free_port();
        let options = ConnectOptions {
            attempts: 3,
            initial_backoff: Duration::from_millis(10),
            ..ConnectOptions::default()
        };
        let started = std::time::Instant::now();
        let err = connect(&format!("redis://u:hunter2@127.0.0.1:{port}"), &options)
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, ConnectError::Unreachable { attempts: 3, .. }),
            "{text}"
        );
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[tokio::test]
    async fn a_bad_url_is_named() {
        let err = connect("http://x", &ConnectOptions::default())
            .await
            .unwrap_err();
        assert!(matches!(err, ConnectError::BadUrl { .. }), "{err}");
    }
}
