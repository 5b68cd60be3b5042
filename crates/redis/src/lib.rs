//! Connecting to Redis the same way everywhere in the project.
//!
//! [`connect`] tries a bounded number of times with exponential backoff, then reports which
//! server it could not reach, never the password in the URL ([`redact_url`]). Once connected,
//! the client reconnects on its own (exponential backoff, 100 ms to 10 s, without end) and
//! retries commands that were cut off, so a Redis restart is a pause, not a failure.
//!
//! ```no_run
//! use batch_redis::{connect, ConnectOptions};
//! use fred::prelude::*;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let client = connect("redis://127.0.0.1:6390", &ConnectOptions::default()).await?;
//! let pong: String = client.ping(None).await?;
//! assert_eq!(pong, "PONG");
//! # Ok(()) }
//! ```

mod fault;

use std::time::Duration;

use fred::prelude::*;

pub use fault::{is_transient, Retry, RetryError};

/// How hard [`connect`] tries.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Attempts before giving up (at least 1).
    pub attempts: u32,
    /// Wait after the first failure; doubled after each, up to `max_backoff`.
    pub initial_backoff: Duration,
    /// Longest wait between attempts.
    pub max_backoff: Duration,
    /// Time allowed for one connection attempt.
    pub connect_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            attempts: 6,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// Why no connection was made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL is not a Redis URL.
    #[error("invalid Redis URL {url}: {reason}")]
    BadUrl {
        /// The URL, password removed.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Every attempt failed.
    #[error("cannot reach Redis at {url} after {attempts} attempts: {last}")]
    Unreachable {
        /// The URL, password removed.
        url: String,
        /// Attempts made.
        attempts: u32,
        /// The last error.
        last: String,
    },
}

/// `url` with any user name or password replaced by `***`, for logs and errors.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<redacted>".into();
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match authority.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://***@{host}{path}"),
        None => format!("{scheme}://{authority}{path}"),
    }
}

/// Builds a client for `url` and waits for its first connection, retrying as `options` say.
pub async fn connect(url: &str, options: &ConnectOptions) -> Result<Client, ConnectError> {
    let shown = redact_url(url);
    if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
        return Err(ConnectError::BadUrl {
            url: shown,
            reason: "expected redis:// or rediss://".into(),
        });
    }
    let config = Config::from_url(url).map_err(|e| ConnectError::BadUrl {
        url: shown.clone(),
        reason: e.details().to_string(),
    })?;
    let attempts = options.attempts.max(1);
    let mut backoff = options.initial_backoff;
    let mut last = String::new();
    for attempt in 1..=attempts {
        let client = Builder::from_config(config.clone())
            .with_connection_config(|c| {
                c.connection_timeout = options.connect_timeout;
                c.max_command_attempts = 10;
            })
            .set_policy(ReconnectPolicy::new_exponential(0, 100, 10_000, 2))
            .build()
            .map_err(|e| ConnectError::BadUrl {
                url: shown.clone(),
                reason: e.details().to_string(),
            })?;
        match client.init().await {
            Ok(_) => return Ok(client),
            Err(e) => {
                let _ = client.quit().await;
                last = e.details().to_string();
                if attempt < attempts {
                    tracing::warn!(url = %shown, attempt, error = %last, "Redis not reachable, retrying in {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(options.max_backoff);
                }
            }
        }
    }
    Err(ConnectError::Unreachable {
        url: shown,
        attempts,
        last,
    })
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
