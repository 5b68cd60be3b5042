#![doc = include_str!("../README.md")]

mod drain;
mod lease;
mod lists;
mod scripts;
mod stats;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use batch_keys::ListKeys;
use batch_redis::Backoff;
use batch_wire::RawResult;
use fred::bytes_utils::Str;
use fred::clients::Client;
use fred::interfaces::{ClientLike, ListInterface};
use fred::types::config::Options;
use fred::types::{ClusterHash, CustomCommand, Value};
use tokio_util::sync::CancellationToken;

pub use lease::{Acquired, Holder, Lease};
pub use lists::{
    claim_list, handed_from, register_job, route_value, unregister_job, waiting_ids, waiting_lines,
    warn_lists_differ, ListError, AUTO_LISTS,
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
    /// The pool's result routes ([`batch_keys::QueueNames::result_routes_name`]): a
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
            // Short: after an outage the consumer is reading again within 2 s of Redis
            // answering, and one command every 2 s costs a dead link nothing.
            max_backoff: Duration::from_secs(2),
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
}

fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}
