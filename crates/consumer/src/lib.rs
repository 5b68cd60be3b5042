//! The result-list consumer: one per result list, shared by every active job of the replica.
//!
//! The dispatcher LPUSHes results. [`ResultConsumer`] never holds a result that exists nowhere
//! else: it first moves what waits in the result list into its own in-flight list, atomically
//! and in O(1) (`RENAMENX`: the whole backlog at once), then reads the in-flight list from the
//! right (oldest first) a batch at a time, hands each batch to the [`ResultHandler`], and trims
//! it from the in-flight list only once the handler says it is written. The next batch is read
//! while one is being written, so Redis and the writer work side by side. When the result list
//! is empty it blocks (BLMOVE of one result into flight) for up to the poll timeout. A consumer that starts finds
//! whatever a crashed predecessor left in flight and handles it first; the handler skips what was
//! written already, so each result still ends in exactly one line.
//!
//! Results are routed by their id ([`batch_wire::parse_request_id`]), or by echoed `metadata`
//! when a dispatcher sends it. A malformed message, or one for a job nobody runs, is logged,
//! counted and dropped; neither stops the loop. Redis errors are retried with backoff.
//!
//! ```no_run
//! use std::sync::Arc;
//! use batch_consumer::{ConsumerOptions, HandlerError, ResultConsumer, ResultHandler, Routed, WriteReport};
//!
//! struct Print;
//! impl ResultHandler for Print {
//!     fn write(&self, results: &[Routed]) -> Result<WriteReport, HandlerError> {
//!         for r in results {
//!             println!("{} line {}: {:?}", r.job_id, r.index, r.result.outcome());
//!         }
//!         Ok(WriteReport { written: results.len() as u64, ..WriteReport::default() })
//!     }
//! }
//!
//! # async fn demo(client: fred::clients::Client) {
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! let consumer = ResultConsumer::new(
//!     client,
//!     "llm-d-async:results:pool-a:$batch".into(),
//!     "llm-d-async:results:pool-a:$batch:inflight".into(),
//!     Arc::new(Print),
//!     ConsumerOptions::default(),
//! );
//! let handle = consumer.spawn(shutdown.clone());
//! shutdown.cancel();
//! handle.join().await;
//! # }
//! ```

mod stats;

use std::sync::Arc;
use std::time::Duration;

use batch_wire::{parse_request_id, ResultMessage};
use fred::clients::Client;
use fred::interfaces::{ClientLike, ListInterface};
use fred::types::config::Options;
use fred::types::lists::LMoveDirection;
use fred::types::scripts::Script;
use tokio_util::sync::CancellationToken;

pub use stats::ConsumerStats;

/// A result with the job and line it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed {
    /// The job.
    pub job_id: String,
    /// 0-based line index in the job.
    pub index: u64,
    /// The result as the dispatcher wrote it.
    pub result: ResultMessage,
}

/// What a [`ResultHandler`] did with a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteReport {
    /// Results written.
    pub written: u64,
    /// Results whose line already existed.
    pub duplicates: u64,
    /// Results of jobs the handler does not run.
    pub unknown_job: u64,
}

/// A handler could not write; the batch stays in flight and is offered again.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct HandlerError(pub String);

/// Where results go: the jobs' files.
pub trait ResultHandler: Send + Sync + 'static {
    /// Writes every result of the batch to its job, returning once a crash of this process can
    /// no longer lose them. Called on a blocking thread.
    fn write(&self, results: &[Routed]) -> Result<WriteReport, HandlerError>;
}

/// Tuning of [`ResultConsumer`].
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// Results taken per round trip.
    pub batch: usize,
    /// How long one blocking pop waits on an empty list.
    pub poll_timeout: Duration,
    /// First wait after a Redis or handler error; doubled up to `max_backoff`.
    pub min_backoff: Duration,
    /// Longest wait after errors.
    pub max_backoff: Duration,
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        Self {
            batch: 1000,
            poll_timeout: Duration::from_secs(5),
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
        }
    }
}

// Makes the whole result list KEYS[1] the in-flight list KEYS[2] when that one is empty, in
// O(1); returns how many results it moved (0 when there were none).
const TAKE_LUA: &str = r#"
local n = redis.call('LLEN', KEYS[1])
if n == 0 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return redis.error_reply('in-flight list not empty') end
redis.call('RENAME', KEYS[1], KEYS[2])
return n
"#;

/// Reads one result list; see the crate documentation.
pub struct ResultConsumer {
    client: Client,
    results: String,
    inflight: String,
    handler: Arc<dyn ResultHandler>,
    options: ConsumerOptions,
    stats: Arc<ConsumerStats>,
    take: Script,
}

/// A running consumer.
pub struct ConsumerHandle {
    task: tokio::task::JoinHandle<()>,
    stats: Arc<ConsumerStats>,
}

impl ConsumerHandle {
    /// Its counters.
    pub fn stats(&self) -> &Arc<ConsumerStats> {
        &self.stats
    }

    /// Waits for the consumer to stop (after its shutdown token fired).
    pub async fn join(self) {
        if let Err(e) = self.task.await {
            tracing::error!(error = %e, "result consumer task failed");
        }
    }
}

impl ResultConsumer {
    /// A consumer of `results`, keeping taken results in `inflight` until `handler` wrote them.
    /// `client` should be its own: blocking pops hold its connection.
    pub fn new(
        client: Client,
        results: String,
        inflight: String,
        handler: Arc<dyn ResultHandler>,
        options: ConsumerOptions,
    ) -> Self {
        Self {
            client,
            results,
            inflight,
            handler,
            options,
            stats: Arc::new(ConsumerStats::default()),
            take: Script::from_lua(TAKE_LUA),
        }
    }

    /// Its counters, shared with the running task.
    pub fn stats(&self) -> Arc<ConsumerStats> {
        self.stats.clone()
    }

    /// Runs on a task until `shutdown` fires.
    pub fn spawn(self, shutdown: CancellationToken) -> ConsumerHandle {
        let stats = self.stats.clone();
        let task = tokio::spawn(self.run(shutdown));
        ConsumerHandle { task, stats }
    }

    /// Handles what a predecessor left in flight, then consumes until `shutdown` fires.
    pub async fn run(self, shutdown: CancellationToken) {
        tracing::info!(results = %self.results, "result consumer started");
        let mut backoff = self.options.min_backoff;
        // False at start and after any error: the in-flight list is then drained first, so
        // what it holds is written before anything new is taken.
        let mut recovered = false;
        while !shutdown.is_cancelled() {
            let step = if recovered {
                self.step(&shutdown).await
            } else {
                self.recover(&shutdown).await.map(|n| {
                    recovered = true;
                    self.stats.add_recovered(n);
                })
            };
            match step {
                Ok(()) => backoff = self.options.min_backoff,
                Err(e) => {
                    recovered = false;
                    self.stats.redis_error();
                    tracing::warn!(results = %self.results, error = %e, "result consumer error, retrying in {backoff:?}");
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(self.options.max_backoff);
                }
            }
        }
        tracing::info!(results = %self.results, "result consumer stopped");
    }

    async fn recover(&self, shutdown: &CancellationToken) -> Result<u64, fred::error::Error> {
        let left: u64 = self.client.llen(&self.inflight).await?;
        if left > 0 {
            tracing::info!(inflight = %self.inflight, results = left, "handling results left in flight");
            self.drain_in_flight(shutdown).await?;
        }
        Ok(left)
    }

    async fn step(&self, shutdown: &CancellationToken) -> Result<(), fred::error::Error> {
        let taken: i64 = self
            .take
            .evalsha_with_reload(&self.client, vec![&self.results, &self.inflight], ())
            .await?;
        if taken == 0 {
            self.stats.empty_poll();
            let timeout = self.options.poll_timeout.as_secs_f64();
            // The client's default command timeout must not cut a long poll short.
            let blocking = self.client.with_options(&Options {
                timeout: Some(self.options.poll_timeout + Duration::from_secs(10)),
                ..Options::default()
            });
            let popped: Option<String> = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                r = blocking.blmove(&self.results, &self.inflight, LMoveDirection::Right, LMoveDirection::Left, timeout) => r?,
            };
            if popped.is_none() {
                return Ok(());
            }
        }
        self.drain_in_flight(shutdown).await
    }

    /// Writes everything in the in-flight list, oldest first, a batch at a time, trimming each
    /// batch once written. Nothing else adds to the list meanwhile, so positions are stable.
    async fn drain_in_flight(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<(), fred::error::Error> {
        let batch = self.options.batch.max(1) as i64;
        let mut items = self.read_in_flight(-batch, -1).await?;
        while !items.is_empty() {
            let n = items.len() as i64;
            // The next batch, just left of this one, is read while this one is written.
            let next = self.read_in_flight(-n - batch, -n - 1);
            let (next, written) = tokio::join!(next, self.handle(items, shutdown));
            if !written {
                // Shutting down: what is not written stays in flight for the next consumer.
                return Ok(());
            }
            let _: () = self.client.ltrim(&self.inflight, 0, -n - 1).await?;
            items = next?;
        }
        Ok(())
    }

    /// In-flight results between two positions, oldest (rightmost) first.
    async fn read_in_flight(
        &self,
        start: i64,
        stop: i64,
    ) -> Result<Vec<String>, fred::error::Error> {
        let mut items: Vec<String> = self.client.lrange(&self.inflight, start, stop).await?;
        items.reverse();
        Ok(items)
    }

    /// Routes and writes `items`, retrying the handler until it succeeds; false when shut down
    /// first (the items then stay in flight for the next consumer).
    async fn handle(&self, items: Vec<String>, shutdown: &CancellationToken) -> bool {
        self.stats.received(items.len() as u64);
        let routed: Arc<Vec<Routed>> =
            Arc::new(items.iter().filter_map(|raw| self.route(raw)).collect());
        if routed.is_empty() {
            return true;
        }
        let mut backoff = self.options.min_backoff;
        loop {
            let handler = self.handler.clone();
            let batch = routed.clone();
            match tokio::task::spawn_blocking(move || handler.write(&batch)).await {
                Ok(Ok(report)) => {
                    self.stats.report(&report);
                    if report.unknown_job > 0 {
                        tracing::warn!(results = %self.results, count = report.unknown_job, "dropped results of jobs not running here");
                    }
                    return true;
                }
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "could not write results, retrying in {backoff:?}")
                }
                Err(e) => {
                    tracing::error!(error = %e, "result handler panicked, retrying in {backoff:?}")
                }
            }
            self.stats.handler_error();
            tokio::select! {
                _ = shutdown.cancelled() => return false,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(self.options.max_backoff);
        }
    }

    fn route(&self, raw: &str) -> Option<Routed> {
        let result = match ResultMessage::parse(raw) {
            Ok(r) => r,
            Err(e) => {
                self.stats.malformed();
                tracing::warn!(results = %self.results, error = %e, message = %preview(raw), "dropped a malformed result");
                return None;
            }
        };
        let by_metadata = || {
            let m = result.metadata.as_ref()?;
            Some((
                m.get("job_id")?.clone(),
                m.get("request_index")?.parse().ok()?,
            ))
        };
        match parse_request_id(&result.id).or_else(by_metadata) {
            Some((job_id, index)) => Some(Routed {
                job_id,
                index,
                result,
            }),
            None => {
                self.stats.malformed();
                tracing::warn!(results = %self.results, id = %preview(&result.id), "dropped a result whose id names no job");
                None
            }
        }
    }
}

fn preview(raw: &str) -> String {
    let mut end = raw.len().min(200);
    while !raw.is_char_boundary(end) {
        end -= 1;
    }
    raw[..end].to_owned()
}
