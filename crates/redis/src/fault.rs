//! Telling a Redis outage from a mistake, and waiting out the outage.
//!
//! A restart, a failover or a server still loading its data answers with connection errors or
//! with `LOADING`, `READONLY`, `MASTERDOWN`, `OOM`, `TRYAGAIN`, `CLUSTERDOWN`: those pass, and
//! [`Retry::run`] waits them out with capped backoff until its stop token fires, logging one
//! WARN per outage and one INFO when Redis answers again. A wrong type, a missing permission or a
//! bad password will not pass by waiting: they are returned at once.
//!
//! [`Backoff`] is the schedule of waits [`Retry`] keeps, for loops that retry something other
//! than a Redis command (a write to disk, a connection, a lease).

use std::future::Future;
use std::time::{Duration, Instant};

use fred::error::{Error, ErrorKind};
use tokio_util::sync::CancellationToken;

/// Reply prefixes of errors that pass by themselves.
const TRANSIENT_REPLIES: &[&str] = &[
    "LOADING",
    "READONLY",
    "MASTERDOWN",
    "OOM",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "BUSY",
    "NOREPLICAS",
    "UNBLOCKED",
];

/// Whether `error` is an outage that waiting can cure (as opposed to a mistake).
pub fn is_transient(error: &Error) -> bool {
    match error.kind() {
        ErrorKind::IO
        | ErrorKind::Timeout
        | ErrorKind::Canceled
        | ErrorKind::Cluster
        | ErrorKind::Routing
        | ErrorKind::Backpressure
        | ErrorKind::Sentinel => true,
        ErrorKind::Auth | ErrorKind::Config | ErrorKind::Url | ErrorKind::InvalidArgument => false,
        _ => {
            let details = error.details().trim_start();
            TRANSIENT_REPLIES.iter().any(|p| details.starts_with(p))
        }
    }
}

/// Why [`Retry::run`] returned without a value.
#[derive(Debug, thiserror::Error)]
pub enum RetryError {
    /// The stop token fired first.
    #[error("stopped while waiting for Redis")]
    Stopped,
    /// Redis answered with an error that waiting will not cure.
    #[error("{what}: {error}")]
    Failed {
        /// The operation.
        what: String,
        /// Redis' answer.
        error: Error,
    },
}

/// Capped doubling waits between attempts: `first`, twice that, and so on up to `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Default for Backoff {
    /// 100 ms doubling to 5 s.
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(5))
    }
}

impl Backoff {
    /// Waits from `first`, doubled after each, up to `max`.
    pub fn new(first: Duration, max: Duration) -> Self {
        Self {
            first,
            max,
            next: first,
        }
    }

    /// The wait before the next attempt; the one after is twice as long, up to the cap.
    pub fn next_wait(&mut self) -> Duration {
        let wait = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        wait
    }

    /// Sleeps the next wait; false when `stop` fired first.
    pub async fn wait(&mut self, stop: &CancellationToken) -> bool {
        let wait = self.next_wait();
        tokio::select! {
            _ = stop.cancelled() => false,
            _ = tokio::time::sleep(wait) => true,
        }
    }

    /// Starts again from the first wait (the operation succeeded).
    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

/// Retries an operation while Redis is out, until a stop token fires.
#[derive(Debug, Clone)]
pub struct Retry {
    what: String,
    backoff: Backoff,
}

impl Retry {
    /// Retries of `what` (named in logs), 100 ms doubling to 5 s.
    pub fn new(what: impl Into<String>) -> Self {
        Self {
            what: what.into(),
            backoff: Backoff::default(),
        }
    }

    /// The longest wait between attempts.
    pub fn max_backoff(mut self, max: Duration) -> Self {
        let first = self.backoff.first;
        self.backoff = Backoff::new(first, max.max(first));
        self
    }

    /// Runs `op` until it succeeds, fails for good, or `stop` fires.
    pub async fn run<T, F, Fut>(&self, stop: &CancellationToken, mut op: F) -> Result<T, RetryError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let mut backoff = self.backoff.clone();
        let mut outage: Option<Instant> = None;
        loop {
            let result = tokio::select! {
                biased;
                _ = stop.cancelled() => return Err(RetryError::Stopped),
                r = op() => r,
            };
            match result {
                Ok(v) => {
                    if let Some(since) = outage {
                        tracing::info!(operation = %self.what, after = ?since.elapsed(), "Redis answers again");
                    }
                    return Ok(v);
                }
                Err(e) if is_transient(&e) => {
                    if outage.is_none() {
                        outage = Some(Instant::now());
                        tracing::warn!(operation = %self.what, error = %e, "Redis is not answering; waiting for it (logged once per outage)");
                    } else {
                        tracing::debug!(operation = %self.what, error = %e, "Redis still not answering");
                    }
                    if !backoff.wait(stop).await {
                        return Err(RetryError::Stopped);
                    }
                }
                Err(error) => {
                    return Err(RetryError::Failed {
                        what: self.what.clone(),
                        error,
                    })
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outages_and_mistakes_are_told_apart() {
        let io = Error::new(ErrorKind::IO, "Connection refused");
        assert!(is_transient(&io));
        for reply in [
            "LOADING Redis is loading the dataset in memory",
            "READONLY You can't write against a read only replica.",
            "OOM command not allowed when used memory > 'maxmemory'.",
            "MASTERDOWN Link with MASTER is down",
        ] {
            assert!(
                is_transient(&Error::new(ErrorKind::Unknown, reply)),
                "{reply}"
            );
        }
        for reply in [
            "WRONGTYPE Operation against a key holding the wrong kind of value",
            "NOPERM User batch has no permissions to run the 'zadd' command",
            "ERR unknown command",
        ] {
            assert!(
                !is_transient(&Error::new(ErrorKind::Unknown, reply)),
                "{reply}"
            );
        }
        assert!(!is_transient(&Error::new(ErrorKind::Auth, "WRONGPASS")));
    }

    #[test]
    fn backoff_doubles_to_its_cap_and_starts_over() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new(ms(100), ms(350));
        let waits: Vec<_> = (0..4).map(|_| b.next_wait()).collect();
        assert_eq!(waits, [ms(100), ms(200), ms(350), ms(350)]);
        b.reset();
        assert_eq!(b.next_wait(), ms(100));
    }

    #[tokio::test]
    async fn waits_out_an_outage_and_stops_when_told() {
        let mut calls = 0;
        let stop = CancellationToken::new();
        let v = Retry::new("test")
            .run(&stop, || {
                calls += 1;
                let n = calls;
                async move {
                    if n < 3 {
                        Err(Error::new(ErrorKind::IO, "down"))
                    } else {
                        Ok(n)
                    }
                }
            })
            .await
            .unwrap();
        assert_eq!(v, 3);

        let stopper = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            stopper.cancel();
        });
        let r: Result<(), _> = Retry::new("test")
            .run(&stop, || async { Err(Error::new(ErrorKind::IO, "down")) })
            .await;
        assert!(matches!(r, Err(RetryError::Stopped)));

        let r: Result<(), _> = Retry::new("test")
            .run(&CancellationToken::new(), || async {
                Err(Error::new(ErrorKind::Unknown, "NOPERM no"))
            })
            .await;
        assert!(matches!(r, Err(RetryError::Failed { .. })), "{r:?}");
    }
}
