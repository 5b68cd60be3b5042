//! Async dispatch: every request into the dispatcher's sorted set, results back through the
//! result consumers, one per result list, shared by every job of the process.
//!
//! Each pool's result list is this process's alone, under a lease: with an explicit
//! `consumer_id` a list another live process reads is refused; without one the process takes the
//! first free list of `$batch`, `$batch-2`, ... A job records the list its requests name; whoever
//! resumes it reads that list too (waiting for its lease), and meanwhile takes the job's results
//! that the list's reader parked for it.
//!
//! This module decides what happens when. The Redis side of each step belongs to the producer
//! (a job's requests streamed in, searched for, withdrawn) or to the consumer (lists, leases,
//! registrations); [`readers`] keeps the process's readers of result lists.

mod lost;
mod readers;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

use batch_config::ProcessorConfig;
use batch_consumer::ConsumerOptions;
use batch_plan::Record;
use batch_producer::{JobMessages, Producer, ProducerOptions, Request};
use fred::clients::Client;
use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::metrics as m;
use crate::{blocking, wait_for_end, Dispatch, End, ExecError, Job, Stop};
use lost::Suspects;
use readers::Readers;

/// The real dispatcher's default `--request-timeout`: how long it may hold a request it sends.
const DISPATCHER_REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// How often a running job looks whether its results were handed on from another list.
const FOLLOW_EVERY: Duration = Duration::from_millis(500);

/// How long one renewal of a running job's registrations may take: a Redis that is down must
/// not hold up the job's loop.
const REREGISTER_WITHIN: Duration = Duration::from_secs(1);

/// Why the async mode could not start or go on: Redis, its queues or its result lists.
#[derive(Debug, thiserror::Error)]
pub enum AsyncError {
    /// Redis could not be reached.
    #[error(transparent)]
    Connect(#[from] batch_redis::ConnectError),
    /// Enqueueing or removing requests failed.
    #[error(transparent)]
    Producer(#[from] batch_producer::ProducerError),
    /// Redis may evict the processor's keys, and the config does not accept it.
    #[error(transparent)]
    UnsafeRedis(#[from] batch_redis::EvictionRefused),
    /// Taking a result list, or registering a job with one, failed.
    #[error(transparent)]
    Lists(#[from] batch_consumer::ListError),
    /// Async mode without a Redis URL.
    #[error("async mode needs the Redis URL (redis_url_file)")]
    NoRedisUrl,
    /// The config's queue prefix or consumer id makes no valid key name.
    #[error("config: {0}")]
    QueueNames(#[from] batch_keys::NameError),
}

impl AsyncError {
    /// The job's stop fired while Redis was out: nothing failed.
    pub fn is_stopped(&self) -> bool {
        match self {
            Self::Producer(e) => matches!(e, batch_producer::ProducerError::Stopped),
            Self::Lists(e) => e.is_stopped(),
            _ => false,
        }
    }

    /// Whether waiting could cure it, by the type of its cause: a Redis outage, or a result
    /// list another process still reads.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Producer(e) => e.is_transient(),
            Self::Lists(e) => e.is_transient(),
            Self::Connect(batch_redis::ConnectError::Unreachable { .. }) => true,
            _ => false,
        }
    }
}

/// The causes of an [`AsyncError`] become an [`ExecError::Async`] where `?` meets them in the
/// mode's steps, which also do file work of the job (an [`ExecError`] of its own).
macro_rules! async_causes {
    ($($cause:ty),*) => {$(
        impl From<$cause> for ExecError {
            fn from(e: $cause) -> Self {
                ExecError::Async(e.into())
            }
        }
    )*};
}

async_causes!(
    batch_redis::ConnectError,
    batch_producer::ProducerError,
    batch_redis::EvictionRefused,
    batch_consumer::ListError,
    batch_keys::NameError
);

impl From<batch_producer::StreamError<ExecError>> for ExecError {
    fn from(e: batch_producer::StreamError<ExecError>) -> Self {
        match e {
            batch_producer::StreamError::Source(e) => e,
            batch_producer::StreamError::Producer(e) => e.into(),
        }
    }
}

/// The async mode: requests go through the llm-d-async dispatcher's Redis queues, results come
/// back through this process's readers of result lists, shared by every job of the executor.
pub struct AsyncMode {
    config: Arc<ProcessorConfig>,
    client: Client,
    producer: Producer,
    readers: Readers,
}

/// What the async mode keeps of a job across runs, in its `job-state.json`
/// ([`Job::mode_state`]).
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
struct Recorded {
    /// The result list named by the job's requests, by pool.
    result_lists: BTreeMap<String, String>,
    /// Every request of the job reached the request queues once: a line missing at a resume
    /// is then in the dispatcher's hands or lost, not one never sent.
    enqueued: bool,
}

impl Recorded {
    /// The result list recorded for `pool`, or records `list` as it.
    fn result_list(job: &Job, pool: &str, list: &str) -> Result<String, ExecError> {
        let recorded = job.update_mode_state(|r: &mut Recorded| {
            if r.result_lists.contains_key(pool) {
                return false;
            }
            r.result_lists.insert(pool.to_owned(), list.to_owned());
            true
        })?;
        Ok(recorded.result_lists[pool].clone())
    }

    /// Records that every request reached the request queues once.
    fn mark_enqueued(job: &Job) -> Result<(), ExecError> {
        job.update_mode_state(|r: &mut Recorded| !std::mem::replace(&mut r.enqueued, true))?;
        Ok(())
    }
}

/// One model's share of a job, as the queues see it.
struct ModelQueue {
    model: batch_plan::ModelPlan,
    pool: String,
    messages: JobMessages,
    /// Plan position of the model's first record within its queue.
    first_position: u64,
}

fn name_error(e: batch_keys::NameError) -> ExecError {
    e.into()
}

/// How a job stopped by `stop` ends, when `e` is only the stop showing through.
fn stopped_or(e: ExecError, stop: &Stop) -> Result<End, ExecError> {
    if e.is_stopped() {
        Ok(stop.end().unwrap_or(End::Paused))
    } else {
        Err(e)
    }
}

/// Step of the dispatch: what stops the job's setup: its halt, or for a job resumed past its
/// deadline a timer of its own.
fn setup_stop(job: &Job, stop: &Stop) -> CancellationToken {
    // A job resumed past its deadline still takes in what arrived while no process ran it
    // (for a while), before its open lines are closed.
    if job.resumed && matches!(stop.end(), Some(End::Expired)) {
        let token = CancellationToken::new();
        let timer = token.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(30)).await;
            timer.cancel();
        });
        token
    } else {
        stop.halt().clone()
    }
}

/// The requests of `records` (with their plan positions) of one model's queue; their lines
/// are read from the input as the producer takes them.
fn requests(
    job: &Arc<Job>,
    q: &ModelQueue,
    records: Vec<(u64, Record)>,
) -> impl Iterator<Item = Result<Request, ExecError>> + Send + 'static {
    let (job, msgs, first) = (job.clone(), q.messages.clone(), q.first_position);
    records.into_iter().map(move |(pos, record)| {
        Ok(Request {
            index: record.line as u64,
            score: msgs.score_at(first + pos),
            line: job.read_line(&record)?,
        })
    })
}

impl AsyncMode {
    /// The mode for `config`: connects to Redis (`connect`'s `tls`, when `None`, comes from the
    /// config's `redis_tls`), checks it keeps the processor's keys, and with an explicit
    /// `consumer_id` takes each pool's result list.
    pub async fn new(
        config: Arc<ProcessorConfig>,
        mut connect: batch_redis::ConnectOptions,
    ) -> Result<Self, ExecError> {
        // The config's redis_tls, unless the caller chose TLS settings itself.
        if connect.tls.is_none() {
            connect.tls = config.redis_tls_options();
        }
        let redis_url = config
            .redis_url
            .as_ref()
            .ok_or(AsyncError::NoRedisUrl)?
            .expose()
            .to_owned();
        let names = config.try_queue_names()?;
        let client = batch_redis::connect(&redis_url, &connect).await?;
        // Waiting until a deadline is for the start only: the consumers' later connections
        // retry in loops of their own that watch the stop signals.
        connect.until = None;
        batch_redis::check_durability(&client, config.redis_allow_eviction).await?;
        let lost_after = config.async_dispatch.lost_request_timeout;
        if lost_after < DISPATCHER_REQUEST_TIMEOUT {
            tracing::warn!(
                lost_request_timeout = ?lost_after,
                "async_dispatch.lost_request_timeout is shorter than the dispatcher's default --request-timeout (5m): a v0.9 dispatcher keeps a request it is sending in no Redis key, so a line the gateway takes longer than that to answer is sent again"
            );
        }
        let producer = Producer::new(
            client.clone(),
            ProducerOptions {
                chunk: config.async_dispatch.enqueue_chunk,
                ..ProducerOptions::default()
            },
        );
        let options = ConsumerOptions {
            batch: config.async_dispatch.result_batch,
            poll_timeout: config.async_dispatch.result_poll_timeout,
            linger: config.async_dispatch.result_linger,
            ..ConsumerOptions::default()
        };
        let explicit = config.async_dispatch.consumer_id_set;
        let readers = Readers::new(names, explicit, redis_url, connect, client.clone(), options);
        let mode = Self {
            config,
            client,
            producer,
            readers,
        };
        if explicit {
            // A list given by name is this process's or nothing: refuse to start without it.
            for pool in mode.config.pools().keys() {
                let stop = CancellationToken::new();
                if let Err(e) = mode.readers.own_list(pool, &stop, false).await {
                    mode.readers.shutdown().await;
                    return Err(e);
                }
            }
        }
        Ok(mode)
    }

    /// The counters of this process's own result list of each pool, by pool.
    pub async fn consumer_stats(&self) -> BTreeMap<String, Arc<batch_consumer::ConsumerStats>> {
        self.readers.own_stats().await
    }

    fn pool_of(&self, model: &str) -> Option<&str> {
        self.config
            .model_gateways
            .get(model)?
            .inference_pool_name
            .as_deref()
    }

    fn retry_queue(&self) -> &str {
        &self.config.async_dispatch.retry_queue_name
    }

    /// The job's queues by model, for the models this replica can serve; the result list of
    /// each is the one the job recorded (or this process's own, recorded now).
    async fn queues(
        &self,
        job: &Arc<Job>,
        stop: &CancellationToken,
    ) -> Result<Vec<ModelQueue>, ExecError> {
        let mut out = Vec::new();
        let mut next_position: HashMap<String, u64> = HashMap::new();
        for model in job.plan.models() {
            let Some(pool) = self.pool_of(&model.model) else {
                continue;
            };
            let own = self.readers.own_list(pool, stop, true).await?;
            let recorded = {
                let (j, pool, own) = (job.clone(), pool.to_owned(), own.clone());
                blocking(move || Recorded::result_list(&j, &pool, &own)).await?
            };
            let mut headers = job.headers.clone();
            if let Some(objective) = &self.config.model_gateways[&model.model].inference_objective {
                headers.insert("x-gateway-inference-objective".into(), objective.clone());
            }
            let position = next_position.entry(pool.to_owned()).or_default();
            out.push(ModelQueue {
                model: model.clone(),
                pool: pool.to_owned(),
                messages: JobMessages {
                    job_id: job.id.clone(),
                    created: job.created_at(),
                    deadline: job.expires_at(),
                    request_queue: self
                        .readers
                        .names
                        .request_queue_name(pool)
                        .map_err(name_error)?,
                    result_queue: recorded,
                    headers,
                },
                first_position: *position,
            });
            *position += model.requests;
        }
        Ok(out)
    }

    async fn dispatch(&self, job: &Arc<Job>, stop: &Stop) -> Result<End, ExecError> {
        let setup = setup_stop(job, stop);
        let queues = match self.queues(job, &setup).await {
            Ok(q) => q,
            Err(e) if setup.is_cancelled() => {
                tracing::debug!(job = %job.id, error = %e, "stopped while setting up");
                return Ok(stop.end().unwrap_or(End::Paused));
            }
            Err(e) => return Err(e),
        };
        let lists: BTreeMap<String, String> = queues
            .iter()
            .map(|q| (q.messages.result_queue.clone(), q.pool.clone()))
            .collect();
        let producer = self.producer.with_stop(stop.halt().clone());
        if let Err(e) = self.register_job(job, &lists, &setup).await {
            return stopped_or(e, stop);
        }
        self.start_readers(job, &lists, &setup).await?;
        // Results that arrived while no process ran the job are written first, so what is
        // put back below is only what has no result.
        if job.resumed && !self.take_in_arrived(&lists, &setup).await {
            return Ok(stop.end().unwrap_or(End::Paused));
        }
        if stop.halt().is_cancelled() {
            return Ok(stop.end().unwrap_or(End::Paused));
        }
        let enqueued = self
            .enqueue_unanswered(job, &queues, &producer, stop.halt())
            .await;
        if enqueued.is_ok() && !stop.halt().is_cancelled() {
            let j = job.clone();
            blocking(move || Recorded::mark_enqueued(&j)).await?;
        }
        let enqueued = match enqueued {
            Ok(n) => n,
            Err(e) => return stopped_or(e, stop),
        };
        tracing::info!(job = %job.id, enqueued, "requests enqueued");
        self.watch_until_end(job, &queues, &lists, &producer, stop)
            .await
    }

    /// Step of the dispatch: starts the readers the job's results come through, on each of
    /// its lists (list → pool).
    async fn start_readers(
        &self,
        job: &Arc<Job>,
        lists: &BTreeMap<String, String>,
        setup: &CancellationToken,
    ) -> Result<(), ExecError> {
        for (list, pool) in lists {
            let own = self.readers.is_own(list).await;
            if !own {
                // Another process's list (the job started there): read it once it is free,
                // and meanwhile what its reader parks for this job.
                self.readers.start_consumer(pool, list, None, setup).await?;
            }
            // Always, even on this process's own list: while its lease had lapsed (a cut from
            // Redis longer than the lease), another process may have read the list and parked
            // this job's results, which only this reader takes in.
            self.readers.start_parked(list, job);
        }
        Ok(())
    }

    /// Step of the dispatch of a resumed job: waits, a bounded while for each list, until its
    /// reader took in what arrived while no process ran the job; false if `setup` stopped.
    async fn take_in_arrived(
        &self,
        lists: &BTreeMap<String, String>,
        setup: &CancellationToken,
    ) -> bool {
        // Not under the consumers' lock: a list whose reader is another live process is
        // not drained here for the whole wait, and other jobs start their consumers meanwhile.
        let stats = self.readers.stats_of(lists.keys()).await;
        let wait = self.config.async_dispatch.result_poll_timeout + self.readers.lease_ttl() * 2;
        for stats in stats {
            tokio::select! {
                _ = setup.cancelled() => return false,
                _ = tokio::time::timeout(wait, stats.drained()) => {}
            }
        }
        true
    }

    /// Step of the dispatch: enqueues the job's requests, or for a resumed job puts back those
    /// with no result; returns how many were enqueued.
    async fn enqueue_unanswered(
        &self,
        job: &Arc<Job>,
        queues: &[ModelQueue],
        producer: &Producer,
        halt: &CancellationToken,
    ) -> Result<u64, ExecError> {
        if job.resumed && job.mode_state::<Recorded>()?.enqueued {
            // Nothing is put back at once: a line in no key may still be in the dispatcher's
            // hands (a v0.9 dispatcher keeps what it is sending in no key, and a line it took
            // from the queue just before the resume is as new as any). The lost-request check
            // below puts back what stays missing once no answer can still come for it.
            Ok(0)
        } else if job.resumed {
            self.put_back_missing(job, queues, producer, None, halt)
                .await
                .map(|(n, _)| n)
        } else {
            self.enqueue_all(job, queues, producer).await
        }
    }

    /// Step of the dispatch: watches the enqueued job until it ends, renewing its
    /// registrations, following results handed on and putting back requests lost downstream.
    async fn watch_until_end(
        &self,
        job: &Arc<Job>,
        queues: &[ModelQueue],
        lists: &BTreeMap<String, String>,
        producer: &Producer,
        stop: &Stop,
    ) -> Result<End, ExecError> {
        let lost_after = self.config.async_dispatch.lost_request_timeout;
        let check_every =
            (lost_after / 4).clamp(Duration::from_millis(200), Duration::from_secs(30));
        let mut checks = tokio::time::interval(check_every);
        checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut follow = tokio::time::interval(FOLLOW_EVERY);
        follow.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut progress = job.progress();
        job.touch();
        let mut suspects: Option<Suspects> = None;
        loop {
            let end = tokio::select! {
                end = wait_for_end(&mut progress, stop) => end,
                _ = checks.tick() => None,
                _ = follow.tick() => {
                    self.readers.follow_handed_on(lists, stop.halt()).await;
                    continue;
                }
            };
            if let Some(end) = end {
                return Ok(end);
            }
            // Redis may have lost the registrations (restarted empty, flushed): write them
            // again, so that another reader of the list keeps the job's results.
            match tokio::time::timeout(
                REREGISTER_WITHIN,
                self.register_job(job, lists, stop.halt()),
            )
            .await
            {
                Ok(Err(e)) if !e.is_stopped() && !e.is_transient() => return Err(e),
                _ => {}
            }
            if job.quiet_for() < lost_after || job.remaining() == 0 {
                suspects = None;
                continue;
            }
            let confirm_after = lost_after / 2;
            if let Err(e) = self
                .put_back_lost(
                    job,
                    queues,
                    producer,
                    &mut suspects,
                    confirm_after,
                    stop.halt(),
                )
                .await
            {
                return stopped_or(e, stop);
            }
        }
    }

    /// Step of the dispatch's watch: puts back what is confirmed lost among the last check's
    /// `suspects`, which become those still unconfirmed.
    async fn put_back_lost(
        &self,
        job: &Arc<Job>,
        queues: &[ModelQueue],
        producer: &Producer,
        suspects: &mut Option<Suspects>,
        confirm_after: Duration,
        halt: &CancellationToken,
    ) -> Result<(), ExecError> {
        // Nothing for a long time: put back what is neither answered nor anywhere in the
        // dispatcher's hands (a dispatcher that crashed, or dropped it, or a Redis that
        // lost it).
        let known = suspects.take().unwrap_or_default();
        let confirm = Some((known, confirm_after));
        match self
            .put_back_missing(job, queues, producer, confirm, halt)
            .await?
        {
            (0, left) => {
                tracing::debug!(job = %job.id, suspects = left.len(), "nothing put back");
                *suspects = Some(left);
            }
            (n, left) => {
                tracing::warn!(job = %job.id, requeued = n, "requests lost downstream were enqueued again");
                *suspects = Some(left);
            }
        }
        Ok(())
    }

    /// Registers the job with each list its requests name (list → pool): its results are
    /// kept by whichever process reads the list, and handed on to it by the reader of any
    /// other list of the pool.
    async fn register_job(
        &self,
        job: &Job,
        lists: &BTreeMap<String, String>,
        stop: &CancellationToken,
    ) -> Result<(), ExecError> {
        for (list, pool) in lists {
            let routes = self.readers.routes(pool)?;
            let deadline = job.expires_at();
            batch_consumer::register_job(&self.client, list, &routes, &job.id, deadline, stop)
                .await
                .map_err(batch_consumer::ListError::from)?;
        }
        Ok(())
    }

    /// Enqueues every unresolved line, the producer reading and building members while
    /// earlier chunks are sent.
    async fn enqueue_all(
        &self,
        job: &Arc<Job>,
        queues: &[ModelQueue],
        producer: &Producer,
    ) -> Result<u64, ExecError> {
        let mut total = 0;
        for q in queues {
            let records = {
                let (j, model) = (job.clone(), q.model.clone());
                blocking(move || j.unresolved_positions(&model)).await?
            };
            let done = producer
                .enqueue_requests(&q.messages, requests(job, q, records))
                .instrument(tracing::info_span!("enqueue", model = %q.model.model, pool = %q.pool))
                .await?;
            job.inflight.add(&q.model.model, done.sent);
            job.dispatched(done.sent);
            m::pool_counter("batch_requests_enqueued_total", &q.pool, done.added);
            total += done.added;
        }
        Ok(total)
    }

    /// Takes the job's unresolved requests out of the queues (also those the dispatcher
    /// re-wrote), and marks those it may have in hand.
    async fn withdraw_job(
        &self,
        job: &Arc<Job>,
        stop: &CancellationToken,
    ) -> Result<(), ExecError> {
        let queues = self.queues(job, stop).await?;
        let producer = self.producer.with_stop(stop.clone());
        for q in &queues {
            let records = {
                let (j, model) = (job.clone(), q.model.clone());
                blocking(move || j.unresolved_records(&model)).await?
            };
            let count = records.len();
            let j = job.clone();
            let lines = records
                .into_iter()
                .map(move |r| Ok::<_, ExecError>((r.line as u64, j.read_line(&r)?)));
            let report = producer
                .withdraw(&q.messages, lines, self.retry_queue())
                .await?;
            m::pool_counter("batch_requests_removed_total", &q.pool, report.removed);
            job.inflight.remove(&q.model.model, count as u64);
            if count > 0 {
                tracing::info!(job = %job.id, model = %q.model.model, removed = report.removed, marked = report.marked, "withdrew pending requests");
            }
        }
        Ok(())
    }

    /// Forgets the job in its lists' registries: later results of it are dropped.
    async fn close_job(&self, job: &Job) {
        let lists = match job.mode_state::<Recorded>() {
            Ok(recorded) => recorded.result_lists,
            Err(e) => {
                tracing::debug!(job = %job.id, error = %e, "no result lists to unregister the job from");
                BTreeMap::new()
            }
        };
        for (pool, list) in lists {
            let Ok(routes) = self.readers.routes(&pool) else {
                continue;
            };
            let done = tokio::time::timeout(
                Duration::from_secs(5),
                batch_consumer::unregister_job(&self.client, &list, &routes, &job.id),
            )
            .await;
            if !matches!(done, Ok(Ok(()))) {
                tracing::debug!(job = %job.id, list, "could not unregister the job; its entry lapses at its deadline");
            }
        }
    }
}

impl Dispatch for AsyncMode {
    fn check_input(&self, limits: &mut batch_plan::Limits) {
        // The dispatcher re-encodes each request: what it would change is refused up front.
        limits.dispatcher = true;
    }

    fn register(&self, job: &Arc<Job>) {
        self.readers.registry().insert(job.clone());
    }

    fn unregister(&self, job: &Job) {
        self.readers.registry().remove(&job.id);
        self.readers.stop_parked(&job.id);
    }

    fn run<'a>(&'a self, job: &'a Arc<Job>, stop: &'a Stop) -> BoxFuture<'a, End> {
        Box::pin(async move {
            let end = match self.dispatch(job, stop).await {
                Ok(end) => end,
                Err(e) => End::Failed(e.into()),
            };
            if matches!(end, End::Completed | End::Failed(_)) {
                self.close_job(job).await;
            }
            end
        })
    }

    fn withdraw<'a>(
        &'a self,
        job: &'a Arc<Job>,
        stop: &'a CancellationToken,
    ) -> BoxFuture<'a, Result<(), ExecError>> {
        Box::pin(async move {
            let result = self.withdraw_job(job, stop).await;
            if !stop.is_cancelled() {
                self.close_job(job).await;
            }
            result
        })
    }

    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.readers.shutdown())
    }
}
