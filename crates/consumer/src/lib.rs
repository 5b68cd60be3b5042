//! The result-list consumer: one reader per result list, shared by every job of the process.
//!
//! The dispatcher LPUSHes results. [`ResultConsumer`] never holds a result that exists nowhere
//! else: it moves what waits in the result list into the list's in-flight list (`{<list>}:inflight`,
//! atomically and in O(1): the whole backlog at once), reads the in-flight list from the right
//! (oldest first) a batch at a time, hands each batch to the [`ResultHandler`], and removes it
//! from the in-flight list only once the handler says it is written. Reading, writing and
//! acknowledging overlap: the next batch is read and parsed (on a blocking thread) while one
//! is written (on another) and the one before it is acknowledged. When the
//! result list is empty it blocks (BLMOVE of one result into flight) for up to the poll
//! timeout; an empty poll is not an error. After a round that found less than a batch it waits
//! [`ConsumerOptions::linger`] before the next, so results that trickle in one by one are still
//! taken, written and acknowledged many at a time.
//!
//! - **One reader per list**: the consumer holds the list's [`Lease`] and every script that takes
//!   or acknowledges results checks it, so a process that lost its lease (frozen, cut off) stops
//!   taking results. A consumer that starts first handles whatever a predecessor left in flight;
//!   the handler skips what was written already, so each result still ends in exactly one line.
//! - **Idempotent acknowledgements**: each acknowledgement carries a fresh nonce and the first and
//!   last results it removes; the script applies it once and only to exactly those entries,
//!   whatever the Redis client resends after a dropped connection.
//! - **Results of jobs that run elsewhere are kept**: a result for a job the handler does not run,
//!   but that is registered in `{<list>}:jobs` and not past its deadline, is moved to that job's
//!   parked list (`{<list>}:parked:<job>`) for whoever runs the job; only results of jobs that exist
//!   nowhere are dropped.
//! - **Results that came to the wrong list are handed on**: a dispatcher whose queue entry names
//!   its own result list sends every result of the pool there, whatever list each request
//!   asked for. A result of a job that runs elsewhere and whose requests name another list (as
//!   the pool's result routes say, [`ConsumerOptions::routes`]) is pushed onto that list before
//!   it is acknowledged here, and the list is told where it came from (`{<list>}:handed-from`),
//!   so its reader can read this one too once it is free. A crash between the two pushes it
//!   again; the job's writer skips the duplicate.
//! - Redis outages are waited out with backoff (one WARN per outage); malformed messages are
//!   counted and dropped.
//!
//! Results are routed by their id ([`batch_wire::parse_request_id`]), or by echoed `metadata`
//! when a dispatcher sends it.
//!
//! ```no_run
//! use std::sync::Arc;
//! use batch_consumer::{Acquired, ConsumerOptions, HandlerError, Lease, ResultConsumer, ResultHandler, Routed, WriteReport};
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
//! # async fn demo(client: fred::clients::Client) -> Result<(), fred::error::Error> {
//! let list = "llm-d-async:results:pool-a:$batch";
//! let options = ConsumerOptions::default();
//! let keys = batch_queue_names::ListKeys::new(list);
//! let Acquired::Taken(lease) = Lease::try_acquire(&client, &keys.lease, options.lease_ttl).await? else {
//!     panic!("another process reads {list}");
//! };
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! let consumer = ResultConsumer::new(client.clone(), client, keys, Arc::new(Print), options);
//! let handle = consumer.spawn(Some(lease), shutdown.clone());
//! shutdown.cancel();
//! handle.join().await;
//! # Ok(()) }
//! ```

mod lease;
mod lists;
mod scripts;
mod stats;

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use batch_queue_names::ListKeys;
use batch_redis::Backoff;
use batch_wire::{split_request_id, RawResult};
use fred::bytes_utils::Str;
use fred::clients::Client;
use fred::interfaces::{ClientLike, HashesInterface, ListInterface};
use fred::types::config::Options;
use fred::types::{ClusterHash, CustomCommand, Value};
use tokio_util::sync::CancellationToken;

pub use lease::{Acquired, Holder, Lease};
pub use lists::{
    claim_list, handed_from, register_job, unregister_job, waiting_lines, ListError, AUTO_LISTS,
};
pub use stats::ConsumerStats;

/// A result with the job and line it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed {
    /// The job (shared by the results of a batch that belong to it).
    pub job_id: Arc<str>,
    /// 0-based line index in the job.
    pub index: u64,
    /// The result as the dispatcher wrote it, read in place.
    pub result: RawResult<Str>,
}

/// What a [`ResultHandler`] did with a batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WriteReport {
    /// Results written.
    pub written: u64,
    /// Results whose line already existed.
    pub duplicates: u64,
    /// Results whose `request_token` is not their line's: from another attempt, or another
    /// job with a colliding id. Dropped.
    pub mismatched: u64,
    /// Results of jobs the handler does not run: positions in the batch it was given.
    pub not_here: Vec<usize>,
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
    /// How long one blocking pop waits on an empty list (or, when not `blocking`, the pause
    /// between two looks at an empty list).
    pub poll_timeout: Duration,
    /// Block on the list when it is empty (a connection of its own); false polls instead.
    pub blocking: bool,
    /// First wait after a Redis or handler error; doubled up to `max_backoff`.
    pub min_backoff: Duration,
    /// Longest wait after errors.
    pub max_backoff: Duration,
    /// Lifetime of the list's lease when its holder stops renewing it.
    pub lease_ttl: Duration,
    /// Pause after a round that found less than a batch, for more results to gather: every
    /// round costs a few round trips and a file flush whatever it carries. Adds at most this
    /// to a result's latency; zero reads each result as soon as it comes.
    pub linger: Duration,
    /// The pool's result routes ([`batch_queue_names::QueueNames::result_routes_name`]): a
    /// result of a job that runs elsewhere and whose requests name another list is handed on
    /// to that list. `None` for a parked list, which holds one job's results only.
    pub routes: Option<String>,
    /// Started to take over the list when its reader goes: waiting for the lease is expected,
    /// not worth a warning.
    pub standby: bool,
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        Self {
            batch: 1000,
            poll_timeout: Duration::from_secs(5),
            blocking: true,
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            lease_ttl: Duration::from_secs(10),
            linger: Duration::from_millis(10),
            routes: None,
            standby: false,
        }
    }
}

/// Reads one result list; see the crate documentation.
pub struct ResultConsumer {
    client: Client,
    lease_client: Client,
    keys: ListKeys,
    handler: Arc<dyn ResultHandler>,
    options: ConsumerOptions,
    stats: Arc<ConsumerStats>,
    scripts: scripts::Scripts,
}

/// A running consumer.
pub struct ConsumerHandle {
    task: tokio::task::JoinHandle<()>,
    stats: Arc<ConsumerStats>,
    list: String,
}

impl ConsumerHandle {
    /// Its counters.
    pub fn stats(&self) -> &Arc<ConsumerStats> {
        &self.stats
    }

    /// The list it reads.
    pub fn list(&self) -> &str {
        &self.list
    }

    /// Waits for the consumer to stop (after its shutdown token fired); its lease is released.
    pub async fn join(self) {
        if let Err(e) = self.task.await {
            tracing::error!(error = %e, "result consumer task failed");
        }
    }
}

/// Why one pass of the loop stopped.
enum Halt {
    /// Redis or the handler failed; retry after a pause.
    Error(String),
    /// The lease is gone: take it again before reading on.
    LeaseLost,
}

impl From<fred::error::Error> for Halt {
    fn from(e: fred::error::Error) -> Self {
        Halt::Error(e.to_string())
    }
}

impl ResultConsumer {
    /// A consumer of the list `keys` names. `client` should be its own when `blocking` (a
    /// blocking pop holds its connection); `lease_client` renews the lease and may be shared.
    pub fn new(
        client: Client,
        lease_client: Client,
        keys: ListKeys,
        handler: Arc<dyn ResultHandler>,
        options: ConsumerOptions,
    ) -> Self {
        Self {
            client,
            lease_client,
            keys,
            handler,
            options,
            stats: Arc::new(ConsumerStats::default()),
            scripts: scripts::Scripts::default(),
        }
    }

    /// A consumer of what the reader of `list` parked for `job` (results that arrived there
    /// while no process running the job read it). It polls: a parked list fills rarely.
    pub fn parked(
        client: Client,
        list: &str,
        job: &str,
        handler: Arc<dyn ResultHandler>,
        options: ConsumerOptions,
    ) -> Self {
        let options = ConsumerOptions {
            blocking: false,
            poll_timeout: Duration::from_secs(1),
            routes: None,
            ..options
        };
        Self::new(
            client.clone(),
            client,
            ListKeys::parked(list, job),
            handler,
            options,
        )
    }

    /// Its counters, shared with the running task.
    pub fn stats(&self) -> Arc<ConsumerStats> {
        self.stats.clone()
    }

    /// Runs on a task until `shutdown` fires. With `lease` the consumer starts at once; without
    /// one (or once it is lost) it takes the list's lease first, waiting while another holds it.
    pub fn spawn(self, lease: Option<Lease>, shutdown: CancellationToken) -> ConsumerHandle {
        let stats = self.stats.clone();
        let list = self.keys.list.clone();
        let task = tokio::spawn(self.run(lease, shutdown));
        ConsumerHandle { task, stats, list }
    }

    /// Handles what a predecessor left in flight, then consumes until `shutdown` fires.
    pub async fn run(self, mut lease: Option<Lease>, shutdown: CancellationToken) {
        tracing::info!(results = %self.keys.list, "result consumer started");
        let mut backoff = Backoff::new(self.options.min_backoff, self.options.max_backoff);
        let mut outage = false;
        while !shutdown.is_cancelled() {
            let Some(held) = lease.take() else {
                lease = self.take_lease(&shutdown).await;
                continue;
            };
            // A command waiting on an unreachable Redis must not hold up a shutdown: what was
            // taken but not acknowledged stays in flight for the next reader.
            let read = tokio::select! {
                r = self.read_while_held(&held, &shutdown) => r,
                _ = shutdown.cancelled() => Ok(()),
            };
            match read {
                Ok(()) => {
                    lease = Some(held);
                    break;
                }
                Err(Halt::LeaseLost) => {
                    tracing::warn!(results = %self.keys.list, "lost the lease on the result list; reading on once it is ours again");
                    drop(held);
                }
                Err(Halt::Error(e)) => {
                    lease = Some(held);
                    self.stats.redis_error();
                    if outage {
                        tracing::debug!(results = %self.keys.list, error = %e, "result consumer still failing");
                    } else {
                        outage = true;
                        tracing::warn!(results = %self.keys.list, error = %e, "result consumer error, retrying with backoff (logged once until it recovers)");
                    }
                    if !backoff.wait(&shutdown).await {
                        break;
                    }
                    continue;
                }
            }
            backoff.reset();
            outage = false;
        }
        if let Some(lease) = lease {
            lease.release().await;
        }
        tracing::info!(results = %self.keys.list, "result consumer stopped");
    }

    /// Takes the lease, waiting while another process holds it; `None` when shut down.
    async fn take_lease(&self, shutdown: &CancellationToken) -> Option<Lease> {
        let mut logged = false;
        while !shutdown.is_cancelled() {
            match Lease::try_acquire(&self.lease_client, &self.keys.lease, self.options.lease_ttl)
                .await
            {
                Ok(Acquired::Taken(lease)) => {
                    if logged {
                        tracing::info!(results = %self.keys.list, "took the lease on the result list");
                    }
                    return Some(lease);
                }
                Ok(Acquired::Held(holder)) if !logged => {
                    logged = true;
                    let who = holder.map_or_else(|raw| raw, |h| h.to_string());
                    if self.options.standby {
                        tracing::debug!(results = %self.keys.list, holder = %who, "another process reads this result list; reading it once that process stops");
                    } else {
                        tracing::warn!(results = %self.keys.list, holder = %who, "another process reads this result list; waiting for it to stop");
                    }
                }
                Ok(Acquired::Held(_)) => {}
                Err(e) => {
                    tracing::debug!(results = %self.keys.list, error = %e, "could not take the lease")
                }
            }
            let pause = (self.options.lease_ttl / 4).max(Duration::from_millis(50));
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(pause) => {}
            }
        }
        None
    }

    /// Reads until shut down (Ok), or until an error or the loss of the lease.
    async fn read_while_held(
        &self,
        lease: &Lease,
        shutdown: &CancellationToken,
    ) -> Result<(), Halt> {
        // What a predecessor (or this consumer, before an error) left in flight comes first.
        let left: u64 = self.client.llen(&self.keys.inflight).await?;
        if left > 0 {
            tracing::info!(inflight = %self.keys.inflight, results = left, "handling results left in flight");
            self.stats.add_recovered(left);
            self.drain_in_flight(left, lease, shutdown).await?;
        }
        while !shutdown.is_cancelled() {
            if lease.lost().is_cancelled() {
                return Err(Halt::LeaseLost);
            }
            let handled = self.step(lease, shutdown).await?;
            if handled < self.options.batch as u64 && !self.options.linger.is_zero() {
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = lease.lost().cancelled() => {}
                    _ = tokio::time::sleep(self.options.linger) => {}
                }
            }
        }
        Ok(())
    }

    /// One round: takes what waits (or waits for it) and writes it; returns how many results
    /// it read.
    async fn step(&self, lease: &Lease, shutdown: &CancellationToken) -> Result<u64, Halt> {
        let taken = self
            .scripts
            .take(&self.client, &self.keys, lease.value())
            .await?;
        if taken < 0 {
            return Err(Halt::LeaseLost);
        }
        if taken == 0 {
            self.stats.empty_poll();
            let waited = tokio::select! {
                _ = shutdown.cancelled() => return Ok(0),
                _ = lease.lost().cancelled() => return Err(Halt::LeaseLost),
                r = self.wait_for_results() => r?,
            };
            if !waited {
                return Ok(0);
            }
        }
        // The blocking pop moves one result.
        let len = taken.max(1) as u64;
        self.drain_in_flight(len, lease, shutdown).await
    }

    /// Waits for the list to fill: true when a result was moved into flight.
    async fn wait_for_results(&self) -> Result<bool, fred::error::Error> {
        if !self.options.blocking {
            tokio::time::sleep(self.options.poll_timeout).await;
            return Ok(false);
        }
        // A custom command: fred turns BLMOVE's nil (nothing came) into a timeout error,
        // which would make every idle poll look like a failure.
        let block = self.options.poll_timeout.as_secs_f64().max(0.01);
        let options = Options {
            timeout: Some(self.options.poll_timeout + Duration::from_secs(10)),
            ..Options::default()
        };
        let cmd = CustomCommand::new_static("BLMOVE", ClusterHash::FirstKey, true);
        let moved: Value = self
            .client
            .with_options(&options)
            .custom(
                cmd,
                vec![
                    Value::from(self.keys.list.as_str()),
                    Value::from(self.keys.inflight.as_str()),
                    Value::from("RIGHT"),
                    Value::from("LEFT"),
                    Value::from(format!("{block:.3}")),
                ],
            )
            .await?;
        Ok(!moved.is_null())
    }

    /// Writes everything in the in-flight list (`len` results), oldest first, a batch at a
    /// time, acknowledging each batch once written; returns how many results it read.
    ///
    /// Three stages overlap: batches are read and parsed ahead (on a blocking thread), one is
    /// written (on another) while the one before it is acknowledged. Acknowledgements stay in
    /// order, each sent once the one before it is applied. Nothing else adds to the list
    /// meanwhile, and acknowledgements trim its right end, so positions counted from the left
    /// stay where they were when reading began.
    async fn drain_in_flight(
        &self,
        len: u64,
        lease: &Lease,
        shutdown: &CancellationToken,
    ) -> Result<u64, Halt> {
        let (tx, rx) = tokio::sync::mpsc::channel(READ_AHEAD);
        let (read, written) = tokio::join!(
            self.read_ahead(len, tx),
            self.write_and_ack(rx, lease, shutdown)
        );
        // The writer stopping first (shut down, lease lost) ends the reader; a read error ends
        // the writer once it has written what was read before it.
        written?;
        read
    }

    /// Reads and parses the `len` in-flight results a batch at a time, oldest first, into
    /// `tx` until the writer stops taking them; returns how many it read. Each batch is parsed
    /// while the next one is read.
    async fn read_ahead(
        &self,
        len: u64,
        tx: tokio::sync::mpsc::Sender<Taken>,
    ) -> Result<u64, Halt> {
        let batch = self.options.batch.max(1) as u64;
        let range = |end: u64| (end.saturating_sub(batch), end);
        let mut read = 0;
        let (mut start, end) = range(len);
        let mut items = self.read_in_flight(start, end).await?;
        while !items.is_empty() {
            read += items.len() as u64;
            let parse = async {
                let stats = self.stats.clone();
                let list = self.keys.list.clone();
                tokio::task::spawn_blocking(move || {
                    let routed = route_batch(&stats, &list, &items);
                    Taken { items, routed }
                })
                .await
                .map_err(|e| Halt::Error(format!("parsing results failed: {e}")))
            };
            let (next_start, next_end) = range(start);
            let (next, parsed) = tokio::join!(self.read_in_flight(next_start, next_end), parse);
            if tx.send(parsed?).await.is_err() {
                break;
            }
            items = next?;
            start = next_start;
        }
        Ok(read)
    }

    /// The in-flight results at positions `start..end` from the left, in list order (newest
    /// first).
    async fn read_in_flight(&self, start: u64, end: u64) -> Result<Vec<Str>, Halt> {
        if start >= end {
            return Ok(Vec::new());
        }
        let items = self
            .client
            .lrange(&self.keys.inflight, start as i64, end as i64 - 1)
            .await?;
        Ok(items)
    }

    /// Writes each batch `rx` brings and acknowledges it, the acknowledgement of one
    /// overlapping the write of the next.
    async fn write_and_ack(
        &self,
        mut rx: tokio::sync::mpsc::Receiver<Taken>,
        lease: &Lease,
        shutdown: &CancellationToken,
    ) -> Result<(), Halt> {
        let mut written: Option<Unacked> = None;
        while let Some(taken) = rx.recv().await {
            let previous = written.take();
            let ack = async {
                match &previous {
                    Some(w) => self.ack(lease, &w.items, &w.not_here).await,
                    None => Ok(()),
                }
            };
            let (acked, handled) = tokio::join!(ack, self.handle(&taken.routed, shutdown));
            acked?;
            let Some(not_here) = handled else {
                // Shutting down: what is not written stays in flight for the next reader.
                return Ok(());
            };
            written = Some(Unacked {
                items: taken.items,
                not_here,
            });
        }
        if let Some(w) = written {
            self.ack(lease, &w.items, &w.not_here).await?;
        }
        Ok(())
    }

    /// Removes a written batch (list order) from flight, parking the results of jobs that
    /// run elsewhere.
    async fn ack(
        &self,
        lease: &Lease,
        items: &[Str],
        not_here: &[(usize, String)],
    ) -> Result<(), Halt> {
        let now = now_unix();
        let handed;
        let not_here = if not_here.is_empty() || self.options.routes.is_none() {
            not_here
        } else {
            handed = self.hand_on(items, not_here, now).await?;
            handed.as_slice()
        };
        let acked = self
            .scripts
            .ack(
                &self.client,
                &self.keys,
                lease.value(),
                items,
                not_here,
                now,
            )
            .await?;
        match acked {
            scripts::Ack::Done { parked } => {
                let dropped = not_here.len() as u64 - parked;
                self.stats.parked_and_dropped(parked, dropped);
                if dropped > 0 {
                    tracing::warn!(results = %self.keys.list, count = dropped, "dropped results of jobs that exist nowhere");
                }
                Ok(())
            }
            scripts::Ack::LeaseLost => Err(Halt::LeaseLost),
            scripts::Ack::Mismatch => Err(Halt::Error(
                "the in-flight list changed under its reader".into(),
            )),
        }
    }

    /// Pushes the results of `not_here` whose jobs' requests name another list onto that list
    /// (oldest first, as the dispatcher would have); returns the rest, for the acknowledgement
    /// to park or drop.
    async fn hand_on(
        &self,
        items: &[Str],
        not_here: &[(usize, String)],
        now: i64,
    ) -> Result<Vec<(usize, String)>, Halt> {
        let Some(routes) = &self.options.routes else {
            return Ok(not_here.to_vec());
        };
        let mut jobs: Vec<&str> = not_here.iter().map(|(_, j)| j.as_str()).collect();
        jobs.sort_unstable();
        jobs.dedup();
        let found: Vec<Option<String>> = self.client.hmget(routes, jobs.clone()).await?;
        let mut to: HashMap<&str, String> = HashMap::new();
        for (job, route) in jobs.iter().zip(found) {
            let Some((deadline, list)) = route.as_deref().and_then(parse_route) else {
                continue;
            };
            if deadline > now && list != self.keys.base() {
                to.insert(job, list.to_owned());
            }
        }
        if to.is_empty() {
            return Ok(not_here.to_vec());
        }
        let mut rest = Vec::new();
        let mut by_list: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (pos, job) in not_here {
            match to.get(job.as_str()) {
                Some(list) => by_list.entry(list).or_default().push(*pos),
                None => rest.push((*pos, job.clone())),
            }
        }
        for (list, mut positions) in by_list {
            // Oldest (rightmost, highest position) first, so it ends rightmost there too.
            positions.sort_unstable_by(|a, b| b.cmp(a));
            let moved: Vec<&Str> = positions.iter().filter_map(|&p| items.get(p)).collect();
            self.scripts
                .hand_on(&self.client, &ListKeys::new(list), &self.keys.list, &moved)
                .await?;
            self.stats.handed_on(moved.len() as u64);
            warn_lists_differ(list, &self.keys.list);
        }
        Ok(rest)
    }

    /// Writes a routed batch, retrying the handler until it succeeds. Returns the (list
    /// position, job) of results of jobs not here, or `None` when shut down first.
    async fn handle(
        &self,
        batch: &RoutedBatch,
        shutdown: &CancellationToken,
    ) -> Option<Vec<(usize, String)>> {
        self.stats.received(batch.received);
        let RoutedBatch {
            positions, routed, ..
        } = batch;
        if routed.is_empty() {
            return Some(Vec::new());
        }
        let mut backoff = Backoff::new(self.options.min_backoff, self.options.max_backoff);
        let mut failing = false;
        loop {
            let handler = self.handler.clone();
            let batch = routed.clone();
            match tokio::task::spawn_blocking(move || handler.write(&batch)).await {
                Ok(Ok(report)) => {
                    if failing {
                        tracing::info!(results = %self.keys.list, "results are written again");
                    }
                    self.stats.report(&report);
                    return Some(
                        report
                            .not_here
                            .iter()
                            .filter_map(|&i| {
                                Some((*positions.get(i)?, routed.get(i)?.job_id.to_string()))
                            })
                            .collect(),
                    );
                }
                Ok(Err(e)) if !failing => {
                    failing = true;
                    tracing::error!(error = %e, "could not write results; they stay in flight and are retried (logged once until it recovers)")
                }
                Ok(Err(e)) => tracing::debug!(error = %e, "still cannot write results"),
                Err(e) => tracing::error!(error = %e, "result handler panicked; retrying"),
            }
            self.stats.handler_error();
            if !backoff.wait(shutdown).await {
                return None;
            }
        }
    }
}

/// Ids starting with `prefix` of the results waiting anywhere a reader of `list` keeps them:
/// the list, its in-flight list, and the parked list of `job` with its own in-flight list.
///
/// The lost-line search asks this before it puts a line back: a line whose result waits
/// unread is not lost.
pub async fn waiting_ids(
    client: &Client,
    list: &str,
    job: &str,
    prefix: &str,
) -> Result<Vec<String>, fred::error::Error> {
    let keys = ListKeys::new(list);
    let parked = ListKeys::parked(list, job);
    let mut out = Vec::new();
    for key in [&keys.list, &keys.inflight, &parked.list, &parked.inflight] {
        out.extend(scripts::ids_in_list(client, key, prefix, 1000).await?);
    }
    Ok(out)
}

/// Says, once per process, that the dispatcher sends results of requests that name
/// `requested` to `actual`: its queue entry sets `result_queue_name`.
pub fn warn_lists_differ(requested: &str, actual: &str) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            requested,
            actual,
            "the dispatcher sends results of requests that name {requested} to {actual}: its queue entry for the pool sets result_queue_name. Each result is handed on to the process that runs its job, one hop later, and waits while no process reads {actual}. Remove result_queue_name from the queue entry so that each process reads its own list, or run one process per pool with async_dispatch.consumer_id set to the list's last part"
        );
    }
}

/// A route's value: `<deadline> <list>`.
fn parse_route(value: &str) -> Option<(i64, &str)> {
    let (deadline, list) = value.split_once(' ')?;
    Some((deadline.parse().ok()?, list))
}

/// The value of a job's route: its deadline and the result list its requests name.
pub fn route_value(deadline: i64, list: &str) -> String {
    format!("{deadline} {list}")
}

/// Batches read ahead of the one being written: each is about a megabyte per 1,000 results.
const READ_AHEAD: usize = 1;

/// A batch read from flight: as it is in the list (newest first), and parsed.
struct Taken {
    items: Vec<Str>,
    routed: RoutedBatch,
}

/// A batch written and not yet acknowledged.
struct Unacked {
    /// As it is in the list.
    items: Vec<Str>,
    /// The (list position, job) of results of jobs not here.
    not_here: Vec<(usize, String)>,
}

/// Parses and routes `items` (list order), oldest first; malformed ones are counted and left
/// out.
fn route_batch(stats: &ConsumerStats, list: &str, items: &[Str]) -> RoutedBatch {
    // Oldest first: the rightmost item is the oldest.
    let mut positions = Vec::with_capacity(items.len());
    let mut routed = Vec::with_capacity(items.len());
    let mut last_job: Option<Arc<str>> = None;
    for (pos, raw) in items.iter().enumerate().rev() {
        if let Some(r) = route(stats, list, raw, &mut last_job) {
            positions.push(pos);
            routed.push(r);
        }
    }
    RoutedBatch {
        received: items.len() as u64,
        positions,
        routed: Arc::new(routed),
    }
}

/// Parses and routes one element; `last_job` is the job of the one before, whose name is
/// shared rather than copied when this one belongs to it too.
fn route(
    stats: &ConsumerStats,
    list: &str,
    raw: &Str,
    last_job: &mut Option<Arc<str>>,
) -> Option<Routed> {
    let result = match RawResult::parse(raw.clone()) {
        Ok(r) => r,
        Err(e) => {
            stats.malformed();
            tracing::warn!(results = %list, error = %e, message = %preview(raw), "dropped a malformed result");
            return None;
        }
    };
    let by_metadata = || {
        let m = result.metadata()?;
        Some((
            Cow::Borrowed(m.get("job_id")?.as_str()),
            m.get("request_index")?.parse().ok()?,
        ))
    };
    let Some((job, index)) = split_request_id(result.id()).or_else(by_metadata) else {
        stats.malformed();
        tracing::warn!(results = %list, id = %preview(result.id()), "dropped a result whose id names no job");
        return None;
    };
    let job_id = match last_job {
        Some(last) if **last == *job => last.clone(),
        _ => last_job.insert(Arc::from(job.as_ref())).clone(),
    };
    Some(Routed {
        job_id,
        index,
        result,
    })
}

/// A batch of results parsed and routed, oldest first.
struct RoutedBatch {
    /// Results read, the malformed ones included.
    received: u64,
    /// The list position of each result.
    positions: Vec<usize>,
    routed: Arc<Vec<Routed>>,
}

fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn preview(raw: &str) -> String {
    let mut end = raw.len().min(200);
    while !raw.is_char_boundary(end) {
        end -= 1;
    }
    raw[..end].to_owned()
}
