//! Checkpoints: a running job's result files (whole lines only) and small files copied to
//! storage, their keys recorded fenced by the lease, and the job rebuilt from them when another
//! replica (or this one, after losing its disk) adopts it.

use std::path::Path;
use std::sync::Arc;

use batch_api::{ApiError, ErrorCode, LineStream};
use batch_state::{layout, now_unix, JobLease};
use batch_storage::StorageError;
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;
use tokio_util::io::ReaderStream;

use super::{RunError, Runner};

/// The file in a job's local directory naming the lease epoch it was last run under.
const EPOCH_FILE: &str = "epoch";

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
    /// The whole lines `file` (`output.jsonl`, `error.jsonl`) of running job `id` holds so
    /// far: from the executor's job while it runs here (up to the sink's last flushed line),
    /// else from its latest checkpoint (it runs on another replica, or here but is not prepared
    /// yet: still being restored from that checkpoint); `None` while there are none.
    pub(crate) async fn lines_so_far(
        &self,
        id: &str,
        file: &str,
    ) -> Result<Option<LineStream>, ApiError> {
        if let Some(job) = self.running_job(id) {
            let read = |e: &dyn std::fmt::Display| {
                ApiError::new(
                    ErrorCode::Internal,
                    format!("Reading the lines so far failed: {e}"),
                )
            };
            return match job.result_lines(file).map_err(|e| read(&e))? {
                Some((opened, len)) if len > 0 => {
                    let lines = tokio::fs::File::from_std(opened).take(len);
                    Ok(Some(ReaderStream::new(lines).boxed()))
                }
                _ => Ok(None),
            };
        }
        let Some(key) = self.checkpointed_file(id, file).await? else {
            return Ok(None);
        };
        match self.storage.get(&key).await {
            Ok(object) => Ok(Some(object.stream.map_err(std::io::Error::other).boxed())),
            // The batch ended meanwhile, and its checkpoints went.
            Err(StorageError::NotFound(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The storage key of `file` in job `id`'s latest checkpoint, if it has one.
    async fn checkpointed_file(
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

    /// Copies a running job's result files (whole lines only) and small files to storage and
    /// records where, fenced by the lease.
    pub(super) async fn checkpoint(
        &self,
        job: &Arc<batch_executor::Job>,
        lease: &JobLease,
    ) -> Result<(), RunError> {
        let cut = {
            let job = job.clone();
            tokio::task::spawn_blocking(move || job.checkpoint())
                .await
                .map_err(|error| RunError::Panicked {
                    what: "checkpoint",
                    error,
                })??
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
        self.fencing(lease)
            .write("recording a checkpoint", || {
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
    pub(super) async fn restore(&self, lease: &JobLease, dir: &Path) -> Result<(), RunError> {
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
                .map_err(|error| RunError::Io {
                    path: dir.to_owned(),
                    error,
                })?;
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
        batch_executor::restore_checkpoint(&out, c.batch.as_bytes(), c.manifest.as_bytes())?;
        tracing::info!(job = %lease.job, from_epoch = c.epoch, output_bytes = c.output_len, error_bytes = c.error_len, "resuming from a checkpoint");
        Ok(())
    }
}

pub(super) fn write_epoch(dir: &Path, epoch: u64) -> std::io::Result<()> {
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
