//! The process's readers of result lists: its own list of each pool, the lists jobs it resumes
//! started on, the lists the dispatcher really sends to, and jobs' parked lists.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use batch_consumer::{ConsumerHandle, ConsumerOptions, ConsumerStats, Lease, ResultConsumer};
use batch_keys::{ListKeys, QueueNames};
use fred::clients::Client;
use tokio_util::sync::CancellationToken;

use super::{name_error, FOLLOW_EVERY};
use crate::metrics as m;
use crate::registry::Registry;
use crate::{ExecError, Job};

pub(super) struct Readers {
    pub(super) names: QueueNames,
    /// The consumer id was given: a pool's list is that one or none.
    explicit: bool,
    redis_url: String,
    connect: batch_redis::ConnectOptions,
    client: Client,
    registry: Arc<Registry>,
    options: ConsumerOptions,
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

impl Readers {
    pub(super) fn new(
        names: QueueNames,
        explicit: bool,
        redis_url: String,
        connect: batch_redis::ConnectOptions,
        client: Client,
        options: ConsumerOptions,
    ) -> Self {
        Self {
            names,
            explicit,
            redis_url,
            connect,
            client,
            registry: Arc::default(),
            options,
            own: Default::default(),
            idle: Default::default(),
            consumers: Default::default(),
            parked: Default::default(),
            dispatcher_lists: Default::default(),
            shutdown: CancellationToken::new(),
        }
    }

    pub(super) fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    pub(super) fn lease_ttl(&self) -> Duration {
        self.options.lease_ttl
    }

    /// The pool's result routes: where each running job's requests ask for their results.
    pub(super) fn routes(&self, pool: &str) -> Result<String, ExecError> {
        self.names.result_routes_name(pool).map_err(name_error)
    }

    /// This process's result list for `pool`, taking its lease the first time; with `start`,
    /// its consumer runs too.
    pub(super) async fn own_list(
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
        let ttl = self.options.lease_ttl;
        let (list, lease) =
            batch_consumer::claim_list(&self.client, &self.names, pool, ttl, self.explicit, stop)
                .await?;
        if list != self.names.result_queue_name(pool).map_err(name_error)? {
            tracing::info!(pool, list = %list, "using a free result list: another process reads the first one");
        }
        if start {
            self.start_consumer(pool, &list, Some(lease), stop).await?;
            let seed = self
                .names
                .seed_result_queue_name(pool)
                .map_err(name_error)?;
            if !self.explicit && list != seed {
                // A dispatcher whose queue entry names the seed's list sends every result
                // there: once its reader stops, this process reads it, so no result waits
                // there unread while a job of this process runs.
                self.start_consumer(pool, &seed, None, stop).await?;
            }
        } else {
            self.idle.lock().await.insert(list.clone(), lease);
        }
        own.insert(pool.to_owned(), list.clone());
        Ok(list)
    }

    /// Whether `list` is one of this process's own.
    pub(super) async fn is_own(&self, list: &str) -> bool {
        self.own.lock().await.values().any(|l| l == list)
    }

    /// Starts a consumer of the whole list `list` of `pool` unless one runs; without `lease` it
    /// waits for the list's lease first.
    pub(super) async fn start_consumer(
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
                ..self.options.clone()
            },
        );
        consumers.insert(
            list.to_owned(),
            consumer.spawn(lease, self.shutdown.child_token()),
        );
        Ok(())
    }

    /// Reads what the reader of `list` parked for `job`, until the job ends.
    pub(super) fn start_parked(&self, list: &str, job: &Job) {
        let stop = self.shutdown.child_token();
        let consumer = ResultConsumer::parked(
            self.client.clone(),
            list,
            &job.id,
            self.registry.clone(),
            self.options.clone(),
        );
        let handle = consumer.spawn(None, stop.clone());
        self.parked
            .lock()
            .expect("parked lock")
            .entry(job.id.clone())
            .or_default()
            .push((stop, handle));
    }

    /// Stops reading the parked lists of `job`.
    pub(super) fn stop_parked(&self, job: &str) {
        let parked = self
            .parked
            .lock()
            .expect("parked lock")
            .remove(job)
            .unwrap_or_default();
        for (stop, _handle) in parked {
            stop.cancel();
        }
    }

    /// The counters of the readers of `lists`, where this process reads them.
    pub(super) async fn stats_of<'a>(
        &self,
        lists: impl Iterator<Item = &'a String>,
    ) -> Vec<Arc<ConsumerStats>> {
        let consumers = self.consumers.lock().await;
        lists
            .filter_map(|list| Some(consumers.get(list)?.stats().clone()))
            .collect()
    }

    /// Reads, too, the lists where the readers of other lists found results of `lists`' requests
    /// (the dispatcher's queue entry names its own list), once they are free: results that
    /// land there then reach their jobs even when no other process reads that list any more.
    pub(super) async fn follow_handed_on(
        &self,
        lists: &BTreeMap<String, String>,
        stop: &CancellationToken,
    ) {
        for (list, pool) in lists {
            // Bounded: a Redis that is down must not keep the job from seeing its end.
            let read = tokio::select! {
                _ = stop.cancelled() => return,
                r = tokio::time::timeout(FOLLOW_EVERY, batch_consumer::handed_from(&self.client, list)) => r,
            };
            let from = match read {
                Ok(Ok(Some(from))) => from,
                Ok(Ok(None)) | Err(_) => continue,
                Ok(Err(e)) => {
                    tracing::debug!(list, error = %e, "could not read where results were handed on from");
                    continue;
                }
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

    /// Where results of requests that name `named` (pool, list) may wait unwritten: the lists
    /// the dispatcher may use other than those first, since results only move from those to
    /// the ones the requests name.
    pub(super) fn lists_to_search(&self, named: &[(&str, &str)]) -> Result<Vec<String>, ExecError> {
        let mut lists: Vec<String> = Vec::new();
        for (pool, list) in named {
            let mut others: Vec<String> = self
                .dispatcher_lists
                .lock()
                .expect("dispatcher lists lock")
                .get(*pool)
                .map(|l| l.iter().cloned().collect())
                .unwrap_or_default();
            others.push(
                self.names
                    .seed_result_queue_name(pool)
                    .map_err(name_error)?,
            );
            for other in others {
                if other != *list && !lists.contains(&other) {
                    lists.push(other);
                }
            }
        }
        for (_, list) in named {
            if !lists.iter().any(|l| l == list) {
                lists.push((*list).to_owned());
            }
        }
        Ok(lists)
    }

    /// Stops every reader and lets go of every lease.
    pub(super) async fn shutdown(&self) {
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
    }

    /// The counters of this process's own list of each pool.
    pub(super) async fn own_stats(&self) -> BTreeMap<String, Arc<ConsumerStats>> {
        let own = self.own.lock().await.clone();
        let consumers = self.consumers.lock().await;
        own.into_iter()
            .filter_map(|(pool, list)| Some((pool, consumers.get(&list)?.stats().clone())))
            .collect()
    }
}
