//! The watcher of a running job: publishes its counts, turns a cancel request into its cancel,
//! and checkpoints it every `checkpoint_interval`.

use std::sync::Arc;
use std::time::Duration;

use batch_state::{Advance, Change, JobLease, StoredBatch};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{RunError, Runner};

/// How often a running job's record is refreshed and its cancel marker looked at.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(500);

impl Runner {
    /// While a job runs: publishes its counts, turns a cancel request into its cancel, and
    /// checkpoints it every `checkpoint_interval`.
    pub(super) async fn watch(
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
                // Each checkpoint is the batch's progress in its trace.
                let span = tracing::info_span!(
                    "progress",
                    completed = now.counts.completed,
                    failed = now.counts.failed,
                    total = now.counts.total,
                );
                match self.checkpoint(&job, &lease).instrument(span).await {
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
                let change = Change::Running {
                    status: now.status,
                    counts: now.counts,
                };
                match self.store.advance(&mut record, change, Some(&lease)).await {
                    Ok(Advance::Saved) => last = Some(now),
                    Ok(Advance::Fenced) => match self.fencing(&lease).regain().await {
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
