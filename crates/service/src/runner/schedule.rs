//! Scheduling: which jobs this replica takes, and when. Its own jobs first at a start, then a
//! freed slot goes to a job whose replica stopped before any queued one; jobs cancelled while
//! queued need no slot.

use std::sync::Arc;
use std::time::{Duration, Instant};

use batch_state::{JobLease, StoreError};
use tokio::sync::OwnedSemaphorePermit;

use super::{Active, RunError, Runner, POLL_INTERVAL};

/// How often, at most, a freed slot looks for a job to take over before the queue.
const ORPHAN_LOOK: Duration = Duration::from_millis(100);

impl Runner {
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
            tokio::spawn(self.clone().preempt()),
        ];
        loop {
            let Some(permit) = self.slot().await else {
                break;
            };
            let permit = if self.orphans_due() {
                let Some(permit) = self.take_over_one(permit).await else {
                    continue;
                };
                permit
            } else {
                permit
            };
            match self
                .store
                .claim_queued(me, self.config.lease_ttl, &self.config.tenant_share)
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

    /// Whether a slot freed now should look for a job to take over before the queue: at most
    /// every [`ORPHAN_LOOK`]. Each look lists every running job, so looking at every claim made
    /// starting a thousand queued jobs cost a million entries read; a lease runs out over
    /// seconds, so a job whose replica stopped waits at most this much longer for a slot.
    fn orphans_due(&self) -> bool {
        let mut last = self.orphans_looked.lock().expect("orphans lock");
        let now = Instant::now();
        if last.is_some_and(|at| now.duration_since(at) < ORPHAN_LOOK) {
            return false;
        }
        *last = Some(now);
        true
    }

    async fn orphans(&self) -> Result<Vec<String>, StoreError> {
        let running = self.store.running().await?;
        let candidates: Vec<String> = {
            let active = self.active.lock().expect("active lock");
            running
                .into_keys()
                .filter(|id| !active.contains_key(id))
                .collect()
        };
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
                job: None,
                lease: lease.clone(),
                fenced: fenced.clone(),
                losses: self.state.losses(),
                run: None,
                permit,
            },
        );
        self.tasks.spawn(async move {
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
}
