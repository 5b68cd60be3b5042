#![doc = include_str!("../README.md")]

mod async_mode;
mod dir;
mod dispatch;
mod dry_run;
mod job;
mod metrics;
mod registry;
mod stop;
mod sync_mode;

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use batch_config::{DispatchMode, ProcessorConfig};
use batch_wire::{error_codes, Batch, BatchStatus, Outcome};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use async_mode::{AsyncError, AsyncMode};
pub use dir::{LOCK_FILE, MANIFEST_FILE};
pub use dispatch::Dispatch;
pub use dry_run::DryRun;
pub use job::{
    restore_checkpoint, Checkpoint, End, Job, JobFailure, JobProgress, JobSpec, Prepared,
};
pub use stop::Stop;
pub use sync_mode::{SyncError, SyncMode};

/// How long a job that expired or was cancelled waits for Redis to withdraw its requests; past
/// it, cancel markers and the dispatcher's own expiry cover what is left.
const WITHDRAW_PATIENCE: std::time::Duration = std::time::Duration::from_secs(15);

/// The message of `batch_cancelled` lines.
pub const CANCELLED_MESSAGE: &str = "The batch was cancelled before this request completed.";

/// Why a job could not be run.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// A file could not be read or written.
    ///
    /// The I/O error is part of the message, not a `source()`, so a printed chain shows it once.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        error: std::io::Error,
    },
    /// Planning failed for a reason other than an invalid input.
    #[error(transparent)]
    Plan(#[from] batch_plan::PlanError),
    /// The result files failed.
    #[error(transparent)]
    Sink(#[from] batch_sink::SinkError),
    /// The sync mode failed.
    #[error(transparent)]
    Sync(#[from] SyncError),
    /// The async mode failed.
    #[error(transparent)]
    Async(#[from] AsyncError),
    /// The configuration cannot be used.
    #[error("config: {0}")]
    Config(String),
    /// A task running blocking work (preparing a job, file work) panicked: a bug, not the input
    /// or the configuration. Says what the task was doing and the panic.
    #[error("a task panicked: {0}")]
    Panicked(String),
    /// The output directory holds another job.
    #[error("{dir} holds job {found}, not {wanted}; use another output directory")]
    OtherJob {
        /// The directory.
        dir: PathBuf,
        /// The job found there.
        found: String,
        /// The job asked for.
        wanted: String,
    },
    /// Another process (or another job of this one) writes the directory.
    #[error("{dir} is in use by another run of its job ({holder}); wait for it to end, or use another output directory")]
    Locked {
        /// The directory.
        dir: PathBuf,
        /// Who holds it, as its lock file says.
        holder: String,
    },
    /// The input changed since the job started: its old results would be mapped onto new lines.
    #[error("{input} changed since the job in {dir} started ({was} bytes then, {now} now); its results belong to the old file: restore it, or use another output directory")]
    InputChanged {
        /// The job directory.
        dir: PathBuf,
        /// The input file.
        input: PathBuf,
        /// Its size at the first run.
        was: u64,
        /// Its size now.
        now: u64,
    },
    /// The job directory holds no job.
    #[error("{0} holds no job (no batch.json)")]
    NoJob(PathBuf),
}

impl ExecError {
    pub(crate) fn io(path: &Path, error: std::io::Error) -> Self {
        Self::Io {
            path: path.to_owned(),
            error,
        }
    }

    /// The job's stop fired while Redis was out: nothing failed.
    pub fn is_stopped(&self) -> bool {
        match self {
            Self::Async(e) => e.is_stopped(),
            _ => false,
        }
    }

    /// Whether waiting could cure it, by the type of its cause: a Redis outage, or a result
    /// list another process still reads.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Async(e) => e.is_transient(),
            _ => false,
        }
    }
}

/// Runs jobs with one configuration; one per process is the intended use (the sync mode's
/// global limit and the async mode's result consumers are shared by all its jobs).
pub struct Executor {
    config: Arc<ProcessorConfig>,
    dispatch: Box<dyn Dispatch>,
    pause: CancellationToken,
}

impl Executor {
    /// An executor for `config`; in async mode it connects to Redis first (bounded retries).
    pub async fn new(config: ProcessorConfig) -> Result<Self, ExecError> {
        Self::with_redis_options(config, batch_redis::ConnectOptions::default()).await
    }

    /// Like [`Executor::new`] with explicit Redis connection options; their `tls`, when `None`,
    /// comes from the config's `redis_tls`.
    pub async fn with_redis_options(
        config: ProcessorConfig,
        connect: batch_redis::ConnectOptions,
    ) -> Result<Self, ExecError> {
        let config = Arc::new(config);
        // The one place a mode is registered: its config name to the mode built for it.
        let dispatch: Box<dyn Dispatch> = match config.dispatch_mode {
            DispatchMode::Sync => Box::new(SyncMode::new(config.clone())?),
            DispatchMode::Async => Box::new(AsyncMode::new(config.clone(), connect).await?),
            DispatchMode::DryRun => Box::new(DryRun),
        };
        Ok(Self::with_dispatch(config, dispatch))
    }

    /// An executor whose jobs go through `dispatch`, a mode built by the caller; the config's
    /// `dispatch_mode` is not looked at.
    pub fn with_dispatch(config: Arc<ProcessorConfig>, dispatch: Box<dyn Dispatch>) -> Self {
        metrics::know_models(config.model_gateways.keys());
        Self {
            config,
            dispatch,
            pause: CancellationToken::new(),
        }
    }

    /// The mode jobs go through, as its own type, for what only that mode has (the sync mode's
    /// endpoint limits, the async mode's consumer counters); `None` when it is another mode.
    ///
    /// ```no_run
    /// # fn demo(executor: &batch_executor::Executor) {
    /// if let Some(sync) = executor.mode::<batch_executor::SyncMode>() {
    ///     println!("llama-3 may have {:?} calls in flight", sync.endpoint_limit("llama-3"));
    /// }
    /// # }
    /// ```
    pub fn mode<M: Dispatch>(&self) -> Option<&M> {
        let any: &dyn Any = &*self.dispatch;
        any.downcast_ref::<M>()
    }

    /// The configuration.
    pub fn config(&self) -> &ProcessorConfig {
        &self.config
    }

    /// Stops every running job so that it can be resumed (SIGTERM): requests stay queued,
    /// results wait in their lists, `batch.json` keeps its status. Their runs return soon.
    pub fn pause(&self) {
        self.pause.cancel();
    }

    /// The token [`Executor::pause`] fires, for a signal handler to hold.
    pub fn pause_token(&self) -> CancellationToken {
        self.pause.clone()
    }

    /// Creates or resumes the job of `spec`, locks its directory and validates its input.
    pub async fn prepare(&self, spec: &JobSpec) -> Result<Prepared, ExecError> {
        let endpoint = match spec.endpoint.as_deref() {
            None => None,
            Some(e) => Some(
                batch_wire::ALLOWED_URLS
                    .into_iter()
                    .find(|u| *u == e)
                    .ok_or_else(|| {
                        ExecError::Config(format!(
                            "the endpoint {e} is not one of {}",
                            batch_wire::ALLOWED_URLS.join(", ")
                        ))
                    })?,
            ),
        };
        let mut limits = batch_plan::Limits {
            max_requests: self.config.input.max_requests,
            max_file_bytes: self.config.input.max_file_bytes,
            endpoint,
            dispatcher: false,
        };
        self.dispatch.check_input(&mut limits);
        let (spec, work_dir) = (spec.clone(), self.config.work_dir.clone());
        let prepared = tokio::task::spawn_blocking(move || Job::prepare(&spec, &work_dir, limits))
            .await
            .map_err(|e| ExecError::Panicked(format!("preparing the job: {e}")))??;
        if let Prepared::Ready(job) = &prepared {
            self.dispatch.register(job);
        }
        Ok(prepared)
    }

    /// Cancels a job that is not running (`processor cancel`): withdraws its pending requests,
    /// gives every line without a result `batch_cancelled`, and ends it `cancelled`.
    pub async fn cancel_stopped(&self, dir: &Path) -> Result<Batch, ExecError> {
        let manifest = dir::JobDir::manifest_at(dir)?;
        let batch = dir::JobDir::batch_at(dir)?.ok_or_else(|| ExecError::NoJob(dir.to_owned()))?;
        if batch.status.is_terminal() {
            return Ok(batch);
        }
        let input = manifest
            .map(|m| m.input.path)
            .unwrap_or_else(|| PathBuf::from(&batch.input_file_id));
        let mut spec = JobSpec::new(input, dir);
        spec.job_id = Some(batch.id.clone());
        let cancel = CancellationToken::new();
        cancel.cancel();
        match self.prepare(&spec).await? {
            Prepared::Finished(batch) => Ok(*batch),
            Prepared::Ready(job) => self.execute(job, cancel).await,
        }
    }

    /// Prepares and runs one job to its end.
    pub async fn run(&self, spec: JobSpec, cancel: CancellationToken) -> Result<Batch, ExecError> {
        match self.prepare(&spec).await? {
            Prepared::Finished(batch) => Ok(*batch),
            Prepared::Ready(job) => self.execute(job, cancel).await,
        }
    }

    /// Prepares every job first (so results of resumed jobs find them), then runs them side by
    /// side. One result per spec, in order.
    pub async fn run_all(
        &self,
        specs: &[JobSpec],
        cancel: CancellationToken,
    ) -> Vec<Result<Batch, ExecError>> {
        let mut prepared = Vec::with_capacity(specs.len());
        for spec in specs {
            prepared.push(self.prepare(spec).await);
        }
        let runs = prepared.into_iter().map(|p| {
            let cancel = cancel.clone();
            async move {
                match p? {
                    Prepared::Finished(batch) => Ok(*batch),
                    Prepared::Ready(job) => self.execute(job, cancel).await,
                }
            }
        });
        futures::future::join_all(runs).await
    }

    /// Dispatches a prepared job and finishes it. A paused run returns the job as it stands,
    /// not terminal, to be resumed.
    pub async fn execute(
        &self,
        job: Arc<Job>,
        cancel: CancellationToken,
    ) -> Result<Batch, ExecError> {
        self.execute_until(job, cancel, self.pause.child_token())
            .await
    }

    /// Like [`Executor::execute`], also paused by `pause` alone (a service that lost a job's
    /// lease stops it without stopping the others). Make it with [`Executor::job_pause`] so that
    /// [`Executor::pause`] stops it too.
    pub async fn execute_until(
        &self,
        job: Arc<Job>,
        cancel: CancellationToken,
        pause: CancellationToken,
    ) -> Result<Batch, ExecError> {
        // However the run ends (or is dropped), the job's requests leave the in-flight gauge.
        let _settle = SettleInflight(&job);
        self.resolve_unknown_models(&job).await?;
        let end = if job.status() == BatchStatus::Cancelling || cancel.is_cancelled() {
            End::Cancelled
        } else if pause.is_cancelled() || job.yielded() {
            End::Paused
        } else {
            self.dispatch.register(&job);
            let stop = Stop::new(
                job.expires_at(),
                cancel,
                pause.clone(),
                job.yielding.clone(),
                self.dispatch.drains(),
            );
            self.dispatch.run(&job, &stop).await
        };
        let result = self.finish(&job, end, &pause).await;
        self.dispatch.unregister(&job);
        result
    }

    /// A pause token for one job: fired by [`Executor::pause`] as well.
    pub fn job_pause(&self) -> CancellationToken {
        self.pause.child_token()
    }

    async fn resolve_unknown_models(&self, job: &Arc<Job>) -> Result<(), ExecError> {
        let unknown: Vec<_> = job
            .plan
            .models()
            .iter()
            .filter(|m| !self.config.model_gateways.contains_key(&m.model))
            .cloned()
            .collect();
        if unknown.is_empty() {
            return Ok(());
        }
        let job = job.clone();
        blocking(move || {
            for model in &unknown {
                let message = format!(
                    "The model `{}` is not served by this processor.",
                    model.model
                );
                let records = job.unresolved_records(model)?;
                let mut sink = job.sink.lock().expect("sink lock");
                let mut tally = metrics::Tally::default();
                for record in records {
                    let outcome = Outcome::Failed {
                        code: error_codes::MODEL_NOT_FOUND,
                        message: &message,
                    };
                    job.record_unflushed(&mut sink, record.line as u64, &outcome, &mut tally)?;
                }
                sink.flush()?;
                let counts = sink.counts();
                drop(sink);
                job.emit(tally, false);
                job.publish(counts);
            }
            Ok(())
        })
        .await
    }

    async fn finish(
        &self,
        job: &Arc<Job>,
        end: End,
        pause: &CancellationToken,
    ) -> Result<Batch, ExecError> {
        if let End::Paused = end {
            return pause_job(job).await;
        }
        let (status, reason, code, message) = closing_terms(job, &end);
        match &end {
            End::Completed => {
                set_status(job, BatchStatus::Finalizing).await?;
            }
            End::Cancelled => {
                set_status(job, BatchStatus::Cancelling).await?;
            }
            _ => {}
        }
        if !matches!(end, End::Completed) {
            self.withdraw_pending(job, pause).await;
            if pause.is_cancelled() && matches!(end, End::Cancelled) {
                // Stopped half way through a cancel: the next run finishes it.
                return Ok(job.batch.lock().expect("batch lock").clone());
            }
            let (j, c, msg) = (job.clone(), code, message.clone());
            let resolved = blocking(move || j.resolve_all(c, &msg)).await?;
            tracing::info!(job = %job.id, resolved, code, "unresolved requests closed");
        }
        record_end(job, status, reason).await
    }

    /// Takes the job's requests still waiting out of the mode's hands, as far as it can.
    async fn withdraw_pending(&self, job: &Arc<Job>, pause: &CancellationToken) {
        // Withdrawing needs Redis; it stops for a pause, and gives up after WITHDRAW_PATIENCE
        // (the dispatcher drops expired requests, and cancel markers cover the rest).
        let give_up = pause.child_token();
        let timer = {
            let give_up = give_up.clone();
            tokio::spawn(async move {
                tokio::time::sleep(WITHDRAW_PATIENCE).await;
                give_up.cancel();
            })
        };
        if let Err(e) = self.dispatch.withdraw(job, &give_up).await {
            tracing::error!(job = %job.id, error = %e, "could not withdraw pending requests; their results will be ignored");
        }
        timer.abort();
    }

    /// Stops the mode's background work (the async mode's result consumers, which release
    /// their result lists).
    pub async fn shutdown(&self) {
        self.dispatch.shutdown().await;
    }
}

/// Runs blocking file work off the async runtime's threads.
pub(crate) async fn blocking<T, F>(f: F) -> Result<T, ExecError>
where
    F: FnOnce() -> Result<T, ExecError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ExecError::Panicked(format!("file work: {e}")))?
}

/// Leaves a paused job's files as they are on disk, to be resumed by the next run.
async fn pause_job(job: &Arc<Job>) -> Result<Batch, ExecError> {
    let j = job.clone();
    blocking(move || j.sync_files()).await?;
    let batch = job.batch.lock().expect("batch lock").clone();
    tracing::info!(job = %job.id, status = batch.status.as_str(), "job paused; run it again to resume");
    Ok(batch)
}

/// How a job that ended with `end` closes: its final status, the reason its metric gives,
/// and the error code and message its unresolved requests get (a failure is also noted in
/// the job's errors).
fn closing_terms(job: &Job, end: &End) -> (BatchStatus, &'static str, &'static str, String) {
    match end {
        End::Completed => (BatchStatus::Completed, "", "", String::new()),
        End::Expired => (
            BatchStatus::Expired,
            "deadline",
            error_codes::BATCH_EXPIRED,
            error_codes::BATCH_EXPIRED_MESSAGE.to_owned(),
        ),
        End::Cancelled => (
            BatchStatus::Cancelled,
            "cancelled",
            error_codes::BATCH_CANCELLED,
            CANCELLED_MESSAGE.to_owned(),
        ),
        End::Failed(e) => {
            tracing::error!(job = %job.id, error = %e, "job failed");
            job.add_error("system_error", &e.to_string());
            (
                BatchStatus::Failed,
                "system_error",
                error_codes::BATCH_FAILED,
                format!("The batch failed before this request completed: {e}"),
            )
        }
        End::Paused => unreachable!("a paused job is not closed"),
    }
}

/// Syncs the job's files and writes its final status.
async fn record_end(
    job: &Arc<Job>,
    status: BatchStatus,
    reason: &'static str,
) -> Result<Batch, ExecError> {
    let j = job.clone();
    blocking(move || j.sync_files()).await?;
    let batch = set_status(job, status).await?;
    metrics::job_processed(status, reason, Some(job.started.elapsed().as_secs_f64()));
    tracing::info!(
        job = %job.id,
        status = status.as_str(),
        total = batch.request_counts.total,
        completed = batch.request_counts.completed,
        failed = batch.request_counts.failed,
        "job finished"
    );
    Ok(batch)
}

async fn set_status(job: &Arc<Job>, status: BatchStatus) -> Result<Batch, ExecError> {
    let j = job.clone();
    blocking(move || j.set_status(status)).await
}

/// Waits until every line has a result (completed) or `stop` fires (its end).
pub(crate) async fn wait_for_end(
    progress: &mut watch::Receiver<JobProgress>,
    stop: &Stop,
) -> Option<End> {
    loop {
        if progress.borrow_and_update().remaining() == 0 {
            return Some(End::Completed);
        }
        tokio::select! {
            changed = progress.changed() => if changed.is_err() { return None },
            _ = stop.halt().cancelled() => return stop.end(),
        }
    }
}

/// Takes a job's requests out of `model_inflight_requests` when its run ends.
struct SettleInflight<'a>(&'a Job);

impl Drop for SettleInflight<'_> {
    fn drop(&mut self) {
        self.0.inflight.settle();
    }
}
