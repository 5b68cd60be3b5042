//! The sorted-set producer: a job's requests into `{prefix}:requests:{pool}`, score = deadline.
//!
//! [`JobMessages`] builds each request's envelope the way the real dispatcher reads it
//! (contract §1): `request_kind: plain`, integer `created`/`deadline`, the body byte for byte,
//! an id that routes the result back ([`batch_wire::request_id`]), a cancel token, and
//! `internal.result_queue_name` naming this replica's own result list. Everything in a member is
//! derived from the job and the line, so building it again gives the same bytes: enqueueing a
//! line twice is a ZADD of an existing member, which changes nothing.
//!
//! [`Producer`] writes members with variadic `ZADD` in bounded, pipelined chunks (never
//! throttled: the dispatcher meters what leaves the set), removes a job's pending members with
//! batched `ZREM` plus `request-cancel:<id>` markers for the ones already taken, and tells which
//! members are still queued (`ZMSCORE`).
//!
//! ```no_run
//! use batch_producer::{JobMessages, Producer, ProducerOptions};
//!
//! # async fn demo(client: fred::clients::Client) -> Result<(), batch_producer::ProducerError> {
//! let job = JobMessages {
//!     job_id: "batch_abc".into(),
//!     created: 1_700_000_000,
//!     deadline: 1_700_086_400,
//!     request_queue: "llm-d-async:requests:pool-a".into(),
//!     result_queue: "llm-d-async:results:pool-a:$batch".into(),
//!     headers: Default::default(),
//! };
//! let line = br#"{"custom_id":"r1","method":"POST","url":"/v1/chat/completions","body":{"model":"m"}}"#;
//! let member = job.member(0, line)?;
//! let producer = Producer::new(client, ProducerOptions::default());
//! producer.enqueue(&job.request_queue, job.score(), [member]).await?;
//! # Ok(()) }
//! ```

mod messages;

use std::time::Duration;

use fred::clients::Client;
use fred::interfaces::SortedSetsInterface;
use fred::types::scripts::Script;
use fred::types::Value;
use futures::stream::{FuturesUnordered, StreamExt};

pub use messages::{request_token, JobMessages, PendingMember};

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
    /// Redis kept failing after retries.
    #[error("Redis {command} on {key} failed after {attempts} attempts: {error}")]
    Redis {
        /// The command.
        command: &'static str,
        /// The key.
        key: String,
        /// Attempts made.
        attempts: u32,
        /// The last error.
        error: fred::error::Error,
    },
}

/// Tuning of [`Producer`].
#[derive(Debug, Clone)]
pub struct ProducerOptions {
    /// Members per ZADD / ZREM / ZMSCORE command.
    pub chunk: usize,
    /// Chunks in flight at once (pipelining depth).
    pub depth: usize,
    /// Attempts per chunk before giving up.
    pub attempts: u32,
    /// First wait after a failed chunk; doubled each time.
    pub backoff: Duration,
    /// Lifetime of `request-cancel:<id>` markers (the real producer uses 7 days).
    pub cancel_marker_ttl: Duration,
}

impl Default for ProducerOptions {
    fn default() -> Self {
        Self {
            chunk: 1000,
            depth: 4,
            attempts: 8,
            backoff: Duration::from_millis(100),
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

// ZREM each member; for one that is gone (taken by the dispatcher, maybe waiting for a retry),
// set the dispatcher's cancel marker instead. KEYS[1] = the request queue; ARGV[1] = marker TTL in
// seconds, then (member, id, token) triples.
const REMOVE_LUA: &str = r#"
local removed = 0
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV, 3 do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    removed = removed + 1
  else
    redis.call('SET', 'request-cancel:' .. ARGV[i + 1], ARGV[i + 2], 'EX', ttl)
  end
end
return removed
"#;

/// Writes and removes members of the dispatcher's request sorted sets.
#[derive(Clone)]
pub struct Producer {
    client: Client,
    options: ProducerOptions,
    remove_script: Script,
}

impl Producer {
    /// A producer over a connected client.
    pub fn new(client: Client, options: ProducerOptions) -> Self {
        Self {
            client,
            options,
            remove_script: Script::from_lua(REMOVE_LUA),
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
        let mut members = members.into_iter();
        let mut in_flight = FuturesUnordered::new();
        let mut added = 0u64;
        loop {
            let chunk: Vec<(f64, String)> = members
                .by_ref()
                .take(self.options.chunk.max(1))
                .map(|m| (score, m))
                .collect();
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
        self.retry("ZADD", queue, || {
            self.client
                .zadd::<u64, _, _>(queue, None, None, false, false, chunk.clone())
        })
        .await
    }

    /// Removes `members` from `queue`; sets a cancel marker for each one that is no longer there.
    pub async fn remove(
        &self,
        queue: &str,
        members: &[PendingMember],
    ) -> Result<RemoveReport, ProducerError> {
        let ttl = self.options.cancel_marker_ttl.as_secs().max(1).to_string();
        let mut report = RemoveReport::default();
        for chunk in members.chunks(self.options.chunk.max(1)) {
            let mut args = Vec::with_capacity(1 + chunk.len() * 3);
            args.push(ttl.clone());
            for m in chunk {
                args.push(m.member.clone());
                args.push(m.id.clone());
                args.push(m.token.clone());
            }
            let removed: u64 = self
                .retry("ZREM", queue, || {
                    self.remove_script.evalsha_with_reload::<u64, _, _>(
                        &self.client,
                        queue,
                        args.clone(),
                    )
                })
                .await?;
            report.removed += removed;
            report.marked += chunk.len() as u64 - removed;
        }
        Ok(report)
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
        mut call: F,
    ) -> Result<T, ProducerError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, fred::error::Error>>,
    {
        let mut backoff = self.options.backoff;
        let attempts = self.options.attempts.max(1);
        let mut attempt = 1;
        loop {
            match call().await {
                Ok(v) => return Ok(v),
                Err(e) if attempt < attempts => {
                    tracing::warn!(command, key, attempt, error = %e, "Redis command failed, retrying in {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                    attempt += 1;
                }
                Err(error) => {
                    return Err(ProducerError::Redis {
                        command,
                        key: key.to_owned(),
                        attempts,
                        error,
                    })
                }
            }
        }
    }
}
