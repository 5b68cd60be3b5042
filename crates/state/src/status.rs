//! A batch's status moves here and nowhere else: [`StoredBatch::apply`] says what each change
//! does to the record, [`Store::advance`] writes the result to Redis and its storage copy, and
//! [`Store::request_cancel`] moves a batch to `cancelling`. Everyone else reads the record as
//! stored: nothing is rewritten on read.
//!
//! A batch asked to cancel stays `cancelling` until it ends: no change moves it back, and a
//! write racing the cancel request is refused by the store and made again on the new record.

use std::sync::LazyLock;

use batch_wire::{Batch, BatchError, BatchStatus, RequestCounts};
use fred::interfaces::HashesInterface;
use fred::types::scripts::Script;

use crate::{now_unix, FineCounts, JobLease, Store, StoreError, StoredBatch, Usage};

static CANCEL: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("batches/cancel.lua")));

/// One change of a batch's record.
#[derive(Debug, Clone, Copy)]
pub enum Change<'a> {
    /// The running job's progress: its counts, and its status unless that is a final one
    /// (shown once the result files are up).
    Running {
        /// The executor's status.
        status: BatchStatus,
        /// `request_counts`.
        counts: RequestCounts,
    },
    /// The job stopped before its end (a shutdown): what the executor knows of it.
    Stopped(&'a Batch),
    /// The job ended; its result files go up now. `finalizing` when it completed with
    /// result lines to upload.
    Finalizing {
        /// The executor's final batch.
        batch: &'a Batch,
        /// Whether there are result lines.
        results: bool,
    },
    /// The result files are up: the executor's final status, the files, the counts.
    Ended {
        /// The executor's final batch.
        batch: &'a Batch,
        /// The output file's id, when there is one.
        output_file_id: Option<&'a str>,
        /// The error file's id, when there is one.
        error_file_id: Option<&'a str>,
        /// Summed token counts.
        usage: Usage,
        /// Requests closed by a cancel.
        cancelled: u64,
        /// Requests closed by the deadline.
        expired: u64,
    },
    /// The batch failed before it reached the executor.
    Failed {
        /// The error's code.
        code: &'a str,
        /// What went wrong.
        message: &'a str,
    },
    /// A cancel was asked at `at` (Unix seconds).
    Cancelling {
        /// When.
        at: i64,
    },
}

/// What [`Store::advance`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advance {
    /// Written.
    Saved,
    /// Nothing written: the writer no longer holds the job's lease.
    Fenced,
}

impl StoredBatch {
    /// Applies `change` to the record.
    pub fn apply(&mut self, change: Change<'_>) {
        let now = now_unix();
        let cancelling = self.status == BatchStatus::Cancelling;
        match change {
            Change::Running { status, counts } => {
                self.counts = counts.into();
                if !status.is_terminal() && !cancelling && self.status != status {
                    self.set_status(status, now);
                }
            }
            Change::Stopped(batch) => {
                self.copy_of(batch);
                if cancelling && !batch.status.is_terminal() {
                    self.status = BatchStatus::Cancelling;
                }
            }
            Change::Finalizing { batch, results } => {
                self.counts = batch.request_counts.into();
                if batch.status == BatchStatus::Completed && results && !cancelling {
                    self.set_status(BatchStatus::Finalizing, now);
                }
            }
            Change::Ended {
                batch,
                output_file_id,
                error_file_id,
                usage,
                cancelled,
                expired,
            } => {
                self.copy_of(batch);
                self.output_file_id = output_file_id.map(str::to_owned);
                self.error_file_id = error_file_id.map(str::to_owned);
                let counts = self.counts;
                self.usage = Some(usage);
                self.fine_counts = FineCounts {
                    processing: 0,
                    succeeded: counts.completed,
                    errored: counts.failed.saturating_sub(cancelled + expired),
                    cancelled,
                    expired,
                };
                return;
            }
            Change::Failed { code, message } => {
                self.errors = Some(vec![BatchError {
                    code: code.to_owned(),
                    message: message.to_owned(),
                    param: None,
                    line: None,
                }]);
                self.set_status(BatchStatus::Failed, now);
            }
            Change::Cancelling { at } => {
                if !self.status.is_terminal() {
                    self.set_status(BatchStatus::Cancelling, at);
                }
            }
        }
        self.running_counts();
    }

    /// Copies what the executor knows of the job (which keeps the service's own fields: the
    /// input file id, window, metadata).
    fn copy_of(&mut self, batch: &Batch) {
        self.status = batch.status;
        self.errors = batch.errors.as_ref().map(|e| e.data.clone());
        self.counts = batch.request_counts.into();
        if self.endpoint.is_none() {
            self.endpoint = batch.endpoint.clone();
        }
        let t = &mut self.times;
        t.in_progress = t.in_progress.or(batch.in_progress_at);
        t.finalizing = t.finalizing.or(batch.finalizing_at);
        t.completed = batch.completed_at;
        t.failed = batch.failed_at;
        t.expired = batch.expired_at;
        t.cancelling = t.cancelling.or(batch.cancelling_at);
        t.cancelled = batch.cancelled_at;
    }

    /// Fine counts derived from the request counts while the batch runs.
    fn running_counts(&mut self) {
        let c = self.counts;
        self.fine_counts = FineCounts {
            processing: c.total.saturating_sub(c.completed + c.failed),
            succeeded: c.completed,
            errored: c.failed,
            cancelled: 0,
            expired: 0,
        };
    }
}

/// What a cancel request found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelRequest {
    /// Asked now; the job was waiting in the queue and moved to the cancel queue.
    WasQueued,
    /// Asked now; the job is running somewhere (its runner sees the request).
    WasRunning,
    /// Asked before.
    Already,
}

impl Store {
    /// Applies `change` to `record` and saves it, as the holder of `lease` (`None`: unfenced,
    /// for tools), to Redis and to the storage copy.
    pub async fn advance(
        &self,
        record: &mut StoredBatch,
        change: Change<'_>,
        lease: Option<&JobLease>,
    ) -> Result<Advance, StoreError> {
        record.apply(change);
        loop {
            match self.save_batch(record, lease).await? {
                1 => return Ok(Advance::Saved),
                0 => return Ok(Advance::Fenced),
                // A cancel request came first: it stays.
                _ => {
                    let stored = self.batch(&record.id).await?;
                    let at = stored
                        .and_then(|s| s.times.cancelling)
                        .unwrap_or_else(now_unix);
                    record.apply(Change::Cancelling { at });
                }
            }
        }
    }

    /// Asks for batch `id` to be cancelled: its record moves to `cancelling`, and a job still
    /// waiting in the queue moves to the cancel queue, which runners take from without waiting
    /// for a free slot.
    pub async fn request_cancel(&self, id: &str) -> Result<CancelRequest, StoreError> {
        // A batch's tenant never changes: read first, its queue's key goes in KEYS.
        let tenant: Option<String> =
            HashesInterface::hget(&self.client, self.keys.tenant_of(), id).await?;
        loop {
            let Some((old, mut record)) = self.batch_json(id).await? else {
                return Ok(CancelRequest::Already);
            };
            let was = record.status;
            let at = now_unix();
            record.apply(Change::Cancelling { at });
            let new = serde_json::to_string(&record).expect("a batch record serializes");
            let mut keys = vec![
                self.keys.cancel(id),
                self.keys.queue(),
                self.keys.cancel_queue(),
                self.keys.tenant_of(),
                self.keys.tenants_queued(),
                self.keys.batch(id),
                self.keys.status_counts(),
                self.keys.epoch(id),
            ];
            keys.extend(tenant.as_ref().map(|t| self.keys.tenant_queue(t)));
            let args = vec![
                id.to_owned(),
                at.to_string(),
                old,
                new,
                was.as_str().to_owned(),
                record.status.as_str().to_owned(),
            ];
            let (n, epoch): (i64, u64) =
                CANCEL.evalsha_with_reload(&self.client, keys, args).await?;
            if n < 0 {
                // The record changed since it was read: read it again.
                continue;
            }
            if n != 0 {
                self.mirror_cancel(id, &record, epoch).await?;
            }
            return Ok(match n {
                0 => CancelRequest::Already,
                1 => CancelRequest::WasQueued,
                _ => CancelRequest::WasRunning,
            });
        }
    }
}
