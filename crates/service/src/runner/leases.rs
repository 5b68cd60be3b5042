//! The leases of the jobs running here: the heartbeat that renews them, and what happens to a
//! job whose lease was lost or lapsed.

use std::sync::Arc;

use batch_state::JobLease;

use super::fence::{log_regained, Fence};
use super::Runner;

impl Runner {
    /// The fenced writes for the job under `lease`.
    pub(super) fn fencing<'a>(&'a self, lease: &'a JobLease) -> Fence<'a> {
        Fence {
            store: &self.store,
            lease,
            ttl: self.config.lease_ttl,
            stop: &self.stop,
        }
    }

    /// Renews the leases of the jobs running here, a third of the lease time apart; a job whose
    /// lease was lost (this process was frozen or cut off past it) stops at once.
    pub(super) async fn heartbeat(self: Arc<Self>) {
        let every = self.config.lease_ttl / 3;
        let mut renewed = std::time::Instant::now();
        loop {
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            if renewed.elapsed() >= self.config.lease_ttl / 2 {
                // The leases may lapse before the next renewal and another replica take the
                // jobs: from here their results are parked, not written where they could be
                // lost with a fenced run.
                self.hold_results();
            }
            let leases: Vec<JobLease> = {
                let active = self.active.lock().expect("active lock");
                active.values().map(|a| a.lease.clone()).collect()
            };
            let renewal =
                tokio::time::timeout(every, self.store.renew(&leases, self.config.lease_ttl));
            match renewal.await {
                Ok(Ok(renewal)) => {
                    renewed = std::time::Instant::now();
                    let lost: std::collections::HashSet<&str> =
                        renewal.lost.iter().map(|l| l.job.as_str()).collect();
                    self.hold_results_but(&lost);
                    for lease in &renewal.lost {
                        if !self.is_active(lease) {
                            // It ended (or paused) meanwhile and let go of the lease itself.
                            continue;
                        }
                        self.log_lost(lease).await;
                        self.stop_fenced(&lease.job);
                    }
                    for lease in renewal.regained {
                        self.regained(&lease).await;
                    }
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "could not renew job leases"),
                Err(_) => tracing::debug!("renewing job leases timed out"),
            }
        }
    }

    /// A lease that lapsed with nobody taking the job is held again: the job goes on here.
    /// A job that let go of its lease meanwhile (a shutdown) lets go of it again.
    async fn regained(&self, lease: &JobLease) {
        let active = self
            .active
            .lock()
            .expect("active lock")
            .contains_key(&lease.job);
        if active {
            log_regained(lease);
        } else if let Err(e) = self.store.release_lease(lease).await {
            tracing::warn!(job = %lease.job, error = %e, "could not let go of a lease again");
        }
    }

    /// Says why a lease was lost: Redis lost the whole state (then the job is put back from
    /// storage and resumed), or another replica took the job.
    pub(super) async fn log_lost(&self, lease: &JobLease) {
        let started = self
            .active
            .lock()
            .expect("active lock")
            .get(&lease.job)
            .map_or(0, |a| a.losses);
        let state_lost =
            matches!(self.state.check().await, Ok(true)) || self.state.losses() > started;
        if state_lost {
            tracing::warn!(job = %lease.job, epoch = lease.epoch, "the job's lease went with the state Redis lost; stopping it here: it resumes from its checkpoint once the state is rebuilt from storage");
        } else {
            tracing::warn!(job = %lease.job, epoch = lease.epoch, "lost the job's lease to another replica; stopping it here");
        }
    }

    /// Takes the job out of the active ones, unless a newer run of it (adopted here after this
    /// one was fenced, as when Redis lost the state) replaced it meanwhile.
    fn is_active(&self, lease: &JobLease) -> bool {
        let active = self.active.lock().expect("active lock");
        active
            .get(&lease.job)
            .is_some_and(|a| a.lease.epoch == lease.epoch)
    }

    /// Job `lease.job` of `record` was prepared: the API shows its lines from the job itself
    /// now, and it may be asked to give its slot back.
    pub(super) fn prepared(
        &self,
        lease: &JobLease,
        job: &Arc<batch_executor::Job>,
        record: &batch_state::StoredBatch,
    ) {
        let mut active = self.active.lock().expect("active lock");
        if let Some(a) = active.get_mut(&lease.job) {
            if a.lease.epoch == lease.epoch {
                a.job = Some(job.clone());
                a.run = Some(super::Run {
                    tenant: record.tenant.clone(),
                    expires_at: record.expires_at,
                    since: std::time::Instant::now(),
                });
            }
        }
    }

    pub(super) fn forget_active(&self, lease: &JobLease) {
        let mut active = self.active.lock().expect("active lock");
        if active
            .get(&lease.job)
            .is_some_and(|a| a.lease.epoch == lease.epoch)
        {
            active.remove(&lease.job);
        }
    }

    /// Holds back the results of every job running here
    /// ([`batch_executor::Job::hold_results`]).
    fn hold_results(&self) {
        let active = self.active.lock().expect("active lock");
        for job in active.values().filter_map(|a| a.job.as_ref()) {
            job.hold_results(true);
        }
    }

    /// Lets the results of the jobs running here through again, but those of `lost` jobs.
    fn hold_results_but(&self, lost: &std::collections::HashSet<&str>) {
        let active = self.active.lock().expect("active lock");
        for (id, a) in active.iter() {
            if let Some(job) = &a.job {
                job.hold_results(lost.contains(id.as_str()));
            }
        }
    }

    /// Stops the job `id` runs here from writing any more: its lease is lost.
    fn stop_fenced(&self, id: &str) {
        if let Some(a) = self.active.lock().expect("active lock").get(id) {
            a.fenced.cancel();
        }
    }
}
