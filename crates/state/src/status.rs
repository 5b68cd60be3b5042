//! A batch's status moves here and nowhere else: [`StoredBatch::apply`] says what each change
//! does to the record, [`Store::advance`] writes the result to Redis and its storage copy, and
//! [`Store::request_cancel`] moves a batch to `cancelling`. Everyone else reads the record as
//! stored: nothing is rewritten on read.
//!
//! A batch asked to cancel stays `cancelling` until it ends: no change moves it back, and a
//! write racing the cancel request is refused by the store and made again on the new record.

use std::sync::LazyLock;

use batch_wire::{Batch, BatchError, BatchErrors, BatchStatus, RequestCounts};
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
        let cancelling = self.batch.status() == BatchStatus::Cancelling;
        let b = &mut self.batch.batch;
        match change {
            Change::Running { status, counts } => {
                b.request_counts = counts;
                if !status.is_terminal() && !cancelling && b.status != status {
                    b.set_status(status, now);
                }
            }
            Change::Stopped(batch) => {
                self.copy_of(batch);
                if cancelling && !batch.status.is_terminal() {
                    self.batch.batch.status = BatchStatus::Cancelling;
                }
            }
            Change::Finalizing { batch, results } => {
                b.request_counts = batch.request_counts;
                if batch.status == BatchStatus::Completed && results && !cancelling {
                    b.set_status(BatchStatus::Finalizing, now);
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
                let b = &mut self.batch.batch;
                b.output_file_id = output_file_id.map(str::to_owned);
                b.error_file_id = error_file_id.map(str::to_owned);
                let counts = b.request_counts;
                self.batch.usage = Some(usage);
                self.batch.x_request_counts = FineCounts {
                    processing: 0,
                    succeeded: counts.completed,
                    errored: counts.failed.saturating_sub(cancelled + expired),
                    cancelled,
                    expired,
                };
                return;
            }
            Change::Failed { code, message } => {
                b.errors = Some(BatchErrors::new(vec![BatchError {
                    code: code.to_owned(),
                    message: message.to_owned(),
                    param: None,
                    line: None,
                }]));
                b.set_status(BatchStatus::Failed, now);
            }
            Change::Cancelling { at } => {
                if !b.status.is_terminal() {
                    b.set_status(BatchStatus::Cancelling, at);
                }
            }
        }
        self.running_counts();
    }

    /// Copies what the executor knows of the job (which keeps the service's own fields: the
    /// input file id, window, metadata).
    fn copy_of(&mut self, batch: &Batch) {
        let b = &mut self.batch.batch;
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
    }

    /// Fine counts derived from `request_counts` while the batch runs.
    fn running_counts(&mut self) {
        let c = self.batch.batch.request_counts;
        self.batch.x_request_counts = FineCounts {
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
                    let id = &record.batch.batch.id;
                    let stored = self.batch(id).await?;
                    let at = stored
                        .and_then(|s| s.batch.batch.cancelling_at)
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
            let was = record.batch.status();
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
                record.batch.status().as_str().to_owned(),
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
