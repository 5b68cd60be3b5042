//! Leases: which replica runs which job, under a fencing epoch that grows with every new
//! holder, renewed while the job runs and adopted by another replica when it lapses.

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::time::Duration;

use fred::interfaces::{HashesInterface, KeysInterface};
use fred::types::scripts::Script;

use crate::{millis, Store, StoreError};

static ADOPT: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("leases/adopt.lua")));
static RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("leases/renew.lua")));
static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("leases/release.lua")));

/// A replica's hold on a running job. The epoch grows with every new holder, so a replica that
/// lost the job (paused, cut off) cannot write for it any more: fenced writes compare it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobLease {
    /// The batch id.
    pub job: String,
    /// The holder.
    pub replica: String,
    /// The fencing epoch.
    pub epoch: u64,
}

impl JobLease {
    /// The lease key's value.
    pub fn value(&self) -> String {
        format!("{}#{}", self.replica, self.epoch)
    }
}

/// What [`Store::renew`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Renewal {
    /// Leases another replica holds now: their jobs must stop writing here.
    pub lost: Vec<JobLease>,
    /// Leases that had lapsed with nobody taking the job (this replica was frozen or cut off
    /// past the lease time), held again.
    pub regained: Vec<JobLease>,
}

impl Store {
    /// Takes over job `id` if its lease lapsed, or if `replica` held it before (a restart).
    pub async fn adopt(
        &self,
        id: &str,
        replica: &str,
        ttl: Duration,
    ) -> Result<Option<JobLease>, StoreError> {
        let keys = vec![
            self.keys.running(),
            self.keys.lease(id),
            self.keys.epoch(id),
        ];
        let args = vec![id.to_owned(), replica.to_owned(), millis(ttl)];
        let epoch: Option<u64> = ADOPT.evalsha_with_reload(&self.client, keys, args).await?;
        Ok(epoch.map(|epoch| JobLease {
            job: id.to_owned(),
            replica: replica.to_owned(),
            epoch,
        }))
    }

    /// Renews `leases`: says which were lost (another replica took the job) and which had
    /// lapsed with nobody taking the job, and are held again.
    pub async fn renew(&self, leases: &[JobLease], ttl: Duration) -> Result<Renewal, StoreError> {
        if leases.is_empty() {
            return Ok(Renewal::default());
        }
        let mut keys = vec![self.keys.running()];
        let mut args = vec![millis(ttl)];
        for lease in leases {
            keys.push(self.keys.lease(&lease.job));
            keys.push(self.keys.epoch(&lease.job));
            args.push(lease.job.clone());
            args.push(lease.value());
        }
        let outcomes: Vec<i64> = RENEW.evalsha_with_reload(&self.client, keys, args).await?;
        let mut renewal = Renewal::default();
        for outcome in outcomes {
            let at = |n: i64| leases.get(n.unsigned_abs() as usize - 1).cloned();
            match outcome {
                n if n > 0 => renewal.lost.extend(at(n)),
                n if n < 0 => renewal.regained.extend(at(n)),
                _ => {}
            }
        }
        Ok(renewal)
    }

    /// Renews one lease, taking it again if it lapsed while nobody took the job: false when
    /// another replica holds the job now.
    pub async fn hold(&self, lease: &JobLease, ttl: Duration) -> Result<bool, StoreError> {
        let renewal = self.renew(std::slice::from_ref(lease), ttl).await?;
        Ok(renewal.lost.is_empty())
    }

    /// Lets go of a lease (a shutdown: another replica may take the job at once).
    pub async fn release_lease(&self, lease: &JobLease) -> Result<(), StoreError> {
        let keys = vec![self.keys.lease(&lease.job)];
        let _: i64 = RELEASE
            .evalsha_with_reload(&self.client, keys, vec![lease.value(), lease.job.clone()])
            .await?;
        Ok(())
    }

    /// Marks a job that ended as nobody's: its lease and running entry go. False when the lease
    /// was lost meanwhile (the new holder finishes it).
    pub async fn release(&self, lease: &JobLease) -> Result<bool, StoreError> {
        let keys = vec![self.keys.lease(&lease.job), self.keys.running()];
        let n: i64 = RELEASE
            .evalsha_with_reload(&self.client, keys, vec![lease.value(), lease.job.clone()])
            .await?;
        Ok(n == 1)
    }

    /// Forgets a running entry whatever its lease (its batch has no record).
    pub async fn forget_running(&self, id: &str) -> Result<(), StoreError> {
        let _: i64 = HashesInterface::hdel(&self.client, self.keys.running(), id).await?;
        Ok(())
    }

    /// Every running job and the replica it was given to.
    pub async fn running(&self) -> Result<BTreeMap<String, String>, StoreError> {
        let all: BTreeMap<String, String> =
            HashesInterface::hgetall(&self.client, self.keys.running()).await?;
        Ok(all)
    }

    /// Of `ids`, those whose lease lapsed.
    pub async fn unleased(&self, ids: &[String]) -> Result<Vec<String>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = ids.iter().map(|id| self.keys.lease(id)).collect();
        let values: Vec<Option<String>> = self.client.mget(keys).await?;
        Ok(ids
            .iter()
            .zip(values)
            .filter(|(_, v)| v.is_none())
            .map(|(id, _)| id.clone())
            .collect())
    }
}
