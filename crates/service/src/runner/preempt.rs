//! A slot given back for a fairer share: when every slot here is taken and a tenant below its
//! share of the running batches (on all replicas) has a batch waiting, one running batch of the
//! most served tenant stops at a safe point and waits in the queue again; its slot goes to the
//! fair pick at once, while its last requests end and it checkpoints. Which batch, if any, is
//! decided in one step in Redis ([`batch_state::Store::preempt`]), so that two replicas never
//! both give a slot back for the same share.
//!
//! The batch stops as at a shutdown ([`batch_executor::Job::yield_slot`]: no new line, its
//! requests in flight end in sync mode, its queued ones stay in async mode), checkpoints, and is
//! queued again by its deadline under its lease ([`batch_state::Store::requeue`]); whichever
//! replica claims it next resumes it from that checkpoint, as one taking over a stopped
//! replica's job does. A batch that gave its slot back runs `serve.tenant_preemption_min_run`
//! before it may be asked again.

use std::sync::Arc;
use std::time::Duration;

use batch_state::{Candidate, JobLease, StoredBatch};

use super::{RunError, Runner};

/// How often a replica whose slots are all taken looks for a tenant below its share (a batch
/// created here looks at once).
const PREEMPT_INTERVAL: Duration = Duration::from_millis(100);

impl Runner {
    /// Until stopped: asks a running batch here to give its slot back when a tenant below its
    /// share waits for one.
    pub(super) async fn preempt(self: Arc<Self>) {
        let Some(min_run) = self.config.preemption else {
            return;
        };
        loop {
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = self.preempt_wake.notified() => {}
                _ = tokio::time::sleep(PREEMPT_INTERVAL) => {}
            }
            // A free slot takes the waiting batch itself.
            if self.slots.available_permits() > 0 {
                continue;
            }
            let candidates = self.candidates(min_run);
            match self
                .store
                .preempt(&self.config.replica, &self.config.tenant_share, &candidates)
                .await
            {
                Ok(Some(id)) => self.yield_slot(&id),
                Ok(None) => {}
                Err(e) => tracing::debug!(error = %e, "could not look for a slot to give back"),
            }
        }
    }

    /// The jobs here that may give their slot back, the least urgent first: prepared, in
    /// progress, not already asked, and in their first run or `min_run` into this one.
    fn candidates(&self, min_run: Duration) -> Vec<Candidate> {
        let active = self.active.lock().expect("active lock");
        let mut runs: Vec<(i64, Candidate)> = active
            .iter()
            .filter_map(|(id, a)| {
                let (job, run) = (a.job.as_ref()?, a.run.as_ref()?);
                let first = a.lease.epoch <= 1;
                let eligible = job.status() == batch_wire::BatchStatus::InProgress
                    && !job.yielded()
                    && (first || run.since.elapsed() >= min_run);
                eligible.then(|| {
                    let candidate = Candidate {
                        job: id.clone(),
                        tenant: run.tenant.clone(),
                    };
                    (run.expires_at, candidate)
                })
            })
            .collect();
        runs.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.job.cmp(&b.1.job)));
        runs.into_iter().map(|(_, c)| c).collect()
    }

    /// Job `id` was asked to give its slot back: it stops taking lines, and its slot is free
    /// at once for the waiting batch.
    fn yield_slot(&self, id: &str) {
        let mut active = self.active.lock().expect("active lock");
        let Some(super::Active {
            job: Some(job),
            run: Some(run),
            permit,
            ..
        }) = active.get_mut(id)
        else {
            // It ended meanwhile: the record of the ask goes with its running entry.
            return;
        };
        job.yield_slot();
        drop(permit.take());
        self.wake.notify_one();
        metrics::counter!("batch_service_preemptions_total").increment(1);
        tracing::info!(
            job = %id,
            tenant = %run.tenant,
            ran_for = ?run.since.elapsed(),
            "giving the batch's slot back to a tenant below its share; it waits in the queue again with its progress kept"
        );
    }

    /// Step of a pause: a job that gave its slot back (checkpointed, out of the active ones)
    /// is queued again under its lease.
    pub(super) async fn requeue(
        &self,
        record: &StoredBatch,
        lease: &JobLease,
    ) -> Result<(), RunError> {
        let queued = self
            .retry("queueing a batch again", || {
                self.store.requeue(lease, &record.tenant, record.expires_at)
            })
            .await?;
        if queued {
            tracing::info!(job = %lease.job, epoch = lease.epoch, "the batch gave its slot back and waits in the queue again");
            Ok(())
        } else {
            Err(RunError::Fenced)
        }
    }
}
