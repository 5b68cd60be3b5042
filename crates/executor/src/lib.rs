//! Runs batch jobs from input file to result files.
//!
//! A job goes: `batch.json` written (`validating`) → the input validated and planned (an invalid
//! file fails the job with every bad line in `errors.data`) → lines of models without a gateway
//! written as `model_not_found` → every other line dispatched (`in_progress`) → `finalizing` →
//! `completed`. The SLO deadline (creation + completion window) ends it as `expired`, a cancel
//! as `cancelled`; either way every line still without a result gets `batch_expired` or
//! `batch_cancelled`, so `output.jsonl` + `error.jsonl` always hold each `custom_id` once.
//!
//! Dispatch is one of two modes, chosen by the config's `dispatch_mode`:
//! - **async**: members go into the llm-d-async dispatcher's sorted sets and results come back
//!   through one [`batch_consumer::ResultConsumer`] per pool, shared by every job of the process;
//!   on deadline or cancel the job's pending members are removed again;
//! - **sync**: the executor calls the gateways itself ([`batch_sync_dispatch::SyncDispatcher`]).
//!
//! Running a job again on the same output directory resumes it: finished lines are kept, results
//! that arrived meanwhile are written, and only lines without a result are dispatched again.
//!
//! ```no_run
//! use batch_executor::{Executor, JobSpec};
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let config = batch_config::ProcessorConfig::load("processor.yaml".as_ref())?;
//! let executor = Executor::new(config).await?;
//! let batch = executor
//!     .run(JobSpec::new("batch.jsonl", "out/"), CancellationToken::new())
//!     .await?;
//! println!("{}: {:?}", batch.id, batch.request_counts);
//! executor.shutdown().await;
//! # Ok(()) }
//! ```

mod async_mode;
mod job;
mod metrics;
mod registry;
mod sync_mode;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use batch_config::{DispatchMode, ProcessorConfig};
use batch_wire::{error_codes, Batch, BatchStatus, Outcome};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use job::{Job, JobProgress, JobSpec, Prepared};

use async_mode::AsyncMode;
use job::End;
use sync_mode::SyncMode;

/// The message of `batch_cancelled` lines.
pub const CANCELLED_MESSAGE: &str = "The batch was cancelled before this request completed.";

/// Why a job could not be run.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// Planning failed for a reason other than an invalid input.
    #[error(transparent)]
    Plan(#[from] batch_plan::PlanError),
    /// The result files failed.
    #[error(transparent)]
    Sink(#[from] batch_sink::SinkError),
    /// Redis could not be reached.
    #[error(transparent)]
    Connect(#[from] batch_redis::ConnectError),
    /// Enqueueing or removing requests failed.
    #[error(transparent)]
    Producer(#[from] batch_producer::ProducerError),
    /// A gateway could not be set up.
    #[error(transparent)]
    Gateway(#[from] batch_sync_dispatch::DispatchError),
    /// Async mode without a Redis URL.
    #[error("async mode needs the Redis URL (redis_url_file)")]
    NoRedisUrl,
    /// The configuration cannot be used.
    #[error("config: {0}")]
    Config(String),
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
}

impl ExecError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_owned(),
            source,
        }
    }
}

enum Mode {
    Sync(SyncMode),
    Async(Box<AsyncMode>),
}

/// Runs jobs with one configuration; one per process is the intended use (the sync mode's
/// global limit and the async mode's result consumers are shared by all its jobs).
pub struct Executor {
    config: Arc<ProcessorConfig>,
    mode: Mode,
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
        let mode = match config.dispatch_mode {
            DispatchMode::Sync => Mode::Sync(SyncMode::new(config.clone())?),
            DispatchMode::Async => {
                Mode::Async(Box::new(AsyncMode::new(config.clone(), connect).await?))
            }
        };
        Ok(Self { config, mode })
    }

    /// The configuration.
    pub fn config(&self) -> &ProcessorConfig {
        &self.config
    }

    /// Creates or resumes the job of `spec` and validates its input (blocking file I/O).
    pub fn prepare(&self, spec: &JobSpec) -> Result<Prepared, ExecError> {
        let limits = batch_plan::Limits {
            max_requests: self.config.input.max_requests,
            max_file_bytes: self.config.input.max_file_bytes,
        };
        let prepared = Job::prepare(spec, &self.config.work_dir, limits)?;
        if let (Prepared::Ready(job), Mode::Async(mode)) = (&prepared, &self.mode) {
            mode.register(job);
        }
        Ok(prepared)
    }

    /// Prepares and runs one job to its end.
    pub async fn run(&self, spec: JobSpec, cancel: CancellationToken) -> Result<Batch, ExecError> {
        match self.prepare(&spec)? {
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
        let prepared: Vec<_> = specs.iter().map(|s| self.prepare(s)).collect();
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

    /// Dispatches a prepared job and finishes it.
    pub async fn execute(
        &self,
        job: Arc<Job>,
        cancel: CancellationToken,
    ) -> Result<Batch, ExecError> {
        self.resolve_unknown_models(&job)?;
        let end = if job.status() == BatchStatus::Cancelling {
            End::Cancelled
        } else {
            match &self.mode {
                Mode::Async(mode) => {
                    mode.register(&job);
                    mode.run(&job, &cancel).await
                }
                Mode::Sync(mode) => mode.run(&job, &cancel).await,
            }
        };
        let result = self.finish(&job, end).await;
        if let Mode::Async(mode) = &self.mode {
            mode.unregister(&job);
        }
        result
    }

    fn resolve_unknown_models(&self, job: &Job) -> Result<(), ExecError> {
        for model in job.plan.models() {
            if self.config.model_gateways.contains_key(&model.model) {
                continue;
            }
            let message = format!(
                "The model `{}` is not served by this processor.",
                model.model
            );
            for record in job.unresolved_records(model)? {
                job.record(
                    record.line as u64,
                    &Outcome::Failed {
                        code: error_codes::MODEL_NOT_FOUND,
                        message: &message,
                    },
                )?;
            }
        }
        Ok(())
    }

    async fn finish(&self, job: &Arc<Job>, end: End) -> Result<Batch, ExecError> {
        let (status, reason, code, message) = match &end {
            End::Completed => {
                job.set_status(BatchStatus::Finalizing)?;
                (BatchStatus::Completed, "", "", String::new())
            }
            End::Expired => (
                BatchStatus::Expired,
                "deadline",
                error_codes::BATCH_EXPIRED,
                error_codes::BATCH_EXPIRED_MESSAGE.to_owned(),
            ),
            End::Cancelled => {
                job.set_status(BatchStatus::Cancelling)?;
                (
                    BatchStatus::Cancelled,
                    "cancelled",
                    error_codes::BATCH_CANCELLED,
                    CANCELLED_MESSAGE.to_owned(),
                )
            }
            End::Failed(e) => {
                tracing::error!(job = %job.id, error = %e, "job failed");
                job.add_error("system_error", e);
                (
                    BatchStatus::Failed,
                    "system_error",
                    error_codes::BATCH_FAILED,
                    format!("The batch failed before this request completed: {e}"),
                )
            }
        };
        if !matches!(end, End::Completed) {
            if let Mode::Async(mode) = &self.mode {
                if let Err(e) = mode.withdraw(job).await {
                    tracing::error!(job = %job.id, error = %e, "could not withdraw pending requests; their results will be ignored");
                }
            }
            let resolved = job.resolve_all(code, &message)?;
            tracing::info!(job = %job.id, resolved, code, "unresolved requests closed");
        }
        job.sync_files()?;
        let batch = job.set_status(status)?;
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

    /// The current limit of a sync endpoint (`None` in async mode or for unknown names).
    pub fn endpoint_limit(&self, model: &str) -> Option<usize> {
        match &self.mode {
            Mode::Sync(mode) => mode.dispatcher().limit(model),
            Mode::Async(_) => None,
        }
    }

    /// How many times a sync endpoint's AIMD limit was cut (`None` in async mode).
    pub fn endpoint_cuts(&self, model: &str) -> Option<u64> {
        match &self.mode {
            Mode::Sync(mode) => mode.dispatcher().cuts(model),
            Mode::Async(_) => None,
        }
    }

    /// The async mode's result-consumer counters, by pool (empty in sync mode).
    pub async fn consumer_stats(
        &self,
    ) -> std::collections::BTreeMap<String, Arc<batch_consumer::ConsumerStats>> {
        match &self.mode {
            Mode::Async(mode) => mode.consumer_stats().await,
            Mode::Sync(_) => Default::default(),
        }
    }

    /// Stops the result consumers.
    pub async fn shutdown(&self) {
        if let Mode::Async(mode) = &self.mode {
            mode.shutdown().await;
        }
    }
}

fn deadline_of(job: &Job) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(job.expires_at().max(0) as u64)
}

pub(crate) fn deadline_passed(job: &Job) -> bool {
    SystemTime::now() >= deadline_of(job)
}

/// Sleeps until the job's SLO deadline.
pub(crate) fn deadline_sleep(job: &Job) -> tokio::time::Sleep {
    let left = deadline_of(job)
        .duration_since(SystemTime::now())
        .unwrap_or_default();
    tokio::time::sleep(left)
}

/// Waits until every line has a result (completed), the deadline passes or `cancel` fires.
pub(crate) async fn wait_for_end(
    job: &Job,
    progress: &mut watch::Receiver<JobProgress>,
    cancel: &CancellationToken,
) -> Option<End> {
    let deadline = deadline_sleep(job);
    tokio::pin!(deadline);
    loop {
        if progress.borrow_and_update().remaining() == 0 {
            return Some(End::Completed);
        }
        tokio::select! {
            changed = progress.changed() => if changed.is_err() { return None },
            _ = &mut deadline => return Some(End::Expired),
            _ = cancel.cancelled() => return Some(End::Cancelled),
        }
    }
}
