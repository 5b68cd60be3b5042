//! Runs the service's jobs: takes queued batches by deadline, up to `max_active_jobs` at once,
//! through the executor; publishes their progress; uploads their result files at the end.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use batch_executor::{Executor, JobSpec, Prepared};
use batch_jobs::{now_unix, Store, StoreError, StoredBatch};
use batch_storage::{Storage, StorageError};
use batch_wire::{Batch, BatchError, BatchErrors, BatchStatus};
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::finalize;

/// How often a running job's record is refreshed and its cancel marker looked at.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(500);
/// How often an idle runner looks at the queue (a batch created here wakes it at once).
const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// A job this replica runs now.
struct Active {
    dir: PathBuf,
}

/// The part of the service that runs jobs.
pub(crate) struct Runner {
    pub(crate) store: Store,
    pub(crate) storage: Storage,
    pub(crate) executor: Arc<Executor>,
    pub(crate) replica: String,
    pub(crate) work_dir: PathBuf,
    slots: Arc<Semaphore>,
    pub(crate) wake: Notify,
    /// Fired on shutdown: stop taking jobs (the executor's pause stops the running ones).
    pub(crate) stop: CancellationToken,
    active: Mutex<HashMap<String, Active>>,
    pub(crate) tasks: TaskTracker,
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
}

impl Runner {
    pub(crate) fn new(
        store: Store,
        storage: Storage,
        executor: Arc<Executor>,
        replica: String,
        work_dir: PathBuf,
        max_active_jobs: usize,
    ) -> Arc<Self> {
        Arc::new(Self {
            store,
            storage,
            executor,
            replica,
            work_dir,
            slots: Arc::new(Semaphore::new(max_active_jobs)),
            wake: Notify::new(),
            stop: CancellationToken::new(),
            active: Mutex::new(HashMap::new()),
            tasks: TaskTracker::new(),
        })
    }

    fn job_dir(&self, id: &str) -> PathBuf {
        self.work_dir.join("serve").join(id)
    }

    /// Where the running job `id` writes `file` (`output.jsonl`, `error.jsonl`), when it runs here.
    pub(crate) fn local_file(&self, id: &str, file: &str) -> Option<PathBuf> {
        let active = self.active.lock().expect("active lock");
        active.get(id).map(|a| a.dir.join("out").join(file))
    }

    /// How many jobs run here now.
    pub(crate) fn active_jobs(&self) -> usize {
        self.active.lock().expect("active lock").len()
    }

    /// Resumes this replica's jobs, then takes queued ones as slots free, until stopped.
    pub(crate) async fn run(self: Arc<Self>) {
        let resumed = self
            .retry("listing this replica's jobs", || {
                self.store.running_on(&self.replica)
            })
            .await
            .unwrap_or_default();
        if !resumed.is_empty() {
            tracing::info!(
                jobs = resumed.len(),
                "resuming the jobs this replica was running"
            );
        }
        for id in resumed {
            let Some(permit) = self.slot().await else {
                return;
            };
            self.spawn_job(id, Some(permit));
        }
        let cancels = {
            let me = self.clone();
            tokio::spawn(async move { me.take_cancelled().await })
        };
        loop {
            let Some(permit) = self.slot().await else {
                break;
            };
            match self.store.claim_queued(&self.replica).await {
                Ok(Some(id)) => {
                    self.spawn_job(id, Some(permit));
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
        let _ = cancels.await;
    }

    /// Jobs cancelled while queued need no slot: they only close their lines.
    async fn take_cancelled(self: Arc<Self>) {
        loop {
            match self.store.claim_cancelled(&self.replica).await {
                Ok(Some(id)) => {
                    self.spawn_job(id, None);
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

    async fn slot(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        tokio::select! {
            _ = self.stop.cancelled() => None,
            permit = self.slots.clone().acquire_owned() => permit.ok(),
        }
    }

    fn spawn_job(self: &Arc<Self>, id: String, permit: Option<tokio::sync::OwnedSemaphorePermit>) {
        let me = self.clone();
        self.tasks.spawn(async move {
            let _permit = permit;
            me.active.lock().expect("active lock").insert(
                id.clone(),
                Active {
                    dir: me.job_dir(&id),
                },
            );
            match me.run_job(&id).await {
                Ok(()) | Err(RunError::Stopped) => {}
                Err(e) => tracing::error!(job = %id, error = %e, "job bookkeeping failed; it resumes at the next start"),
            }
            me.active.lock().expect("active lock").remove(&id);
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

    async fn run_job(self: &Arc<Self>, id: &str) -> Result<(), RunError> {
        let Some(mut record) = self
            .retry("reading a batch", || self.store.batch(id))
            .await?
        else {
            tracing::warn!(job = %id, "a claimed batch has no record; dropping it");
            return self.release(id).await;
        };
        if record.batch.status().is_terminal() {
            return self.release(id).await;
        }
        let dir = self.job_dir(id);
        let input = dir.join("input.jsonl");
        if !input.exists() {
            let key = batch_jobs::storage_key(&record.batch.batch.input_file_id);
            match self.storage.download(&key, &input).await {
                Ok(_) => {}
                Err(StorageError::NotFound(_)) => {
                    let message = format!(
                        "The input file {} was deleted before the batch started.",
                        record.batch.batch.input_file_id
                    );
                    return self
                        .fail_unstarted(&mut record, "invalid_file", &message)
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
            headers: Default::default(),
            created_at: Some(record.batch.batch.created_at),
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
            Err(e) => {
                let message = format!("The batch could not be started: {e}");
                return self
                    .fail_unstarted(&mut record, "batch_failed", &message)
                    .await;
            }
        };
        let batch = match prepared {
            Prepared::Finished(batch) => *batch,
            Prepared::Ready(job) => {
                let (done, watcher) = self.watch_progress(&job, record.clone(), cancel.clone());
                let result = self.executor.execute(job, cancel.clone()).await;
                // Its last save must land before the final one.
                done.cancel();
                let _ = watcher.await;
                match result {
                    Ok(batch) => batch,
                    Err(e) => {
                        let message = format!("The batch failed: {e}");
                        return self
                            .fail_unstarted(&mut record, "batch_failed", &message)
                            .await;
                    }
                }
            }
        };
        if !batch.status.is_terminal() {
            // Paused by a shutdown: the next start resumes it.
            merge(&mut record, &batch);
            self.retry("saving a batch", || self.store.save_batch(&record))
                .await?;
            return Ok(());
        }
        finalize::finish(self, &mut record, &batch, &dir).await?;
        self.release(id).await?;
        self.forget_local(id, &dir).await;
        Ok(())
    }

    async fn release(&self, id: &str) -> Result<(), RunError> {
        self.retry("releasing a job", || self.store.release(id))
            .await
    }

    async fn forget_local(&self, id: &str, dir: &Path) {
        for d in [dir.to_path_buf(), self.work_dir.join(id)] {
            if let Err(e) = tokio::fs::remove_dir_all(&d).await {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(job = %id, dir = %d.display(), error = %e, "could not remove a finished job's files");
                }
            }
        }
    }

    /// Ends a batch that never reached the executor (its input is gone, its files cannot be
    /// set up) as `failed`.
    async fn fail_unstarted(
        &self,
        record: &mut StoredBatch,
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
        self.retry("saving a batch", || self.store.save_batch(record))
            .await?;
        let id = record.batch.batch.id.clone();
        self.release(&id).await?;
        self.forget_local(&id, &self.job_dir(&id)).await;
        Ok(())
    }

    /// Publishes a running job's counts in its record, and turns a cancel request into the
    /// job's cancel; stops when the returned token fires.
    fn watch_progress(
        self: &Arc<Self>,
        job: &Arc<batch_executor::Job>,
        mut record: StoredBatch,
        cancel: CancellationToken,
    ) -> (CancellationToken, tokio::task::JoinHandle<()>) {
        let done = CancellationToken::new();
        let mut progress = job.progress();
        let (me, id, until) = (self.clone(), job.id().to_owned(), done.clone());
        let task = tokio::spawn(async move {
            let mut last = None;
            loop {
                let now = progress.borrow_and_update().clone();
                if last.as_ref() != Some(&now) {
                    let b = &mut record.batch.batch;
                    b.request_counts = now.counts;
                    // A terminal status shows once the result files are up, not before.
                    if !now.status.is_terminal() && b.status != now.status {
                        b.set_status(now.status, now_unix());
                    }
                    record.batch.running_counts();
                    if let Err(e) = me.store.save_batch(&record).await {
                        tracing::debug!(job = %id, error = %e, "could not publish progress");
                    } else {
                        last = Some(now);
                    }
                }
                if !cancel.is_cancelled()
                    && matches!(me.store.cancel_requested(&id).await, Ok(true))
                {
                    tracing::info!(job = %id, "cancel requested");
                    cancel.cancel();
                }
                tokio::select! {
                    _ = until.cancelled() => return,
                    _ = tokio::time::sleep(PROGRESS_INTERVAL) => {}
                }
            }
        });
        (done, task)
    }
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
