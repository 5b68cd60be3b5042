//! Runs the service's jobs: takes queued batches by deadline while it has a free slot (up to
//! `max_active_jobs`), each under a lease renewed by a heartbeat; takes over the jobs of
//! replicas whose leases lapsed; checkpoints running jobs to storage; uploads their result files
//! at the end. Every write for a job is fenced by its lease epoch.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use batch_executor::{Executor, JobSpec, Prepared};
use batch_state::{layout, now_unix, JobLease, Store, StoreError, StoredBatch};
use batch_storage::{Storage, StorageError};
use batch_wire::{Batch, BatchError, BatchErrors, BatchStatus};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::finalize;
use crate::recover::StateGuard;

/// How often a running job's record is refreshed and its cancel marker looked at.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(500);
/// How often an idle runner looks at the queue (a batch created here wakes it at once).
const POLL_INTERVAL: Duration = Duration::from_secs(1);
/// The file in a job's local directory naming the lease epoch it was last run under.
const EPOCH_FILE: &str = "epoch";

/// How the runner is set up.
#[derive(Debug, Clone)]
pub(crate) struct RunnerConfig {
    pub replica: String,
    pub work_dir: PathBuf,
    pub max_active_jobs: usize,
    pub lease_ttl: Duration,
    pub checkpoint_interval: Duration,
    /// `serve.tenant_max_running_batches`: a tenant running this many jobs yields a free slot
    /// to another tenant's queued batch.
    pub tenant_share: usize,
}

/// A job this replica runs now.
struct Active {
    dir: PathBuf,
    lease: JobLease,
    /// Fired when the lease is lost: the job stops writing at once.
    fenced: CancellationToken,
    /// How many losses of Redis's state were noticed when it started here.
    losses: u64,
}

/// The part of the service that runs jobs.
pub(crate) struct Runner {
    pub(crate) store: Store,
    pub(crate) storage: Storage,
    pub(crate) executor: Arc<Executor>,
    pub(crate) config: RunnerConfig,
    slots: Arc<Semaphore>,
    pub(crate) wake: Notify,
    /// Fired on shutdown: stop taking jobs (the executor's pause stops the running ones).
    pub(crate) stop: CancellationToken,
    active: Mutex<HashMap<String, Active>>,
    /// Held while this replica looks for jobs to take over and adopts one: the take-over task
    /// and a freed slot look at once, and the adoption script lets a replica take again a job
    /// it holds itself, so two unguarded looks adopted one job twice.
    adopting: tokio::sync::Mutex<()>,
    pub(crate) tasks: TaskTracker,
    /// Whether Redis lost the service's state.
    state: Arc<StateGuard>,
}

/// What went wrong with one job's bookkeeping (the job itself fails through the executor).
#[derive(Debug, thiserror::Error)]
pub(crate) enum RunError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error("{0}")]
    Other(String),
    #[error("stopped")]
    Stopped,
    /// Another replica holds the job now.
    #[error("the job's lease was lost to another replica")]
    Fenced,
}

/// Where a job's latest checkpoint is, as recorded (fenced) in Redis.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct CheckpointRecord {
    epoch: u64,
    at: i64,
    output_key: String,
    error_key: String,
    output_len: u64,
    error_len: u64,
    batch: String,
    manifest: String,
}

impl Runner {
    pub(crate) fn new(
        state: Arc<StateGuard>,
        store: Store,
        storage: Storage,
        executor: Arc<Executor>,
        config: RunnerConfig,
    ) -> Arc<Self> {
        Arc::new(Self {
            store,
            storage,
            executor,
            slots: Arc::new(Semaphore::new(config.max_active_jobs)),
            config,
            wake: Notify::new(),
            stop: CancellationToken::new(),
            active: Mutex::new(HashMap::new()),
            adopting: tokio::sync::Mutex::new(()),
            tasks: TaskTracker::new(),
            state,
        })
    }

    fn job_dir(&self, id: &str) -> PathBuf {
        self.config.work_dir.join("serve").join(id)
    }

    /// Where the running job `id` writes `file` (`output.jsonl`, `error.jsonl`), when it runs here.
    pub(crate) fn local_file(&self, id: &str, file: &str) -> Option<PathBuf> {
        let active = self.active.lock().expect("active lock");
        active.get(id).map(|a| a.dir.join("out").join(file))
    }

    /// The storage key of `file` in job `id`'s latest checkpoint, if it has one.
    pub(crate) async fn checkpointed_file(
        &self,
        id: &str,
        file: &str,
    ) -> Result<Option<String>, batch_state::StoreError> {
        let Some(json) = self.store.checkpoint(id).await? else {
            return Ok(None);
        };
        let Ok(record) = serde_json::from_str::<CheckpointRecord>(&json) else {
            return Ok(None);
        };
        Ok(match file {
            batch_sink::OUTPUT_FILE => Some(record.output_key),
            batch_sink::ERROR_FILE => Some(record.error_key),
            _ => None,
        })
    }

    /// How many jobs run here now.
    pub(crate) fn active_jobs(&self) -> usize {
        self.active.lock().expect("active lock").len()
    }

    /// Resumes this replica's jobs, then takes queued ones and orphaned ones as slots free,
    /// until stopped.
    pub(crate) async fn run(self: Arc<Self>) {
        let me = &self.config.replica;
        let mine: Vec<String> = self
            .retry("listing this replica's jobs", || self.store.running())
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|(_, r)| r == me)
            .map(|(id, _)| id)
            .collect();
        if !mine.is_empty() {
            tracing::info!(
                jobs = mine.len(),
                "resuming the jobs this replica was running"
            );
        }
        for id in mine {
            let Some(permit) = self.slot().await else {
                return;
            };
            match self.store.adopt(&id, me, self.config.lease_ttl).await {
                Ok(Some(lease)) => self.spawn_job(lease, Some(permit), true),
                Ok(None) => {}
                Err(e) => tracing::warn!(job = %id, error = %e, "could not resume a job"),
            }
        }
        let side = [
            tokio::spawn(self.clone().take_cancelled()),
            tokio::spawn(self.clone().heartbeat()),
            tokio::spawn(self.clone().take_over()),
        ];
        loop {
            let Some(permit) = self.slot().await else {
                break;
            };
            let Some(permit) = self.take_over_one(permit).await else {
                continue;
            };
            match self
                .store
                .claim_queued(me, self.config.lease_ttl, self.config.tenant_share)
                .await
            {
                Ok(Some(lease)) => {
                    self.spawn_job(lease, Some(permit), false);
                    continue;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "could not look at the job queue"),
            }
            drop(permit);
            tokio::select! {
                _ = self.stop.cancelled() => break,
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(POLL_INTERVAL) => {}
            }
        }
        for task in side {
            let _ = task.await;
        }
    }

    /// Jobs cancelled while queued need no slot: they only close their lines.
    async fn take_cancelled(self: Arc<Self>) {
        loop {
            match self
                .store
                .claim_cancelled(&self.config.replica, self.config.lease_ttl)
                .await
            {
                Ok(Some(lease)) => {
                    self.spawn_job(lease, None, false);
                    continue;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "could not look at the cancel queue"),
            }
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(POLL_INTERVAL) => {}
            }
        }
    }

    /// Renews the leases of the jobs running here, a third of the lease time apart; a job whose
    /// lease was lost (this process was frozen or cut off past it) stops at once.
    async fn heartbeat(self: Arc<Self>) {
        let every = self.config.lease_ttl / 3;
        loop {
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let leases: Vec<JobLease> = {
                let active = self.active.lock().expect("active lock");
                active.values().map(|a| a.lease.clone()).collect()
            };
            match self.store.renew(&leases, self.config.lease_ttl).await {
                Ok(renewal) => {
                    for lease in renewal.lost {
                        if !self.is_active(&lease) {
                            // It ended (or paused) meanwhile and let go of the lease itself.
                            continue;
                        }
                        self.log_lost(&lease).await;
                        self.fence(&lease.job);
                    }
                    for lease in renewal.regained {
                        self.regained(&lease).await;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "could not renew job leases"),
            }
        }
    }

    /// A lease that lapsed with nobody taking the job is held again: the job goes on here.
    /// A job that let go of its lease meanwhile (a shutdown) lets go of it again.
    async fn regained(&self, lease: &JobLease) {
        let active = self
            .active
            .lock()
            .expect("active lock")
            .contains_key(&lease.job);
        if active {
            log_regained(lease);
        } else if let Err(e) = self.store.release_lease(lease).await {
            tracing::warn!(job = %lease.job, error = %e, "could not let go of a lease again");
        }
    }

    /// A write for the job under `lease` was refused: true when the lease had only lapsed and
    /// is held again, so the write may be made again.
    async fn regain(&self, lease: &JobLease) -> Result<bool, RunError> {
        let held = self
            .retry("renewing a lease", || {
                self.store.hold(lease, self.config.lease_ttl)
            })
            .await?;
        if held {
            log_regained(lease);
        }
        Ok(held)
    }

    /// Makes a write that holds only under `lease` (`op` says whether it was made), once more
    /// if the lease had only lapsed; [`RunError::Fenced`] when another replica holds the job.
    async fn fenced<F, Fut>(&self, what: &str, lease: &JobLease, mut op: F) -> Result<(), RunError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool, StoreError>>,
    {
        if self.retry(what, &mut op).await? {
            return Ok(());
        }
        if self.regain(lease).await? && self.retry(what, &mut op).await? {
            return Ok(());
        }
        Err(RunError::Fenced)
    }

    /// Says why a lease was lost: Redis lost the whole state (then the job is put back from
    /// storage and resumed), or another replica took the job.
    async fn log_lost(&self, lease: &JobLease) {
        let started = self
            .active
            .lock()
            .expect("active lock")
            .get(&lease.job)
            .map_or(0, |a| a.losses);
        let state_lost =
            matches!(self.state.check().await, Ok(true)) || self.state.losses() > started;
        if state_lost {
            tracing::warn!(job = %lease.job, epoch = lease.epoch, "the job's lease went with the state Redis lost; stopping it here: it resumes from its checkpoint once the state is rebuilt from storage");
        } else {
            tracing::warn!(job = %lease.job, epoch = lease.epoch, "lost the job's lease to another replica; stopping it here");
        }
    }

    /// Takes the job out of the active ones, unless a newer run of it (adopted here after this
    /// one was fenced, as when Redis lost the state) replaced it meanwhile.
    fn is_active(&self, lease: &JobLease) -> bool {
        let active = self.active.lock().expect("active lock");
        active
            .get(&lease.job)
            .is_some_and(|a| a.lease.epoch == lease.epoch)
    }

    fn forget_active(&self, lease: &JobLease) {
        let mut active = self.active.lock().expect("active lock");
        if active
            .get(&lease.job)
            .is_some_and(|a| a.lease.epoch == lease.epoch)
        {
            active.remove(&lease.job);
        }
    }

    fn fence(&self, id: &str) {
        if let Some(a) = self.active.lock().expect("active lock").get(id) {
            a.fenced.cancel();
        }
    }

    /// Takes over jobs whose replica stopped renewing their leases, while a slot is free.
    async fn take_over(self: Arc<Self>) {
        let every = (self.config.lease_ttl / 4).clamp(Duration::from_millis(200), POLL_INTERVAL);
        loop {
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            while let Ok(permit) = self.slots.clone().try_acquire_owned() {
                if self.take_over_one(permit).await.is_some() {
                    break;
                }
            }
        }
    }

    /// Takes over one job whose replica stopped, running it with `permit`; gives the permit
    /// back when there is none. A freed slot goes to such a job before any queued one: it
    /// started first, and its partial results wait for it.
    async fn take_over_one(
        self: &Arc<Self>,
        permit: OwnedSemaphorePermit,
    ) -> Option<OwnedSemaphorePermit> {
        // Until the adopted job is in `active`, where the next look no longer sees it.
        let _adopting = self.adopting.lock().await;
        let orphans = match self.orphans().await {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!(error = %e, "could not look for jobs to take over");
                return Some(permit);
            }
        };
        for id in orphans {
            match self
                .store
                .adopt(&id, &self.config.replica, self.config.lease_ttl)
                .await
            {
                Ok(Some(lease)) => {
                    tracing::info!(job = %id, epoch = lease.epoch, "taking over a job whose replica stopped");
                    self.spawn_job(lease, Some(permit), true);
                    return None;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(job = %id, error = %e, "could not take over a job"),
            }
        }
        Some(permit)
    }

    async fn orphans(&self) -> Result<Vec<String>, StoreError> {
        let running = self.store.running().await?;
        let here: Vec<String> = {
            let active = self.active.lock().expect("active lock");
            active.keys().cloned().collect()
        };
        let candidates: Vec<String> = running
            .into_keys()
            .filter(|id| !here.contains(id))
            .collect();
        self.store.unleased(&candidates).await
    }

    async fn slot(&self) -> Option<OwnedSemaphorePermit> {
        tokio::select! {
            _ = self.stop.cancelled() => None,
            permit = self.slots.clone().acquire_owned() => permit.ok(),
        }
    }

    fn spawn_job(
        self: &Arc<Self>,
        lease: JobLease,
        permit: Option<OwnedSemaphorePermit>,
        adopted: bool,
    ) {
        let me = self.clone();
        let fenced = self.executor.job_pause();
        let id = lease.job.clone();
        me.active.lock().expect("active lock").insert(
            id.clone(),
            Active {
                dir: me.job_dir(&id),
                lease: lease.clone(),
                fenced: fenced.clone(),
                losses: self.state.losses(),
            },
        );
        self.tasks.spawn(async move {
            let _permit = permit;
            match me.run_job(&lease, adopted, &fenced).await {
                Ok(()) | Err(RunError::Stopped) => {}
                Err(RunError::Fenced) => {
                    tracing::info!(job = %id, "stopped here: another replica runs it now")
                }
                Err(e) => tracing::error!(job = %id, error = %e, "job bookkeeping failed; it resumes at the next start"),
            }
            me.forget_active(&lease);
            // A freed slot may let a queued job start at once.
            me.wake.notify_one();
        });
    }

    /// Runs `op` until it succeeds, fails for good, or the service stops.
    pub(crate) async fn retry<T, F, Fut>(&self, what: &str, mut op: F) -> Result<T, RunError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        let mut backoff = Duration::from_millis(100);
        let mut warned = false;
        loop {
            match op().await {
                Ok(v) => return Ok(v),
                Err(e) if e.is_transient() => {
                    if !warned {
                        tracing::warn!(operation = what, error = %e, "Redis is not answering; waiting for it");
                        warned = true;
                    }
                }
                Err(e) => return Err(e.into()),
            }
            tokio::select! {
                _ = self.stop.cancelled() => return Err(RunError::Stopped),
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// Saves `record` as the holder of `lease`; [`RunError::Fenced`] when it no longer is.
    pub(crate) async fn save(
        &self,
        record: &StoredBatch,
        lease: &JobLease,
    ) -> Result<(), RunError> {
        self.fenced("saving a batch", lease, || {
            self.store.save_batch(record, Some(lease))
        })
        .await
    }

    async fn run_job(
        self: &Arc<Self>,
        lease: &JobLease,
        adopted: bool,
        fenced: &CancellationToken,
    ) -> Result<(), RunError> {
        let id = lease.job.as_str();
        let Some(mut record) = self
            .retry("reading a batch", || self.store.batch(id))
            .await?
        else {
            tracing::warn!(job = %id, "a claimed batch has no record; dropping it");
            return self
                .retry("forgetting a job", || self.store.forget_running(id))
                .await;
        };
        let dir = self.job_dir(id);
        if record.batch.status().is_terminal() {
            return self.end(lease, &dir).await;
        }
        if adopted {
            self.restore(lease, &dir).await?;
        }
        write_epoch(&dir, lease.epoch)
            .map_err(|e| RunError::Other(format!("{}: {e}", dir.display())))?;
        let input = dir.join("input.jsonl");
        if !input.exists() {
            let key = layout::upload(&record.batch.batch.input_file_id);
            match self.storage.download(&key, &input).await {
                Ok(_) => {}
                Err(StorageError::NotFound(_)) => {
                    let message = format!(
                        "The input file {} was deleted before the batch started.",
                        record.batch.batch.input_file_id
                    );
                    return self
                        .fail_unstarted(&mut record, lease, "invalid_file", &message)
                        .await;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let spec = JobSpec {
            input: input.clone(),
            output_dir: dir.join("out"),
            job_id: Some(id.to_owned()),
            completion_window: Duration::from_secs(record.window_secs),
            // The pass-through headers of its create request, on every request of the batch.
            headers: record.headers.clone(),
            created_at: Some(record.batch.batch.created_at),
            endpoint: record.batch.batch.endpoint.clone(),
        };
        let cancel = CancellationToken::new();
        if self
            .retry("reading a cancel", || self.store.cancel_requested(id))
            .await?
        {
            cancel.cancel();
        }
        let prepared = match self.executor.prepare(&spec).await {
            Ok(p) => p,
            // An earlier run of the job here (fenced when Redis lost the state) still winds
            // down: not a failure of the batch; it is taken again once that run let go.
            Err(batch_executor::ExecError::Locked { .. }) => {
                tracing::info!(job = %id, "an earlier run of the job here still winds down; taking it again later");
                self.forget_active(lease);
                return self
                    .retry("letting go of a lease", || self.store.release_lease(lease))
                    .await;
            }
            Err(e) => {
                let message = format!("The batch could not be started: {e}");
                return self
                    .fail_unstarted(&mut record, lease, "batch_failed", &message)
                    .await;
            }
        };
        let batch = match prepared {
            Prepared::Finished(batch) => *batch,
            Prepared::Ready(job) => {
                let mut models = job.models();
                if let (Some(model), None) = (models.next(), models.next()) {
                    record.batch.model = Some(model.to_owned());
                }
                let done = CancellationToken::new();
                let watcher = tokio::spawn(self.clone().watch(
                    job.clone(),
                    record.clone(),
                    lease.clone(),
                    cancel.clone(),
                    fenced.clone(),
                    done.clone(),
                ));
                let result = self
                    .executor
                    .execute_until(job.clone(), cancel.clone(), fenced.clone())
                    .await;
                // Its last save must land before the final one.
                done.cancel();
                let _ = watcher.await;
                match result {
                    Ok(batch) if !batch.status.is_terminal() => {
                        return self.paused(&job, &mut record, &batch, lease).await;
                    }
                    Ok(batch) => batch,
                    Err(e) => {
                        let message = format!("The batch failed: {e}");
                        return self
                            .fail_unstarted(&mut record, lease, "batch_failed", &message)
                            .await;
                    }
                }
            }
        };
        finalize::finish(self, &mut record, &batch, &dir, lease).await?;
        self.end(lease, &dir).await
    }

    /// A job stopped before its end: by a shutdown (its state goes to storage and its lease is
    /// let go, so another replica may go on at once) or by a lost lease (nothing more is written).
    async fn paused(
        &self,
        job: &Arc<batch_executor::Job>,
        record: &mut StoredBatch,
        batch: &Batch,
        lease: &JobLease,
    ) -> Result<(), RunError> {
        merge(record, batch);
        self.save(record, lease).await?;
        if let Err(e) = self.checkpoint(job, lease).await {
            tracing::warn!(job = %lease.job, error = %e, "no checkpoint at shutdown; the next holder redoes more");
        }
        // Out of the heartbeat's list first: a renewal racing this release must not take the
        // lease back (see `regained`).
        self.forget_active(lease);
        self.retry("letting go of a lease", || self.store.release_lease(lease))
            .await?;
        Ok(())
    }

    /// The job ended (or was found ended): it is nobody's any more; its local and checkpoint
    /// files go.
    async fn end(&self, lease: &JobLease, dir: &Path) -> Result<(), RunError> {
        let id = lease.job.as_str();
        // Out of the heartbeat's list first: the released lease is not a lost one.
        self.forget_active(lease);
        self.fenced("releasing a job", lease, || self.store.release(lease))
            .await?;
        self.retry("forgetting a checkpoint", || {
            self.store.forget_checkpoint(id)
        })
        .await?;
        if let Err(e) = self.storage.delete_prefix(&layout::checkpoints(id)).await {
            tracing::warn!(job = %id, error = %e, "could not delete a finished job's checkpoints");
        }
        for d in [dir.to_path_buf(), self.config.work_dir.join(id)] {
            if let Err(e) = tokio::fs::remove_dir_all(&d).await {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(job = %id, dir = %d.display(), error = %e, "could not remove a finished job's files");
                }
            }
        }
        Ok(())
    }

    /// Ends a batch that never reached the executor (its input is gone, its files cannot be
    /// set up) as `failed`.
    async fn fail_unstarted(
        &self,
        record: &mut StoredBatch,
        lease: &JobLease,
        code: &str,
        message: &str,
    ) -> Result<(), RunError> {
        tracing::warn!(job = %record.batch.batch.id, message, "batch failed");
        let b = &mut record.batch.batch;
        b.errors = Some(BatchErrors::new(vec![BatchError {
            code: code.to_owned(),
            message: message.to_owned(),
            param: None,
            line: None,
        }]));
        b.set_status(BatchStatus::Failed, now_unix());
        self.save(record, lease).await?;
        let dir = self.job_dir(&lease.job);
        self.end(lease, &dir).await
    }

    /// Copies a running job's result files (whole lines only) and small files to storage and
    /// records where, fenced by the lease.
    async fn checkpoint(
        &self,
        job: &Arc<batch_executor::Job>,
        lease: &JobLease,
    ) -> Result<(), RunError> {
        let cut = {
            let job = job.clone();
            tokio::task::spawn_blocking(move || job.checkpoint())
                .await
                .map_err(|e| RunError::Other(format!("checkpoint panicked: {e}")))?
                .map_err(|e| RunError::Other(e.to_string()))?
        };
        let out = job.dir();
        let output_key = layout::checkpoint(&lease.job, lease.epoch, batch_sink::OUTPUT_FILE);
        let error_key = layout::checkpoint(&lease.job, lease.epoch, batch_sink::ERROR_FILE);
        let output_len = self
            .storage
            .put_file_prefix(
                &output_key,
                &out.join(batch_sink::OUTPUT_FILE),
                cut.output_len,
            )
            .await?;
        let error_len = self
            .storage
            .put_file_prefix(&error_key, &out.join(batch_sink::ERROR_FILE), cut.error_len)
            .await?;
        let record = CheckpointRecord {
            epoch: lease.epoch,
            at: now_unix(),
            output_key,
            error_key,
            output_len,
            error_len,
            batch: String::from_utf8_lossy(&cut.batch).into_owned(),
            manifest: String::from_utf8_lossy(&cut.manifest).into_owned(),
        };
        let json = serde_json::to_string(&record).expect("a checkpoint serializes");
        self.fenced("recording a checkpoint", lease, || {
            self.store.save_checkpoint(lease, &json)
        })
        .await?;
        metrics::counter!("batch_service_checkpoints_total").increment(1);
        tracing::debug!(job = %lease.job, output_len, error_len, "checkpoint");
        Ok(())
    }

    /// Before an adopted job resumes: keeps the local directory when it is as new as the last
    /// checkpoint (this replica ran the job last), else rebuilds it from the checkpoint (another
    /// replica did, or this one lost its disk), else starts afresh.
    async fn restore(&self, lease: &JobLease, dir: &Path) -> Result<(), RunError> {
        let json = self
            .retry("reading a checkpoint", || self.store.checkpoint(&lease.job))
            .await?;
        let checkpoint: Option<CheckpointRecord> = json.and_then(|j| serde_json::from_str(&j).ok());
        let local = read_epoch(dir);
        let out = dir.join("out");
        match (&checkpoint, local) {
            (Some(c), Some(e)) if e >= c.epoch && out.exists() => return Ok(()),
            (None, Some(_)) if out.exists() => return Ok(()),
            _ => {}
        }
        if dir.exists() {
            tokio::fs::remove_dir_all(dir)
                .await
                .map_err(|e| RunError::Other(format!("{}: {e}", dir.display())))?;
        }
        let Some(c) = checkpoint else {
            tracing::info!(job = %lease.job, "no checkpoint: the job starts again from its input");
            return Ok(());
        };
        self.storage
            .download(&c.output_key, &out.join(batch_sink::OUTPUT_FILE))
            .await?;
        self.storage
            .download(&c.error_key, &out.join(batch_sink::ERROR_FILE))
            .await?;
        batch_executor::restore_checkpoint(&out, c.batch.as_bytes(), c.manifest.as_bytes())
            .map_err(|e| RunError::Other(e.to_string()))?;
        tracing::info!(job = %lease.job, from_epoch = c.epoch, output_bytes = c.output_len, error_bytes = c.error_len, "resuming from a checkpoint");
        Ok(())
    }

    /// While a job runs: publishes its counts, turns a cancel request into its cancel, and
    /// checkpoints it every `checkpoint_interval`.
    async fn watch(
        self: Arc<Self>,
        job: Arc<batch_executor::Job>,
        mut record: StoredBatch,
        lease: JobLease,
        cancel: CancellationToken,
        fenced: CancellationToken,
        done: CancellationToken,
    ) {
        let mut progress = job.progress();
        let id = job.id().to_owned();
        let mut last = None;
        let mut last_checkpoint = tokio::time::Instant::now();
        loop {
            let now = progress.borrow_and_update().clone();
            // Checkpoint before publishing `now`, so that the checkpoint (what other replicas
            // show of the job's lines) holds every line `now` counts when one is due each turn.
            if last_checkpoint.elapsed() >= self.config.checkpoint_interval {
                match self.checkpoint(&job, &lease).await {
                    Ok(()) => {}
                    Err(RunError::Fenced) => {
                        fenced.cancel();
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(job = %id, error = %e, "checkpoint failed; trying again later")
                    }
                }
                last_checkpoint = tokio::time::Instant::now();
            }
            if last.as_ref() != Some(&now) {
                let b = &mut record.batch.batch;
                b.request_counts = now.counts;
                // A terminal status shows once the result files are up, not before.
                if !now.status.is_terminal() && b.status != now.status {
                    b.set_status(now.status, now_unix());
                }
                record.batch.running_counts();
                match self.store.save_batch(&record, Some(&lease)).await {
                    Ok(true) => last = Some(now),
                    Ok(false) => match self.regain(&lease).await {
                        // Published at the next turn.
                        Ok(true) => {}
                        Ok(false) => {
                            self.log_lost(&lease).await;
                            fenced.cancel();
                            return;
                        }
                        Err(_) => return,
                    },
                    Err(e) => tracing::debug!(job = %id, error = %e, "could not publish progress"),
                }
            }
            if !cancel.is_cancelled() && matches!(self.store.cancel_requested(&id).await, Ok(true))
            {
                tracing::info!(job = %id, "cancel requested");
                cancel.cancel();
            }
            tokio::select! {
                _ = done.cancelled() => return,
                _ = tokio::time::sleep(PROGRESS_INTERVAL) => {}
            }
        }
    }
}

fn log_regained(lease: &JobLease) {
    tracing::warn!(job = %lease.job, epoch = lease.epoch, "the job's lease lapsed (this replica was frozen or cut off) but nobody took the job; holding it again");
}

fn write_epoch(dir: &Path, epoch: u64) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(EPOCH_FILE), epoch.to_string())
}

fn read_epoch(dir: &Path) -> Option<u64> {
    std::fs::read_to_string(dir.join(EPOCH_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Copies what the executor knows of a job into its record (which keeps the service's own
/// fields: the input file id, window, metadata).
pub(crate) fn merge(record: &mut StoredBatch, batch: &Batch) {
    let b = &mut record.batch.batch;
    b.status = batch.status;
    b.errors = batch.errors.clone();
    b.request_counts = batch.request_counts;
    if b.endpoint.is_none() {
        b.endpoint = batch.endpoint.clone();
    }
    b.in_progress_at = b.in_progress_at.or(batch.in_progress_at);
    b.finalizing_at = b.finalizing_at.or(batch.finalizing_at);
    b.completed_at = batch.completed_at;
    b.failed_at = batch.failed_at;
    b.expired_at = batch.expired_at;
    b.cancelling_at = b.cancelling_at.or(batch.cancelling_at);
    b.cancelled_at = batch.cancelled_at;
    record.batch.running_counts();
}
