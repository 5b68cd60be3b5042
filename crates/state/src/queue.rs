//! The job queue: every tenant's queued batches by SLO deadline in one sorted set, each
//! tenant's in one of its own (for the fair pick), and the cancel queue of batches whose cancel
//! was asked while they waited.
//!
//! A claim is two scripts: `pick` finds the job to take (reading every queued tenant's queue,
//! each named in its KEYS), `take` takes it under a new lease if it is still queued (another
//! replica may have taken it between the two; then the next is picked).
//!
//! The pick is fair across tenants: a free slot goes to the tenant with the smallest weighted
//! share of the running jobs, so a tenant with one batch queued never waits behind another
//! tenant's hundreds; within a tenant, by deadline.

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::time::Duration;

use fred::interfaces::{SetsInterface, SortedSetsInterface};
use fred::types::scripts::Script;

use crate::{millis, JobLease, Store, StoreError};

static PICK: LazyLock<Script> = LazyLock::new(|| Script::from_lua(include_str!("queue/pick.lua")));
static TAKE: LazyLock<Script> = LazyLock::new(|| Script::from_lua(include_str!("queue/take.lua")));
static PREEMPT: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("queue/preempt.lua")));
static REQUEUE: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("queue/requeue.lua")));

/// How many picks a claim tries when other replicas keep taking the picked job first.
const CLAIM_TRIES: usize = 16;

/// How free slots are shared among tenants' queued batches.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotShare {
    /// Running jobs (on all replicas) at which a tenant comes after every tenant under it
    /// (`serve.tenant_max_running_batches`; 0: none).
    pub cap: usize,
    /// Each tenant's weight (`serve.tenant_weights`); a tenant not named weighs 1. A tenant of
    /// weight 2 gets two slots for one of a tenant of weight 1 while both have batches queued.
    pub weights: BTreeMap<String, u32>,
}

impl SlotShare {
    fn weight(&self, tenant: &str) -> u32 {
        self.weights.get(tenant).copied().unwrap_or(1).max(1)
    }
}

impl Store {
    /// Takes a queued job for `replica` under a new lease: the most urgent job (earliest
    /// deadline) of the tenant with the smallest weighted share of the running jobs after
    /// taking it (see [`SlotShare`]); ties go to the earliest deadline.
    pub async fn claim_queued(
        &self,
        replica: &str,
        ttl: Duration,
        share: &SlotShare,
    ) -> Result<Option<JobLease>, StoreError> {
        self.claim(self.keys.queue(), replica, ttl, Some(share))
            .await
    }

    /// Takes a job whose cancel was asked while it waited in the queue.
    pub async fn claim_cancelled(
        &self,
        replica: &str,
        ttl: Duration,
    ) -> Result<Option<JobLease>, StoreError> {
        self.claim(self.keys.cancel_queue(), replica, ttl, None)
            .await
    }

    async fn claim(
        &self,
        queue: String,
        replica: &str,
        ttl: Duration,
        share: Option<&SlotShare>,
    ) -> Result<Option<JobLease>, StoreError> {
        for _ in 0..CLAIM_TRIES {
            let Some((id, tenant)) = self.pick(&queue, share).await? else {
                return Ok(None);
            };
            let mut keys = vec![
                queue.clone(),
                self.keys.running(),
                self.keys.tenants_queued(),
                self.keys.epoch(&id),
                self.keys.lease(&id),
            ];
            if !tenant.is_empty() {
                keys.push(self.keys.tenant_queue(&tenant));
            }
            let args = vec![id.clone(), replica.to_owned(), millis(ttl), tenant];
            let epoch: Option<u64> = TAKE.evalsha_with_reload(&self.client, keys, args).await?;
            if let Some(epoch) = epoch {
                return Ok(Some(JobLease {
                    job: id,
                    replica: replica.to_owned(),
                    epoch,
                }));
            }
        }
        Ok(None)
    }

    /// The id and tenant ("" for none) of the job to take from `queue`, if any waits: shared
    /// fairly among tenants with `share`, else the most urgent.
    async fn pick(
        &self,
        queue: &str,
        share: Option<&SlotShare>,
    ) -> Result<Option<(String, String)>, StoreError> {
        let tenants: Vec<String> = match share {
            Some(_) => self.client.smembers(self.keys.tenants_queued()).await?,
            None => Vec::new(),
        };
        let mut keys = vec![queue.to_owned(), self.keys.running(), self.keys.tenant_of()];
        keys.extend(tenants.iter().map(|t| self.keys.tenant_queue(t)));
        let mut args = vec![
            share.map_or(0, |s| s.cap).to_string(),
            if share.is_some() { "1" } else { "0" }.to_owned(),
        ];
        args.extend(tenant_args(tenants, share));
        let got: Option<(String, String)> =
            PICK.evalsha_with_reload(&self.client, keys, args).await?;
        Ok(got)
    }

    /// Asks one of `candidates`, jobs `replica` runs, to give its slot back, when the tenant
    /// the next free slot would go to is below its share of the running jobs and the job's
    /// tenant above it (the most served tenant's first candidate): its id, recorded as
    /// yielding, or `None`. One step in Redis, so two replicas never both give a slot back for
    /// the same share; a job asked counts as the new tenant's until [`Store::requeue`] (or its
    /// end). The job should then stop at a safe point and be queued again.
    pub async fn preempt(
        &self,
        replica: &str,
        share: &SlotShare,
        candidates: &[Candidate],
    ) -> Result<Option<String>, StoreError> {
        if candidates.is_empty() {
            return Ok(None);
        }
        let tenants: Vec<String> = self.client.smembers(self.keys.tenants_queued()).await?;
        if tenants.is_empty() {
            return Ok(None);
        }
        let mut keys = vec![
            self.keys.running(),
            self.keys.tenant_of(),
            self.keys.yielding(),
        ];
        keys.extend(tenants.iter().map(|t| self.keys.tenant_queue(t)));
        let mut args = vec![share.cap.to_string(), replica.to_owned()];
        args.extend(tenant_args(tenants, Some(share)));
        args.push(candidates.len().to_string());
        for c in candidates {
            args.push(c.job.clone());
            args.push(share.weight(&c.tenant).to_string());
        }
        let asked: Option<String> = PREEMPT
            .evalsha_with_reload(&self.client, keys, args)
            .await?;
        Ok(asked)
    }

    /// Queues a job that gave its slot back again, by its deadline (`expires_at`), while
    /// `lease` still holds it: the lease and running entry go, and the next claim of it resumes
    /// it from its checkpoint. False when the lease was lost (the new holder goes on with it).
    pub async fn requeue(
        &self,
        lease: &JobLease,
        tenant: &str,
        expires_at: i64,
    ) -> Result<bool, StoreError> {
        let keys = vec![
            self.keys.lease(&lease.job),
            self.keys.running(),
            self.keys.queue(),
            self.keys.tenant_queue(tenant),
            self.keys.tenants_queued(),
            self.keys.yielding(),
        ];
        let args = vec![
            lease.value(),
            lease.job.clone(),
            expires_at.to_string(),
            tenant.to_owned(),
        ];
        let n: i64 = REQUEUE
            .evalsha_with_reload(&self.client, keys, args)
            .await?;
        Ok(n == 1)
    }

    /// How many jobs are queued (not yet claimed).
    pub async fn queued(&self) -> Result<u64, StoreError> {
        let n: u64 = self.client.zcard(self.keys.queue()).await?;
        Ok(n)
    }
}

/// A running job a replica may ask to give its slot back ([`Store::preempt`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The batch id.
    pub job: String,
    /// Its tenant.
    pub tenant: String,
}

/// The arguments naming the queued `tenants` to a script: their count, then the tenants, then
/// their weights under `share` (1 each without one).
fn tenant_args(tenants: Vec<String>, share: Option<&SlotShare>) -> Vec<String> {
    let weights: Vec<String> = tenants
        .iter()
        .map(|t| share.map_or(1, |s| s.weight(t)).to_string())
        .collect();
    let mut args = vec![tenants.len().to_string()];
    args.extend(tenants);
    args.extend(weights);
    args
}
