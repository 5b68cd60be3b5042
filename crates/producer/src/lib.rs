#![doc = include_str!("../README.md")]

mod job;
mod messages;

use std::time::Duration;

use batch_redis::{Retry, RetryError};
use fred::clients::Client;
use fred::interfaces::{ClientLike, KeysInterface, SortedSetsInterface};
use fred::types::scripts::Script;
use fred::types::{ClusterHash, CustomCommand, Expiration, Value};
use futures::stream::{FuturesUnordered, StreamExt};
use tokio_util::sync::CancellationToken;

pub use job::{Enqueued, Request, StreamError};
pub use messages::{request_token, JobMessages, PendingMember, MAX_POSITION};

/// Why the producer failed.
#[derive(Debug, thiserror::Error)]
pub enum ProducerError {
    /// A member could not be built from its input line.
    ///
    /// Like every variant, it shows its cause in the message and has no `source()`, so a
    /// printed chain shows the cause once.
    #[error("line {index}: {error}")]
    BadLine {
        /// 0-based line index.
        index: u64,
        /// What is wrong with it.
        error: serde_json::Error,
    },
    /// Redis answered with an error that waiting will not cure (a permission, a wrong type).
    #[error("Redis {command} on {key}: {error}")]
    Redis {
        /// The command.
        command: &'static str,
        /// The key.
        key: String,
        /// Redis' answer.
        error: fred::error::Error,
    },
    /// The producer's stop token fired while it waited for Redis.
    #[error("stopped while waiting for Redis")]
    Stopped,
}

impl ProducerError {
    /// Whether waiting could cure it (by the error's kind, not its text).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Redis { error, .. } => batch_redis::is_transient(error),
            Self::Stopped | Self::BadLine { .. } => false,
        }
    }
}

/// Tuning of [`Producer`].
#[derive(Debug, Clone)]
pub struct ProducerOptions {
    /// Members per ZADD / ZREM / ZMSCORE command.
    pub chunk: usize,
    /// Chunks in flight at once (pipelining depth).
    pub depth: usize,
    /// Longest wait between two attempts while Redis is out.
    pub max_backoff: Duration,
    /// Lifetime of `request-cancel:<id>` markers (the real producer uses 7 days).
    pub cancel_marker_ttl: Duration,
}

impl Default for ProducerOptions {
    fn default() -> Self {
        Self {
            chunk: 1000,
            depth: 4,
            max_backoff: Duration::from_secs(5),
            cancel_marker_ttl: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

/// What [`Producer::remove`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemoveReport {
    /// Members taken out of the set before the dispatcher saw them.
    pub removed: u64,
    /// Members no longer in the set, for which a cancel marker was set.
    pub marked: u64,
}

// Takes members out of a request sorted set; the file's header says its KEYS and ARGV.
const REMOVE_LUA: &str = include_str!("remove.lua");

/// Writes and removes members of the dispatcher's request sorted sets.
///
/// Every operation waits out Redis outages (restarts, failovers, `LOADING`, `READONLY`, `OOM`)
/// until the producer's stop token fires ([`Producer::with_stop`]); an error that waiting cannot
/// cure is returned at once.
#[derive(Clone)]
pub struct Producer {
    client: Client,
    options: ProducerOptions,
    remove_script: Script,
    stop: CancellationToken,
}

impl Producer {
    /// A producer over a connected client, never stopped.
    pub fn new(client: Client, options: ProducerOptions) -> Self {
        Self {
            client,
            options,
            remove_script: Script::from_lua(REMOVE_LUA),
            stop: CancellationToken::new(),
        }
    }

    /// The same producer, giving up waiting for Redis when `stop` fires.
    pub fn with_stop(&self, stop: CancellationToken) -> Self {
        Self {
            stop,
            ..self.clone()
        }
    }

    /// The client, for callers that need other commands.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// ZADDs every member at `score`, in chunks, with up to `depth` chunks in flight. Returns
    /// how many members were new to the set.
    pub async fn enqueue<I>(
        &self,
        queue: &str,
        score: f64,
        members: I,
    ) -> Result<u64, ProducerError>
    where
        I: IntoIterator<Item = String>,
    {
        self.enqueue_scored(queue, members.into_iter().map(|m| (score, m)))
            .await
    }

    /// ZADDs each `(score, member)`, in chunks, with up to `depth` chunks in flight. Returns how
    /// many members were new to the set.
    pub async fn enqueue_scored<I>(&self, queue: &str, members: I) -> Result<u64, ProducerError>
    where
        I: IntoIterator<Item = (f64, String)>,
    {
        let mut members = members.into_iter();
        let mut in_flight = FuturesUnordered::new();
        let mut added = 0u64;
        loop {
            let chunk: Vec<(f64, String)> =
                members.by_ref().take(self.options.chunk.max(1)).collect();
            let last = chunk.is_empty();
            if !last {
                in_flight.push(self.zadd(queue, chunk));
            }
            while in_flight.len() >= self.options.depth.max(1) || (last && !in_flight.is_empty()) {
                added += in_flight.next().await.expect("not empty")?;
            }
            if last {
                return Ok(added);
            }
        }
    }

    async fn zadd(&self, queue: &str, chunk: Vec<(f64, String)>) -> Result<u64, ProducerError> {
        // Each member's bytes are shared by every attempt (a Bytes-backed string), not copied
        // per attempt: a chunk is megabytes.
        let chunk: Vec<(f64, Value)> = chunk
            .into_iter()
            .map(|(score, member)| (score, Value::String(member.into())))
            .collect();
        self.retry("ZADD", queue, || {
            self.client
                .zadd::<u64, _, _>(queue, None, None, false, false, chunk.clone())
        })
        .await
    }

    /// Removes `members` from `queue`; sets a cancel marker for each one that is no longer there
    /// (the dispatcher may have it in hand, or in its retry set).
    pub async fn remove(
        &self,
        queue: &str,
        members: &[PendingMember],
    ) -> Result<RemoveReport, ProducerError> {
        let mut report = RemoveReport::default();
        for chunk in members.chunks(self.options.chunk.max(1)) {
            let args: Vec<&str> = chunk.iter().map(|m| m.member.as_str()).collect();
            let missing: Vec<usize> = self
                .retry("ZREM", queue, || {
                    self.remove_script.evalsha_with_reload::<Vec<usize>, _, _>(
                        &self.client,
                        queue,
                        args.clone(),
                    )
                })
                .await?;
            let gone: Vec<&PendingMember> = missing
                .iter()
                .filter_map(|&i| chunk.get(i.checked_sub(1)?))
                .collect();
            let requests: Vec<(&str, &str)> = gone
                .iter()
                .map(|m| (m.id.as_str(), m.token.as_str()))
                .collect();
            self.mark_cancelled(&requests).await?;
            report.removed += (chunk.len() - gone.len()) as u64;
            report.marked += gone.len() as u64;
        }
        Ok(report)
    }

    /// Removes exactly these members of `key` (ZREM), whatever they are; returns how many were
    /// there.
    pub async fn remove_exact(&self, key: &str, members: &[String]) -> Result<u64, ProducerError> {
        let mut removed = 0;
        for chunk in members.chunks(self.options.chunk.max(1)) {
            removed += self
                .retry("ZREM", key, || {
                    self.client.zrem::<u64, _, _>(key, chunk.to_vec())
                })
                .await?;
        }
        Ok(removed)
    }

    /// Sets the dispatcher's cancel marker `request-cancel:<id>` = token for each request, so
    /// the dispatcher answers `CANCELLED` instead of sending it.
    pub async fn mark_cancelled(&self, requests: &[(&str, &str)]) -> Result<(), ProducerError> {
        let ttl = self.options.cancel_marker_ttl.as_secs().max(1) as i64;
        let mut sets = FuturesUnordered::new();
        for &(id, token) in requests {
            let key = batch_keys::cancel_marker_key(id);
            let token = token.to_owned();
            sets.push(async move {
                self.retry("SET", "request-cancel:*", || {
                    self.client.set::<(), _, _>(
                        key.as_str(),
                        token.as_str(),
                        Some(Expiration::EX(ttl)),
                        None,
                        false,
                    )
                })
                .await
            });
            if sets.len() >= 64 {
                sets.next().await.expect("not empty")?;
            }
        }
        while let Some(done) = sets.next().await {
            done?;
        }
        Ok(())
    }

    /// Every member of the sorted set `key` that matches the glob `pattern` (ZSCAN MATCH),
    /// e.g. `*"id":"batch_req_<job>_*` for one job's requests whatever their exact bytes.
    pub async fn scan_members(
        &self,
        key: &str,
        pattern: &str,
    ) -> Result<Vec<String>, ProducerError> {
        self.scan("ZSCAN", key, pattern, 2).await
    }

    /// Every field of the hash `key` that matches `pattern` (HSCAN MATCH).
    pub async fn scan_fields(
        &self,
        key: &str,
        pattern: &str,
    ) -> Result<Vec<String>, ProducerError> {
        self.scan("HSCAN", key, pattern, 2).await
    }

    async fn scan(
        &self,
        command: &'static str,
        key: &str,
        pattern: &str,
        stride: usize,
    ) -> Result<Vec<String>, ProducerError> {
        let mut cursor = "0".to_owned();
        let mut found = Vec::new();
        loop {
            let cmd = CustomCommand::new_static(command, ClusterHash::FirstKey, false);
            let args = vec![
                Value::from(key),
                Value::from(cursor.as_str()),
                Value::from("MATCH"),
                Value::from(pattern),
                Value::from("COUNT"),
                Value::from(1000),
            ];
            let reply: (String, Vec<Value>) = self
                .retry(command, key, || {
                    self.client.custom(cmd.clone(), args.clone())
                })
                .await?;
            found.extend(reply.1.iter().step_by(stride).filter_map(|v| {
                v.as_bytes()
                    .map(|b| String::from_utf8_lossy(b).into_owned())
            }));
            if reply.0 == "0" {
                return Ok(found);
            }
            cursor = reply.0;
        }
    }

    /// For each member, whether it is still in `queue`.
    pub async fn queued(
        &self,
        queue: &str,
        members: &[String],
    ) -> Result<Vec<bool>, ProducerError> {
        let mut found = Vec::with_capacity(members.len());
        for chunk in members.chunks(self.options.chunk.max(1)) {
            let scores: Vec<Value> = self
                .retry("ZMSCORE", queue, || {
                    self.client
                        .zmscore::<Vec<Value>, _, _>(queue, chunk.to_vec())
                })
                .await?;
            found.extend(scores.iter().map(|v| !v.is_null()));
        }
        Ok(found)
    }

    async fn retry<T, F, Fut>(
        &self,
        command: &'static str,
        key: &str,
        call: F,
    ) -> Result<T, ProducerError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, fred::error::Error>>,
    {
        Retry::new(format!("{command} {key}"))
            .max_backoff(self.options.max_backoff)
            .run(&self.stop, call)
            .await
            .map_err(|e| match e {
                RetryError::Stopped => ProducerError::Stopped,
                RetryError::Failed { error, .. } => ProducerError::Redis {
                    command,
                    key: key.to_owned(),
                    error,
                },
            })
    }
}
