//! Async dispatch: every request into the dispatcher's sorted set, results back through the
//! shared result consumers.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use batch_config::ProcessorConfig;
use batch_consumer::{ConsumerHandle, ConsumerOptions, ResultConsumer};
use batch_producer::{JobMessages, PendingMember, Producer, ProducerOptions};
use batch_queue_names::QueueNames;
use tokio_util::sync::CancellationToken;

use crate::job::{End, Job};
use crate::metrics as m;
use crate::registry::Registry;
use crate::{wait_for_end, ExecError};

pub(crate) struct AsyncMode {
    config: Arc<ProcessorConfig>,
    names: QueueNames,
    redis_url: String,
    connect: batch_redis::ConnectOptions,
    producer: Producer,
    registry: Arc<Registry>,
    consumers: tokio::sync::Mutex<HashMap<String, ConsumerHandle>>,
    shutdown: CancellationToken,
}

impl AsyncMode {
    pub(crate) async fn new(
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
            .ok_or(ExecError::NoRedisUrl)?
            .expose()
            .to_owned();
        let names = config
            .try_queue_names()
            .map_err(|e| ExecError::Config(e.to_string()))?;
        let client = batch_redis::connect(&redis_url, &connect).await?;
        let producer = Producer::new(
            client,
            ProducerOptions {
                chunk: config.async_dispatch.enqueue_chunk,
                ..ProducerOptions::default()
            },
        );
        Ok(Self {
            config,
            names,
            redis_url,
            connect,
            producer,
            registry: Arc::default(),
            consumers: Default::default(),
            shutdown: CancellationToken::new(),
        })
    }

    fn pool_of(&self, model: &str) -> Option<&str> {
        self.config
            .model_gateways
            .get(model)?
            .inference_pool_name
            .as_deref()
    }

    /// The job's members, by model, for the models this replica can serve.
    fn messages(&self, job: &Job) -> Result<BTreeMap<String, JobMessages>, ExecError> {
        let mut out = BTreeMap::new();
        for model in job.plan.models() {
            let Some(pool) = self.pool_of(&model.model) else {
                continue;
            };
            let name_error = |e: batch_queue_names::NameError| ExecError::Config(e.to_string());
            let mut headers = job.headers.clone();
            if let Some(objective) = &self.config.model_gateways[&model.model].inference_objective {
                headers.insert("x-gateway-inference-objective".into(), objective.clone());
            }
            out.insert(
                model.model.clone(),
                JobMessages {
                    job_id: job.id.clone(),
                    created: job.created_at(),
                    deadline: job.expires_at(),
                    request_queue: self.names.request_queue_name(pool).map_err(name_error)?,
                    result_queue: self.names.result_queue_name(pool).map_err(name_error)?,
                    headers,
                },
            );
        }
        Ok(out)
    }

    /// Registers the job so results reach it. Call before [`AsyncMode::run`], and for every job
    /// of a batch of resumed jobs before any runs, so no result is taken for a job not yet known.
    pub(crate) fn register(&self, job: &Arc<Job>) {
        self.registry.insert(job.clone());
    }

    async fn ensure_consumer(&self, pool: &str) -> Result<(), ExecError> {
        let mut consumers = self.consumers.lock().await;
        if consumers.contains_key(pool) {
            return Ok(());
        }
        let name_error = |e: batch_queue_names::NameError| ExecError::Config(e.to_string());
        let client = batch_redis::connect(&self.redis_url, &self.connect).await?;
        let consumer = ResultConsumer::new(
            client,
            self.names.result_queue_name(pool).map_err(name_error)?,
            self.names.inflight_queue_name(pool).map_err(name_error)?,
            self.registry.clone(),
            ConsumerOptions {
                batch: self.config.async_dispatch.result_batch,
                poll_timeout: self.config.async_dispatch.result_poll_timeout,
                ..ConsumerOptions::default()
            },
        );
        consumers.insert(pool.to_owned(), consumer.spawn(self.shutdown.child_token()));
        Ok(())
    }

    /// Enqueues every line of the job still without a result, then waits for the results, the
    /// deadline or a cancel.
    pub(crate) async fn run(&self, job: &Arc<Job>, cancel: &CancellationToken) -> End {
        match self.dispatch(job, cancel).await {
            Ok(end) => end,
            Err(e) => End::Failed(e.to_string()),
        }
    }

    async fn dispatch(&self, job: &Arc<Job>, cancel: &CancellationToken) -> Result<End, ExecError> {
        let messages = self.messages(job)?;
        let pools: Vec<String> = messages
            .keys()
            .filter_map(|model| self.pool_of(model).map(str::to_owned))
            .collect();
        for pool in &pools {
            self.ensure_consumer(pool).await?;
        }
        if job.resumed {
            // Results that arrived while no processor ran are written first, so what is
            // enqueued again below is only what has no result.
            let consumers = self.consumers.lock().await;
            for pool in &pools {
                consumers[pool].stats().drained().await;
            }
        }
        if crate::deadline_passed(job) {
            return Ok(End::Expired);
        }
        let enqueued = self.enqueue_unresolved(job, &messages, true).await?;
        tracing::info!(job = %job.id, enqueued, "requests enqueued");
        let lost_after = self.config.async_dispatch.lost_request_timeout;
        let check_every =
            (lost_after / 4).clamp(Duration::from_millis(200), Duration::from_secs(30));
        let mut checks = tokio::time::interval(check_every);
        checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut progress = job.progress();
        loop {
            let end = tokio::select! {
                end = wait_for_end(job, &mut progress, cancel) => end,
                _ = checks.tick() => None,
            };
            if let Some(end) = end {
                return Ok(end);
            }
            if job.quiet_for() >= lost_after && job.remaining() > 0 {
                // Nothing for a long time: whatever is neither queued nor answered was lost
                // (a dispatcher that crashed or dropped it); put it back. Members still queued
                // are the same bytes, so ZADD leaves them as they are.
                let requeued = self.enqueue_unresolved(job, &messages, false).await?;
                if requeued > 0 {
                    tracing::warn!(job = %job.id, requeued, "requests lost downstream were enqueued again");
                }
                job.touch();
            }
        }
    }

    /// ZADDs the member of every unresolved line; returns how many were new to the sets.
    /// `first` is the job's first enqueue in this process; later ones put back lost requests.
    async fn enqueue_unresolved(
        &self,
        job: &Arc<Job>,
        messages: &BTreeMap<String, JobMessages>,
        first: bool,
    ) -> Result<u64, ExecError> {
        let mut total = 0;
        for model in job.plan.models() {
            let Some(msgs) = messages.get(&model.model) else {
                continue;
            };
            let records = job.unresolved_records(model)?;
            let count = records.len();
            let mut failure = None;
            let members = records.iter().map_while(|r| {
                match job
                    .read_line(r)
                    .and_then(|line| Ok(msgs.member(r.line as u64, &line)?))
                {
                    Ok(member) => Some(member),
                    Err(e) => {
                        failure = Some(e);
                        None
                    }
                }
            });
            let added = self
                .producer
                .enqueue(&msgs.request_queue, msgs.score(), members)
                .await?;
            if let Some(e) = failure {
                return Err(e);
            }
            let pool = self.pool_of(&model.model).unwrap_or_default();
            if first {
                m::model_inflight(&model.model, count as f64);
                job.dispatched(count as u64);
            }
            if first && !job.resumed {
                m::pool_counter("batch_requests_enqueued_total", pool, added);
            } else {
                m::pool_counter("batch_requests_requeued_total", pool, added);
            }
            total += added;
        }
        Ok(total)
    }

    /// Takes the job's unresolved requests out of the queues (and marks those already taken),
    /// a chunk at a time so memory stays flat however large the job.
    pub(crate) async fn withdraw(&self, job: &Arc<Job>) -> Result<(), ExecError> {
        let messages = self.messages(job)?;
        let chunk = self.config.async_dispatch.enqueue_chunk.max(1);
        for model in job.plan.models() {
            let Some(msgs) = messages.get(&model.model) else {
                continue;
            };
            let records = job.unresolved_records(model)?;
            let (mut removed, mut marked) = (0, 0);
            for records in records.chunks(chunk) {
                let pending: Vec<PendingMember> = records
                    .iter()
                    .map(|r| Ok(msgs.pending(r.line as u64, &job.read_line(r)?)?))
                    .collect::<Result<_, ExecError>>()?;
                let report = self.producer.remove(&msgs.request_queue, &pending).await?;
                removed += report.removed;
                marked += report.marked;
            }
            let pool = self.pool_of(&model.model).unwrap_or_default();
            m::pool_counter("batch_requests_removed_total", pool, removed);
            m::model_inflight(&model.model, -(records.len() as f64));
            if !records.is_empty() {
                tracing::info!(job = %job.id, model = %model.model, removed, marked, "withdrew pending requests");
            }
        }
        Ok(())
    }

    pub(crate) fn unregister(&self, job: &Job) {
        self.registry.remove(&job.id);
    }

    pub(crate) async fn shutdown(&self) {
        self.shutdown.cancel();
        let consumers: Vec<_> = self
            .consumers
            .lock()
            .await
            .drain()
            .map(|(_, c)| c)
            .collect();
        for c in consumers {
            c.join().await;
        }
    }

    /// The consumers' counters by pool.
    pub(crate) async fn consumer_stats(
        &self,
    ) -> BTreeMap<String, Arc<batch_consumer::ConsumerStats>> {
        self.consumers
            .lock()
            .await
            .iter()
            .map(|(pool, c)| (pool.clone(), c.stats().clone()))
            .collect()
    }
}
