//! Async dispatch: every request into the dispatcher's sorted set, results back through the
//! result consumers, one per result list, shared by every job of the process.
//!
//! Each pool's result list is this process's alone, under a lease: with an explicit
//! `consumer_id` a list another live process reads is refused; without one the process takes the
//! first free list of `$batch`, `$batch-2`, ... A job records the list its requests name; whoever
//! resumes it reads that list too (waiting for its lease), and meanwhile takes the job's results
//! that the list's reader parked for it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use batch_config::ProcessorConfig;
use batch_consumer::{Acquired, ConsumerHandle, ConsumerOptions, Lease, ResultConsumer};
use batch_producer::{JobMessages, PendingMember, Producer, ProducerError, ProducerOptions};
use batch_queue_names::{ListKeys, QueueNames, DEFAULT_CONSUMER_ID};
use batch_redis::Retry;
use batch_wire::Envelope;
use fred::clients::Client;
use fred::interfaces::{HashesInterface, KeysInterface};
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use tokio_util::sync::CancellationToken;

use crate::job::{End, Job};
use crate::metrics as m;
use crate::registry::Registry;
use crate::stop::Stop;
use crate::{blocking, wait_for_end, Dispatch, ExecError};

/// How many lists named `<consumer_id>`, `<consumer_id>-2`, ... a process tries by itself.
const AUTO_LISTS: usize = 64;

/// The real dispatcher's default `--request-timeout`: how long it may hold a request it sends.
const DISPATCHER_REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// How far apart the two looks of a resume are (at most half of `lost_request_timeout`).
const RESUME_CONFIRM: Duration = Duration::from_secs(5);

/// How often a running job looks whether its results were handed on from another list.
const FOLLOW_EVERY: Duration = Duration::from_millis(500);

pub(crate) struct AsyncMode {
    config: Arc<ProcessorConfig>,
    names: QueueNames,
    redis_url: String,
    connect: batch_redis::ConnectOptions,
    client: Client,
    producer: Producer,
    registry: Arc<Registry>,
    /// This process's own result list, by pool.
    own: tokio::sync::Mutex<HashMap<String, String>>,
    /// Leases taken at start whose consumers start with the first job (so that the job is
    /// known before its results are read).
    idle: tokio::sync::Mutex<HashMap<String, Lease>>,
    /// Consumers of whole result lists, by list.
    consumers: tokio::sync::Mutex<HashMap<String, ConsumerHandle>>,
    /// Consumers of jobs' parked lists, by job.
    parked: Mutex<HashMap<String, Vec<(CancellationToken, ConsumerHandle)>>>,
    /// Lists of each pool where the dispatcher was seen to put our requests' results, other
    /// than the ones the requests name (a queue entry with its own `result_queue_name`).
    dispatcher_lists: Mutex<HashMap<String, BTreeSet<String>>>,
    shutdown: CancellationToken,
}

/// One model's share of a job, as the queues see it.
struct ModelQueue {
    model: batch_plan::ModelPlan,
    pool: String,
    messages: JobMessages,
    /// Plan position of the model's first record within its queue.
    first_position: u64,
}

fn name_error(e: batch_queue_names::NameError) -> ExecError {
    ExecError::Config(e.to_string())
}

fn producer_error(e: ProducerError, stop: &Stop) -> Result<End, ExecError> {
    match e {
        ProducerError::Stopped => Ok(stop.end().unwrap_or(End::Paused)),
        e => Err(e.into()),
    }
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
        let mode = Self {
            config,
            names,
            redis_url,
            connect,
            client,
            producer,
            registry: Arc::default(),
            own: Default::default(),
            idle: Default::default(),
            consumers: Default::default(),
            parked: Default::default(),
            dispatcher_lists: Default::default(),
            shutdown: CancellationToken::new(),
        };
        if mode.config.async_dispatch.consumer_id_set {
            // A list given by name is this process's or nothing: refuse to start without it.
            for pool in mode.config.pools().keys() {
                if let Err(e) = mode.own_list(pool, &mode.shutdown.clone(), false).await {
                    mode.shutdown().await;
                    return Err(e);
                }
            }
        }
        Ok(mode)
    }

    fn pool_of(&self, model: &str) -> Option<&str> {
        self.config
            .model_gateways
            .get(model)?
            .inference_pool_name
            .as_deref()
    }

    fn consumer_options(&self) -> ConsumerOptions {
        ConsumerOptions {
            batch: self.config.async_dispatch.result_batch,
            poll_timeout: self.config.async_dispatch.result_poll_timeout,
            linger: self.config.async_dispatch.result_linger,
            ..ConsumerOptions::default()
        }
    }

    /// The pool's result routes: where each running job's requests ask for their results.
    fn routes(&self, pool: &str) -> Result<String, ExecError> {
        self.names.result_routes_name(pool).map_err(name_error)
    }

    /// The list the dispatcher's queue entries name when they name one: the seed's
    /// `{prefix}:results:{pool}:$batch`.
    fn base_list(&self, pool: &str) -> Result<String, ExecError> {
        QueueNames::new(self.names.prefix(), DEFAULT_CONSUMER_ID)
            .and_then(|n| n.result_queue_name(pool))
            .map_err(name_error)
    }

    /// This process's result list for `pool`, taking its lease the first time; with `start`,
    /// its consumer runs too.
    async fn own_list(
        &self,
        pool: &str,
        stop: &CancellationToken,
        start: bool,
    ) -> Result<String, ExecError> {
        let mut own = self.own.lock().await;
        if let Some(list) = own.get(pool) {
            if start {
                let idle = self.idle.lock().await.remove(list);
                if let Some(lease) = idle {
                    self.start_consumer(pool, list, Some(lease), stop).await?;
                }
            }
            return Ok(list.clone());
        }
        let ttl = self.consumer_options().lease_ttl;
        let base = self.names.consumer_id().to_owned();
        let (list, lease) = if self.config.async_dispatch.consumer_id_set {
            let list = self.names.result_queue_name(pool).map_err(name_error)?;
            let keys = ListKeys::new(&list);
            // A holder that stopped renewing (killed elsewhere) lapses within one TTL.
            let wait = ttl + Duration::from_secs(1);
            match Retry::new(format!("taking {}", keys.lease))
                .run(stop, || {
                    Lease::acquire_waiting(&self.client, &keys.lease, ttl, wait, stop)
                })
                .await
                .map_err(|e| ExecError::Redis(e.to_string()))?
            {
                Ok(lease) => (list, lease),
                Err(holder) => {
                    let who = holder.map_or_else(|raw| raw, |h| h.to_string());
                    return Err(ExecError::ListHeld(format!(
                        "result list {list} is read by another live process ({who}); give each process its own async_dispatch.consumer_id, or leave it unset to have one picked"
                    )));
                }
            }
        } else {
            let mut taken = None;
            for n in 1..=AUTO_LISTS {
                let id = if n == 1 {
                    base.clone()
                } else {
                    format!("{base}-{n}")
                };
                let names = QueueNames::new(self.names.prefix(), id).map_err(name_error)?;
                let list = names.result_queue_name(pool).map_err(name_error)?;
                let keys = ListKeys::new(&list);
                match Retry::new(format!("taking {}", keys.lease))
                    .run(stop, || Lease::try_acquire(&self.client, &keys.lease, ttl))
                    .await
                    .map_err(|e| ExecError::Redis(e.to_string()))?
                {
                    Acquired::Taken(lease) => {
                        taken = Some((list, lease));
                        break;
                    }
                    Acquired::Held(_) => continue,
                }
            }
            taken.ok_or_else(|| {
                ExecError::ListHeld(format!(
                    "all {AUTO_LISTS} result lists of pool {pool} ({base} to {base}-{AUTO_LISTS}) are read by other processes"
                ))
            })?
        };
        if list != self.names.result_queue_name(pool).map_err(name_error)? {
            tracing::info!(pool, list = %list, "using a free result list: another process reads the first one");
        }
        if start {
            self.start_consumer(pool, &list, Some(lease), stop).await?;
            let base = self.base_list(pool)?;
            if !self.config.async_dispatch.consumer_id_set && list != base {
                // A dispatcher whose queue entry names the seed's list sends every result
                // there: once its reader stops, this process reads it, so no result waits
                // there unread while a job of this process runs.
                self.start_consumer(pool, &base, None, stop).await?;
            }
        } else {
            self.idle.lock().await.insert(list.clone(), lease);
        }
        own.insert(pool.to_owned(), list.clone());
        Ok(list)
    }

    /// Starts a consumer of the whole list `list` of `pool` unless one runs; without `lease` it
    /// waits for the list's lease first.
    async fn start_consumer(
        &self,
        pool: &str,
        list: &str,
        lease: Option<Lease>,
        stop: &CancellationToken,
    ) -> Result<(), ExecError> {
        let mut consumers = self.consumers.lock().await;
        if consumers.contains_key(list) {
            return Ok(());
        }
        // Its own connection: the blocking pop holds it. Redis being out waits, like any
        // other outage.
        let client = loop {
            match batch_redis::connect(&self.redis_url, &self.connect).await {
                Ok(client) => break client,
                Err(e @ batch_redis::ConnectError::Unreachable { .. }) if !stop.is_cancelled() => {
                    tracing::debug!(error = %e, "still cannot reach Redis for a result consumer");
                }
                Err(e) => return Err(e.into()),
            }
        };
        let consumer = ResultConsumer::new(
            client,
            self.client.clone(),
            ListKeys::new(list),
            self.registry.clone(),
            ConsumerOptions {
                routes: Some(self.routes(pool)?),
                standby: lease.is_none(),
                ..self.consumer_options()
            },
        );
        consumers.insert(
            list.to_owned(),
            consumer.spawn(lease, self.shutdown.child_token()),
        );
        Ok(())
    }

    /// Reads what the reader of `list` parked for `job`, until the job ends.
    fn start_parked_consumer(&self, list: &str, job: &Job) {
        let stop = self.shutdown.child_token();
        let consumer = ResultConsumer::new(
            self.client.clone(),
            self.client.clone(),
            ListKeys::parked(list, &job.id),
            self.registry.clone(),
            ConsumerOptions {
                blocking: false,
                poll_timeout: Duration::from_secs(1),
                ..self.consumer_options()
            },
        );
        let handle = consumer.spawn(None, stop.clone());
        self.parked
            .lock()
            .expect("parked lock")
            .entry(job.id.clone())
            .or_default()
            .push((stop, handle));
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
            let own = self.own_list(pool, stop, true).await?;
            let recorded = {
                let (j, pool, own) = (job.clone(), pool.to_owned(), own.clone());
                blocking(move || j.result_list(&pool, &own)).await?
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
                    request_queue: self.names.request_queue_name(pool).map_err(name_error)?,
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
        // A job resumed past its deadline still takes in what arrived while no process ran it
        // (for a while), before its open lines are closed.
        let setup = if job.resumed && matches!(stop.end(), Some(End::Expired)) {
            let token = CancellationToken::new();
            let timer = token.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(30)).await;
                timer.cancel();
            });
            token
        } else {
            stop.halt.clone()
        };
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
        let producer = self.producer.with_stop(stop.halt.clone());
        for (list, pool) in &lists {
            // Registered, its results are kept by whichever process reads the list, and
            // handed on to it by the reader of any other list of the pool.
            let keys = ListKeys::new(list);
            let routes = self.routes(pool)?;
            let route = batch_consumer::route_value(job.expires_at(), list);
            let registered = Retry::new(format!("HSET {}", keys.jobs))
                .run(&setup, || async {
                    self.client
                        .hset::<(), _, _>(&keys.jobs, (job.id.as_str(), job.expires_at()))
                        .await?;
                    self.client
                        .hset::<(), _, _>(&routes, (job.id.as_str(), route.as_str()))
                        .await
                })
                .await;
            if let Err(e) = registered {
                return match e {
                    batch_redis::RetryError::Stopped => Ok(stop.end().unwrap_or(End::Paused)),
                    e => Err(ExecError::Redis(e.to_string())),
                };
            }
            let own = self.own.lock().await.values().any(|l| l == list);
            if !own {
                // Another process's list (the job started there): read it once it is free,
                // and meanwhile what its reader parks for this job.
                self.start_consumer(pool, list, None, &setup).await?;
            }
            if job.resumed || !own {
                self.start_parked_consumer(list, job);
            }
        }
        if job.resumed {
            // Results that arrived while no process ran the job are written first, so what is
            // put back below is only what has no result.
            // Not under the consumers' lock: a list whose reader is another live process is
            // not drained here for the whole wait, and other jobs start their consumers meanwhile.
            let stats: Vec<_> = {
                let consumers = self.consumers.lock().await;
                lists
                    .keys()
                    .filter_map(|list| Some(consumers.get(list)?.stats().clone()))
                    .collect()
            };
            let ttl = self.consumer_options().lease_ttl;
            let wait = self.config.async_dispatch.result_poll_timeout + ttl * 2;
            for stats in stats {
                tokio::select! {
                    _ = setup.cancelled() => return Ok(stop.end().unwrap_or(End::Paused)),
                    _ = tokio::time::timeout(wait, stats.drained()) => {}
                }
            }
        }
        if stop.halt.is_cancelled() {
            return Ok(stop.end().unwrap_or(End::Paused));
        }
        let enqueued = if job.resumed && job.was_enqueued() {
            self.put_back_confirmed(job, &queues, &producer, stop).await
        } else if job.resumed {
            self.put_back_missing(job, &queues, &producer, None)
                .await
                .map(|(n, _)| n)
        } else {
            self.enqueue_all(job, &queues, &producer).await
        };
        if enqueued.is_ok() && !stop.halt.is_cancelled() {
            let j = job.clone();
            blocking(move || j.mark_enqueued()).await?;
        }
        let enqueued = match enqueued {
            Ok(n) => n,
            Err(ExecError::Producer(e)) => return producer_error(e, stop),
            Err(e) => return Err(e),
        };
        tracing::info!(job = %job.id, enqueued, "requests enqueued");
        let lost_after = self.config.async_dispatch.lost_request_timeout;
        let check_every =
            (lost_after / 4).clamp(Duration::from_millis(200), Duration::from_secs(30));
        let mut checks = tokio::time::interval(check_every);
        checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut follow = tokio::time::interval(FOLLOW_EVERY);
        follow.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut progress = job.progress();
        job.touch();
        // Lines found missing by a look, and since when: a v0.9 dispatcher holds what it is
        // sending in no set at all, so a line is put back only once two looks, far enough
        // apart within one quiet spell, both miss it.
        let mut suspects: Option<HashMap<u32, std::time::Instant>> = None;
        loop {
            let end = tokio::select! {
                end = wait_for_end(&mut progress, stop) => end,
                _ = checks.tick() => None,
                _ = follow.tick() => {
                    self.follow_handed_on(&lists, &stop.halt).await;
                    continue;
                }
            };
            if let Some(end) = end {
                return Ok(end);
            }
            if job.quiet_for() < lost_after || job.remaining() == 0 {
                suspects = None;
                continue;
            }
            // Nothing for a long time: put back what is neither answered nor anywhere in the
            // dispatcher's hands (a dispatcher that crashed, or dropped it).
            let known = suspects.take().unwrap_or_default();
            match self
                .put_back_missing(job, &queues, &producer, Some((known, lost_after / 2)))
                .await
            {
                Ok((0, left)) => {
                    tracing::debug!(job = %job.id, suspects = left.len(), "nothing put back");
                    suspects = Some(left);
                }
                Ok((n, left)) => {
                    tracing::warn!(job = %job.id, requeued = n, "requests lost downstream were enqueued again");
                    suspects = Some(left);
                }
                Err(ExecError::Producer(e)) => return producer_error(e, stop),
                Err(e) => return Err(e),
            }
        }
    }

    /// ZADDs the member of every unresolved line, reading and building members on a blocking
    /// thread while earlier chunks are sent.
    async fn enqueue_all(
        &self,
        job: &Arc<Job>,
        queues: &[ModelQueue],
        producer: &Producer,
    ) -> Result<u64, ExecError> {
        let mut total = 0;
        for q in queues {
            // One chunk built ahead of those in flight: building is much faster than sending,
            // and every chunk held is megabytes.
            let (tx, mut rx) =
                tokio::sync::mpsc::channel::<Result<Vec<(f64, String)>, ExecError>>(1);
            let chunk = self.config.async_dispatch.enqueue_chunk.max(1);
            let (j, model, msgs, first) = (
                job.clone(),
                q.model.clone(),
                q.messages.clone(),
                q.first_position,
            );
            let reader = tokio::task::spawn_blocking(move || {
                let send = |item| tx.blocking_send(item).is_ok();
                let records = match j.unresolved_positions(&model) {
                    Ok(r) => r,
                    Err(e) => return send(Err(e)),
                };
                let mut batch = Vec::with_capacity(chunk);
                for (pos, record) in records {
                    let member = j
                        .read_line(&record)
                        .and_then(|line| Ok(msgs.member(record.line as u64, &line)?));
                    match member {
                        Ok(member) => batch.push((msgs.score_at(first + pos), member)),
                        Err(e) => return send(Err(e)),
                    }
                    if batch.len() == chunk && !send(Ok(std::mem::take(&mut batch))) {
                        return false;
                    }
                }
                batch.is_empty() || send(Ok(batch))
            });
            let mut in_flight = FuturesUnordered::new();
            let (mut added, mut count) = (0u64, 0u64);
            let mut failure = None;
            while let Some(chunk) = rx.recv().await {
                let chunk = match chunk {
                    Ok(c) => c,
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                };
                count += chunk.len() as u64;
                in_flight.push(producer.enqueue_scored(&q.messages.request_queue, chunk));
                while in_flight.len() >= 4 {
                    added += in_flight.next().await.expect("not empty")?;
                }
            }
            drop(rx);
            while let Some(done) = in_flight.next().await {
                added += done?;
            }
            let _ = reader.await;
            if let Some(e) = failure {
                return Err(e);
            }
            m::model_inflight(&q.model.model, count as f64);
            job.dispatched(count);
            m::pool_counter("batch_requests_enqueued_total", &q.pool, added);
            total += added;
        }
        Ok(total)
    }

    /// At the resume of a job whose requests were all enqueued once: puts back what two looks,
    /// [`RESUME_CONFIRM`] apart, both find nowhere. A v0.9 dispatcher keeps what it is sending
    /// in no Redis key, so one look at a resume would send those lines a second time.
    async fn put_back_confirmed(
        &self,
        job: &Arc<Job>,
        queues: &[ModelQueue],
        producer: &Producer,
        stop: &Stop,
    ) -> Result<u64, ExecError> {
        let after = RESUME_CONFIRM.min(self.config.async_dispatch.lost_request_timeout / 2);
        let (_, suspects) = self
            .put_back_missing(job, queues, producer, Some((HashMap::new(), after)))
            .await?;
        if suspects.is_empty() {
            return Ok(0);
        }
        tokio::select! {
            _ = stop.halt.cancelled() => return Ok(0),
            _ = tokio::time::sleep(after) => {}
        }
        let (n, _) = self
            .put_back_missing(job, queues, producer, Some((suspects, after)))
            .await?;
        Ok(n)
    }

    /// Puts back the unresolved lines whose requests are nowhere in the dispatcher's hands: not
    /// in the request set, not in its retry set, not claimed (v0.10), matched by request id
    /// whatever bytes the dispatcher re-wrote them with. Reads only those lines.
    ///
    /// With `confirm` = (suspects, after), a missing line is only put back when it was already
    /// missing `after` ago; the suspects left are returned for the next look.
    async fn put_back_missing(
        &self,
        job: &Arc<Job>,
        queues: &[ModelQueue],
        producer: &Producer,
        confirm: Option<(HashMap<u32, std::time::Instant>, Duration)>,
    ) -> Result<(u64, HashMap<u32, std::time::Instant>), ExecError> {
        let present = self.present_ids(job, queues, producer).await?;
        let (mut known, after) = match confirm {
            Some((known, after)) => (Some(known), after),
            None => (None, Duration::ZERO),
        };
        let mut left = HashMap::new();
        let mut total = 0;
        for q in queues {
            let (j, model, msgs, first, present, mut known_here) = (
                job.clone(),
                q.model.clone(),
                q.messages.clone(),
                q.first_position,
                present.clone(),
                known.take(),
            );
            let (members, known_back, left_here) = blocking(move || {
                let now = std::time::Instant::now();
                let mut out = Vec::new();
                let mut left = HashMap::new();
                for (pos, record) in j.unresolved_positions(&model)? {
                    if present.contains(&record.line) {
                        continue;
                    }
                    if let Some(known) = &known_here {
                        match known.get(&record.line) {
                            Some(since) if now.duration_since(*since) >= after => {}
                            Some(since) => {
                                left.insert(record.line, *since);
                                continue;
                            }
                            None => {
                                left.insert(record.line, now);
                                continue;
                            }
                        }
                    }
                    let line = j.read_line(&record)?;
                    out.push((
                        msgs.score_at(first + pos),
                        msgs.member(record.line as u64, &line)?,
                    ));
                }
                if let Some(known) = &mut known_here {
                    known.retain(|line, _| !left.contains_key(line));
                }
                Ok((out, known_here, left))
            })
            .await?;
            known = known_back;
            left.extend(left_here);
            let members: Vec<(f64, String)> = members;
            let count = members.len() as u64;
            let added = producer
                .enqueue_scored(&q.messages.request_queue, members)
                .await?;
            if job.resumed && job.progress().borrow().dispatched == 0 {
                job.dispatched(count);
                m::model_inflight(&q.model.model, count as f64);
            }
            m::pool_counter("batch_requests_requeued_total", &q.pool, added);
            total += added;
        }
        Ok((total, left))
    }

    /// Reads, too, the lists where the readers of other lists found results of `lists`' requests
    /// (the dispatcher's queue entry names its own list), once they are free: results that
    /// land there then reach their jobs even when no other process reads that list any more.
    async fn follow_handed_on(&self, lists: &BTreeMap<String, String>, stop: &CancellationToken) {
        for (list, pool) in lists {
            let key = ListKeys::new(list).handed_from;
            // Bounded: a Redis that is down must not keep the job from seeing its end.
            let read = tokio::select! {
                _ = stop.cancelled() => return,
                r = tokio::time::timeout(FOLLOW_EVERY, self.client.get::<Option<String>, _>(&key)) => r,
            };
            let from = match read {
                Ok(Ok(from)) => from,
                Ok(Err(e)) => {
                    tracing::debug!(key, error = %e, "could not read where results were handed on from");
                    continue;
                }
                Err(_) => continue,
            };
            let Some(from) = from.filter(|f| f != list) else {
                continue;
            };
            let new = self
                .dispatcher_lists
                .lock()
                .expect("dispatcher lists lock")
                .entry(pool.clone())
                .or_default()
                .insert(from.clone());
            if new {
                batch_consumer::warn_lists_differ(list, &from);
                m::pool_counter("batch_result_lists_followed_total", pool, 1);
                if let Err(e) = self.start_consumer(pool, &from, None, stop).await {
                    tracing::debug!(list = %from, error = %e, "could not start reading the dispatcher's result list");
                }
            }
        }
    }

    /// Line indexes of the job whose requests the dispatcher holds in some form.
    async fn present_ids(
        &self,
        job: &Job,
        queues: &[ModelQueue],
        producer: &Producer,
    ) -> Result<Arc<HashSet<u32>>, ExecError> {
        let prefix = job_id_prefix(&job.id);
        let member_pattern = format!("*\"id\":\"{prefix}*");
        let mut present = HashSet::new();
        let mut keep = |id: &str| {
            if let Some((job_id, index)) = batch_wire::parse_request_id(id) {
                if job_id == job.id {
                    present.insert(index as u32);
                }
            }
        };
        let sets: HashSet<&str> = queues
            .iter()
            .map(|q| q.messages.request_queue.as_str())
            .chain([self.config.async_dispatch.retry_queue_name.as_str()])
            .collect();
        for set in sets {
            for member in producer.scan_members(set, &member_pattern).await? {
                if let Ok(envelope) = Envelope::parse(&member) {
                    keep(&envelope.data.id);
                }
            }
        }
        // The v0.10 dispatcher keeps what it has in hand in `{<queue>}:claimed`, keyed by
        // id NUL token.
        let claimed: HashSet<String> = queues
            .iter()
            .map(|q| format!("{{{}}}:claimed", q.messages.request_queue))
            .collect();
        for key in claimed {
            for field in producer.scan_fields(&key, &format!("{prefix}*")).await? {
                keep(field.split('\0').next().unwrap_or_default());
            }
        }
        // Results not yet written are no lost lines: the lists the dispatcher may use other
        // than the job's first, since results only move from those to the job's.
        let mut lists: Vec<String> = Vec::new();
        for q in queues {
            let mut others: Vec<String> = self
                .dispatcher_lists
                .lock()
                .expect("dispatcher lists lock")
                .get(&q.pool)
                .map(|l| l.iter().cloned().collect())
                .unwrap_or_default();
            others.push(self.base_list(&q.pool)?);
            for list in others {
                if list != q.messages.result_queue && !lists.contains(&list) {
                    lists.push(list);
                }
            }
        }
        for q in queues {
            if !lists.contains(&q.messages.result_queue) {
                lists.push(q.messages.result_queue.clone());
            }
        }
        for list in lists {
            let ids = batch_consumer::waiting_ids(&self.client, &list, &job.id, &prefix)
                .await
                .map_err(|e| ExecError::Redis(e.to_string()))?;
            for id in ids {
                keep(&id);
            }
        }
        Ok(Arc::new(present))
    }

    /// Takes the job's unresolved requests out of the queues (also those the dispatcher
    /// re-wrote), and marks those it may have in hand, a chunk at a time.
    async fn withdraw_job(
        &self,
        job: &Arc<Job>,
        stop: &CancellationToken,
    ) -> Result<(), ExecError> {
        let queues = self.queues(job, stop).await?;
        let producer = self.producer.with_stop(stop.clone());
        let chunk = self.config.async_dispatch.enqueue_chunk.max(1);
        for q in &queues {
            let records = {
                let (j, model) = (job.clone(), q.model.clone());
                blocking(move || j.unresolved_records(&model)).await?
            };
            let (mut removed, mut marked) = (0, 0);
            for records in records.chunks(chunk) {
                let (j, msgs, records) = (job.clone(), q.messages.clone(), records.to_vec());
                let pending: Vec<PendingMember> = blocking(move || {
                    records
                        .iter()
                        .map(|r| Ok(msgs.pending(r.line as u64, &j.read_line(r)?)?))
                        .collect()
                })
                .await?;
                let report = producer.remove(&q.messages.request_queue, &pending).await?;
                removed += report.removed;
                marked += report.marked;
            }
            // Members the dispatcher put back re-serialised have other bytes: find them by id.
            let pattern = format!("*\"id\":\"{}*", job_id_prefix(&job.id));
            for set in [
                q.messages.request_queue.as_str(),
                self.config.async_dispatch.retry_queue_name.as_str(),
            ] {
                let leftovers: Vec<String> = producer
                    .scan_members(set, &pattern)
                    .await?
                    .into_iter()
                    .filter(|m| {
                        Envelope::parse(m).is_ok_and(|e| {
                            batch_wire::parse_request_id(&e.data.id)
                                .is_some_and(|(j, _)| j == job.id)
                        })
                    })
                    .collect();
                if !leftovers.is_empty() {
                    let r = producer.remove_exact(set, &leftovers).await?;
                    removed += r;
                }
            }
            m::pool_counter("batch_requests_removed_total", &q.pool, removed);
            m::model_inflight(&q.model.model, -(records.len() as f64));
            if !records.is_empty() {
                tracing::info!(job = %job.id, model = %q.model.model, removed, marked, "withdrew pending requests");
            }
        }
        Ok(())
    }

    /// Forgets the job in its lists' registries: later results of it are dropped.
    async fn close_job(&self, job: &Job) {
        let lists: Vec<(String, String)> = job
            .manifest
            .lock()
            .expect("manifest lock")
            .result_lists
            .iter()
            .map(|(pool, list)| (pool.clone(), list.clone()))
            .collect();
        for (pool, list) in lists {
            let keys = ListKeys::new(&list);
            let done = tokio::time::timeout(Duration::from_secs(5), async {
                if let Ok(routes) = self.routes(&pool) {
                    self.client
                        .hdel::<i64, _, _>(&routes, job.id.as_str())
                        .await?;
                }
                self.client
                    .hdel::<i64, _, _>(&keys.jobs, job.id.as_str())
                    .await
            })
            .await;
            if !matches!(done, Ok(Ok(_))) {
                tracing::debug!(job = %job.id, list, "could not unregister the job; its entry lapses at its deadline");
            }
        }
    }
}

/// What every request id of `job` starts with: `batch_req_<escaped job>_`.
fn job_id_prefix(job: &str) -> String {
    let id = batch_wire::request_id(job, 0);
    id[..id.len() - 1].to_owned()
}

impl Dispatch for AsyncMode {
    fn register(&self, job: &Arc<Job>) {
        self.registry.insert(job.clone());
    }

    fn unregister(&self, job: &Job) {
        self.registry.remove(&job.id);
        let parked = self
            .parked
            .lock()
            .expect("parked lock")
            .remove(&job.id)
            .unwrap_or_default();
        for (stop, _handle) in parked {
            stop.cancel();
        }
    }

    fn run<'a>(&'a self, job: &'a Arc<Job>, stop: &'a Stop) -> BoxFuture<'a, End> {
        Box::pin(async move {
            let end = match self.dispatch(job, stop).await {
                Ok(end) => end,
                Err(e) => End::Failed(e.to_string()),
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
        Box::pin(async move {
            self.shutdown.cancel();
            let idle: Vec<Lease> = self.idle.lock().await.drain().map(|(_, l)| l).collect();
            for lease in idle {
                lease.release().await;
            }
            let consumers: Vec<_> = self
                .consumers
                .lock()
                .await
                .drain()
                .map(|(_, c)| c)
                .collect();
            let parked: Vec<_> = self
                .parked
                .lock()
                .expect("parked lock")
                .drain()
                .flat_map(|(_, v)| v)
                .collect();
            for c in consumers {
                c.join().await;
            }
            for (_, c) in parked {
                c.join().await;
            }
        })
    }

    fn consumer_stats(
        &self,
    ) -> BoxFuture<'_, BTreeMap<String, Arc<batch_consumer::ConsumerStats>>> {
        Box::pin(async move {
            let own = self.own.lock().await.clone();
            let consumers = self.consumers.lock().await;
            own.into_iter()
                .filter_map(|(pool, list)| Some((pool, consumers.get(&list)?.stats().clone())))
                .collect()
        })
    }
}
