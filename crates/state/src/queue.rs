//! The job queue: every tenant's queued batches by SLO deadline in one sorted set, each
//! tenant's in one of its own (for the fair share), and the cancel queue of batches whose cancel
//! was asked while they waited.
//!
//! A claim is two scripts: `pick` finds the job to take (reading every queued tenant's queue,
//! each named in its KEYS), `take` takes it under a new lease if it is still queued (another
//! replica may have taken it between the two; then the next is picked).

use std::sync::LazyLock;
use std::time::Duration;

use fred::interfaces::{SetsInterface, SortedSetsInterface};
use fred::types::scripts::Script;

use crate::{millis, JobLease, Store, StoreError};

static PICK: LazyLock<Script> = LazyLock::new(|| Script::from_lua(include_str!("queue/pick.lua")));
static TAKE: LazyLock<Script> = LazyLock::new(|| Script::from_lua(include_str!("queue/take.lua")));

/// How many picks a claim tries when other replicas keep taking the picked job first.
const CLAIM_TRIES: usize = 16;

impl Store {
    /// Takes the most urgent queued job (earliest deadline) for `replica` under a new lease;
    /// when its tenant already runs `share` jobs (0: no share), the most urgent job of a tenant
    /// running fewer, if one waits.
    pub async fn claim_queued(
        &self,
        replica: &str,
        ttl: Duration,
        share: usize,
    ) -> Result<Option<JobLease>, StoreError> {
        self.claim("queue", replica, ttl, share).await
    }

    /// Takes a job whose cancel was asked while it waited in the queue.
    pub async fn claim_cancelled(
        &self,
        replica: &str,
        ttl: Duration,
    ) -> Result<Option<JobLease>, StoreError> {
        self.claim("cancelq", replica, ttl, 0).await
    }

    async fn claim(
        &self,
        queue: &str,
        replica: &str,
        ttl: Duration,
        share: usize,
    ) -> Result<Option<JobLease>, StoreError> {
        for _ in 0..CLAIM_TRIES {
            let Some((id, tenant)) = self.pick(queue, share).await? else {
                return Ok(None);
            };
            let mut keys = vec![
                self.key(&[queue]),
                self.key(&["running"]),
                self.key(&["tenants_queued"]),
                self.key(&["epoch", &id]),
                self.key(&["lease", &id]),
            ];
            if !tenant.is_empty() {
                keys.push(self.key(&["tqueue", &tenant]));
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

    /// The id and tenant ("" for none) of the job to take from `queue`, if any waits.
    async fn pick(
        &self,
        queue: &str,
        share: usize,
    ) -> Result<Option<(String, String)>, StoreError> {
        let tenants: Vec<String> = if share > 0 {
            self.client.smembers(self.key(&["tenants_queued"])).await?
        } else {
            Vec::new()
        };
        let mut keys = vec![
            self.key(&[queue]),
            self.key(&["running"]),
            self.key(&["tenant_of"]),
        ];
        keys.extend(tenants.iter().map(|t| self.key(&["tqueue", t])));
        let mut args = vec![share.to_string()];
        args.extend(tenants);
        let got: Option<(String, String)> =
            PICK.evalsha_with_reload(&self.client, keys, args).await?;
        Ok(got)
    }

    /// How many jobs are queued (not yet claimed).
    pub async fn queued(&self) -> Result<u64, StoreError> {
        let n: u64 = self.client.zcard(self.key(&["queue"])).await?;
        Ok(n)
    }
}
