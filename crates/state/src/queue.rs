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
            tenants.len().to_string(),
        ];
        let weights: Vec<String> = tenants
            .iter()
            .map(|t| share.map_or(1, |s| s.weight(t)).to_string())
            .collect();
        args.extend(tenants);
        args.extend(weights);
        let got: Option<(String, String)> =
            PICK.evalsha_with_reload(&self.client, keys, args).await?;
        Ok(got)
    }

    /// How many jobs are queued (not yet claimed).
    pub async fn queued(&self) -> Result<u64, StoreError> {
        let n: u64 = self.client.zcard(self.keys.queue()).await?;
        Ok(n)
    }
}
