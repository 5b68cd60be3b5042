//! A job's lifecycle: from its record and input to the executor, then to its end (finished,
//! failed before it started, or paused by a shutdown or a lost lease).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use batch_executor::{JobSpec, Prepared};
use batch_observability::TRACEPARENT;
use batch_sink::{JobSink, Totals};
use batch_state::{layout, Change, JobLease, StoredBatch};
use batch_storage::StorageError;
use batch_wire::Batch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::checkpoints::write_epoch;
use super::{RunError, Runner};
use crate::finalize;

impl Runner {
    pub(super) async fn run_job(
        self: &Arc<Self>,
        lease: &JobLease,
        adopted: bool,
        fenced: &CancellationToken,
    ) -> Result<(), RunError> {
        let id = lease.job.as_str();
        let Some(record) = self
            .retry("reading a batch", || self.store.batch(id))
            .await?
        else {
            tracing::warn!(job = %id, "a claimed batch has no record; dropping it");
            return self
                .retry("forgetting a job", || self.store.forget_running(id))
                .await;
        };
        let dir = self.job_dir(id);
        if record.status.is_terminal() {
            return self.end(lease, &dir).await;
        }
        // This run of the batch is a span of the batch's trace (that of its create request),
        // whichever replica runs it and however often it is resumed.
        let span = tracing::info_span!(
            "batch",
            otel.name = %format!("batch {id}"),
            batch.id = %id,
            tenant = %record.tenant,
            replica = %self.config.replica,
            adopted,
            batch.status = tracing::field::Empty,
        );
        if let Some(parent) = record.headers.get(TRACEPARENT) {
            batch_observability::set_parent(&span, parent);
        }
        self.run_record(record, lease, adopted, fenced, &dir)
            .instrument(span)
            .await
    }

    /// [`Runner::run_job`] once the record is read, in the batch's span.
    async fn run_record(
        self: &Arc<Self>,
        mut record: StoredBatch,
        lease: &JobLease,
        adopted: bool,
        fenced: &CancellationToken,
        dir: &Path,
    ) -> Result<(), RunError> {
        let id = lease.job.as_str();
        let dir = dir.to_path_buf();
        // Adopted, or claimed again after it gave its slot back (a new epoch): it goes on
        // from its checkpoint.
        if adopted || lease.epoch > 1 {
            self.restore(lease, &dir).await?;
        }
        write_epoch(&dir, lease.epoch).map_err(|error| RunError::Io {
            path: dir.to_owned(),
            error,
        })?;
        let Some(input) = self.fetch_input(&mut record, lease, &dir).await? else {
            return Ok(());
        };
        let spec = self.job_spec(&record, id, input, &dir);
        let cancel = self.cancel_token(id).await?;
        let Some(prepared) = self.prepare_job(&spec, &mut record, lease).await? else {
            return Ok(());
        };
        let (batch, totals) = match prepared {
            // Ended before (finishing it was cut short): the sink counts its files again.
            Prepared::Finished(batch) => {
                let out = dir.join("out");
                let totals = JobSink::open(&out, id, batch.request_counts.total)?.totals();
                (*batch, totals)
            }
            Prepared::Ready(job) => {
                match self
                    .execute(job, &mut record, lease, &cancel, fenced)
                    .await?
                {
                    Some(ended) => ended,
                    None => return Ok(()),
                }
            }
        };
        tracing::Span::current().record("batch.status", batch.status.as_str());
        finalize::finish(
            &self.fencing(lease),
            &self.storage,
            &mut record,
            &batch,
            &totals,
            &dir,
        )
        .instrument(tracing::info_span!(
            "finalize",
            batch.status = batch.status.as_str()
        ))
        .await?;
        self.end(lease, &dir).await
    }

    /// Step of a run: the job's input in its directory, downloaded unless already there;
    /// `None` when the input file is gone and the batch was failed for it.
    async fn fetch_input(
        &self,
        record: &mut StoredBatch,
        lease: &JobLease,
        dir: &Path,
    ) -> Result<Option<PathBuf>, RunError> {
        let input = dir.join("input.jsonl");
        if !input.exists() {
            let key = layout::upload(&record.input_file_id);
            match self.storage.download(&key, &input).await {
                Ok(_) => {}
                Err(StorageError::NotFound(_)) => {
                    let message = format!(
                        "The input file {} was deleted before the batch started.",
                        record.input_file_id
                    );
                    self.fail_unstarted(record, lease, "invalid_file", &message)
                        .await?;
                    return Ok(None);
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(Some(input))
    }

    /// Step of a run: what the executor is given to run the batch.
    fn job_spec(&self, record: &StoredBatch, id: &str, input: PathBuf, dir: &Path) -> JobSpec {
        JobSpec {
            input,
            output_dir: dir.join("out"),
            job_id: Some(id.to_owned()),
            completion_window: Duration::from_secs(record.window_secs),
            // The pass-through headers of its create request, and this run's trace context,
            // on every request of the batch.
            headers: request_headers(record),
            created_at: Some(record.created_at),
            endpoint: record.endpoint.clone(),
            request_slots: self.tenant_slots(&record.tenant),
            // The replica's requests are shared among tenants, not among batches.
            share: Some(record.tenant.clone()),
        }
    }

    /// Step of a run: the job's cancel token, already cancelled when a cancel was requested.
    async fn cancel_token(&self, id: &str) -> Result<CancellationToken, RunError> {
        let cancel = CancellationToken::new();
        if self
            .retry("reading a cancel", || self.store.cancel_requested(id))
            .await?
        {
            cancel.cancel();
        }
        Ok(cancel)
    }

    /// Step of a run: the executor validates the input and sets up the job's files; `None`
    /// when the job was let go to be taken again later, or failed.
    async fn prepare_job(
        &self,
        spec: &JobSpec,
        record: &mut StoredBatch,
        lease: &JobLease,
    ) -> Result<Option<Prepared>, RunError> {
        let id = lease.job.as_str();
        match self
            .executor
            .prepare(spec)
            .instrument(tracing::info_span!("validate"))
            .await
        {
            Ok(p) => Ok(Some(p)),
            // An earlier run of the job here (fenced when Redis lost the state) still winds
            // down: not a failure of the batch; it is taken again once that run let go.
            Err(batch_executor::ExecError::Locked { .. }) => {
                tracing::info!(job = %id, "an earlier run of the job here still winds down; taking it again later");
                self.forget_active(lease);
                self.retry("letting go of a lease", || self.store.release_lease(lease))
                    .await?;
                Ok(None)
            }
            Err(e) => {
                let message = format!("The batch could not be started: {e}");
                self.fail_unstarted(record, lease, "batch_failed", &message)
                    .await?;
                Ok(None)
            }
        }
    }

    /// Step of a run: executes a ready job, watched, until it stops; its end and totals, or
    /// `None` when it paused or failed.
    async fn execute(
        self: &Arc<Self>,
        job: Arc<batch_executor::Job>,
        record: &mut StoredBatch,
        lease: &JobLease,
        cancel: &CancellationToken,
        fenced: &CancellationToken,
    ) -> Result<Option<(Batch, Totals)>, RunError> {
        self.prepared(lease, &job, record);
        let mut models = job.models();
        if let (Some(model), None) = (models.next(), models.next()) {
            record.model = Some(model.to_owned());
        }
        let done = CancellationToken::new();
        let watcher = tokio::spawn(
            self.clone()
                .watch(
                    job.clone(),
                    record.clone(),
                    lease.clone(),
                    cancel.clone(),
                    fenced.clone(),
                    done.clone(),
                )
                .in_current_span(),
        );
        let result = self
            .executor
            .execute_until(job.clone(), cancel.clone(), fenced.clone())
            .instrument(tracing::info_span!("dispatch"))
            .await;
        // Its last save must land before the final one.
        done.cancel();
        let _ = watcher.await;
        match result {
            Ok(batch) if !batch.status.is_terminal() => {
                self.paused(&job, record, &batch, lease).await?;
                Ok(None)
            }
            Ok(batch) => Ok(Some((batch, job.totals()))),
            Err(e) => {
                let message = format!("The batch failed: {e}");
                self.fail_unstarted(record, lease, "batch_failed", &message)
                    .await?;
                Ok(None)
            }
        }
    }

    /// A job stopped before its end: by a shutdown (its state goes to storage and its lease is
    /// let go, so another replica may go on at once), by giving its slot back (the same, and it
    /// is queued again), or by a lost lease (nothing more is written).
    async fn paused(
        &self,
        job: &Arc<batch_executor::Job>,
        record: &mut StoredBatch,
        batch: &Batch,
        lease: &JobLease,
    ) -> Result<(), RunError> {
        self.fencing(lease)
            .advance(record, Change::Stopped(batch))
            .await?;
        if let Err(e) = self.checkpoint(job, lease).await {
            tracing::warn!(job = %lease.job, error = %e, "no checkpoint at shutdown; the next holder redoes more");
        }
        // Out of the heartbeat's list first: a renewal racing this release must not take the
        // lease back (see `regained`).
        self.forget_active(lease);
        if job.yielded() {
            return self.requeue(record, lease).await;
        }
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
        self.fencing(lease)
            .write("releasing a job", || self.store.release(lease))
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
        tracing::warn!(job = %record.id, message, "batch failed");
        self.fencing(lease)
            .advance(record, Change::Failed { code, message })
            .await?;
        let dir = self.job_dir(&lease.job);
        self.end(lease, &dir).await
    }
}

/// The headers sent on each request of a run: the batch's pass-through headers, with the
/// `traceparent` of the current span (the run's) instead of the stored one, or none when
/// traces are off.
fn request_headers(record: &StoredBatch) -> std::collections::BTreeMap<String, String> {
    let mut headers = record.headers.clone();
    headers.remove(TRACEPARENT);
    if let Some(traceparent) = batch_observability::traceparent(&tracing::Span::current()) {
        headers.insert(TRACEPARENT.to_owned(), traceparent);
    }
    headers
}
