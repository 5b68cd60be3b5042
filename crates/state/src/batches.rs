//! Batches: their records, each tenant's listing, the counts by status and of each tenant's
//! unfinished batches, and cancel requests.

use std::sync::LazyLock;

use batch_wire::BatchStatus;
use fred::interfaces::{HashesInterface, KeysInterface};
use fred::types::scripts::Script;

use crate::{
    now_unix, parse, split_more, JobLease, Order, Page, QuotaExceeded, Store, StoreError,
    StoredBatch,
};

static CREATE_BATCH: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("batches/create_batch.lua")));
static SAVE_BATCH: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("batches/save_batch.lua")));
static CANCEL: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("batches/cancel.lua")));

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
    /// Stores a new batch, lists it and queues it by its deadline (`expires_at`).
    pub async fn create_batch(&self, batch: &StoredBatch) -> Result<(), StoreError> {
        // Without a quota it is never refused.
        let _ = self.create_batch_within(batch, 0).await?;
        Ok(())
    }

    /// Like [`Store::create_batch`], unless the tenant already has `max_unfinished` batches
    /// queued or running (0: no quota), checked and counted in one step.
    pub async fn create_batch_within(
        &self,
        batch: &StoredBatch,
        max_unfinished: u64,
    ) -> Result<Result<(), QuotaExceeded>, StoreError> {
        let b = &batch.batch.batch;
        let keys = vec![
            self.key(&["batch", &b.id]),
            self.key(&["batches", &batch.tenant]),
            self.key(&["queue"]),
            self.key(&["status_counts"]),
            self.key(&["active"]),
            self.key(&["tenant_of"]),
            self.key(&["tqueue", &batch.tenant]),
            self.key(&["tenants_queued"]),
        ];
        let json = serde_json::to_string(batch).expect("a batch record serializes");
        let args = vec![
            b.id.clone(),
            json,
            b.expires_at.to_string(),
            b.status.as_str().to_owned(),
            batch.tenant.clone(),
            max_unfinished.to_string(),
        ];
        let n: i64 = CREATE_BATCH
            .evalsha_with_reload(&self.client, keys, args)
            .await?;
        Ok(match n {
            -1 => Err(QuotaExceeded::Batches),
            0 => Ok(()),
            _ => {
                self.mirror_batch(batch, None).await?;
                Ok(())
            }
        })
    }

    /// How many batches `tenant` has queued or running.
    pub async fn unfinished(&self, tenant: &str) -> Result<u64, StoreError> {
        let n: Option<u64> =
            HashesInterface::hget(&self.client, self.key(&["active"]), tenant).await?;
        Ok(n.unwrap_or(0))
    }

    /// Replaces a batch's record, as the holder of `lease` (`None`: unfenced, for tools).
    /// Returns false, writing nothing, when the lease is no longer held.
    pub async fn save_batch(
        &self,
        batch: &StoredBatch,
        lease: Option<&JobLease>,
    ) -> Result<bool, StoreError> {
        let b = &batch.batch.batch;
        let keys = vec![
            self.key(&["batch", &b.id]),
            self.key(&["status_counts"]),
            self.key(&["lease", &b.id]),
            self.key(&["active"]),
            self.key(&["tenant_of"]),
            self.webhook_ended_key(),
        ];
        let json = serde_json::to_string(batch).expect("a batch record serializes");
        let expected = lease.map(JobLease::value).unwrap_or_default();
        let n: i64 = SAVE_BATCH
            .evalsha_with_reload(
                &self.client,
                keys,
                vec![json, b.status.as_str().to_owned(), expected, b.id.clone()],
            )
            .await?;
        if n == 1 {
            self.mirror_batch(batch, lease).await?;
        }
        Ok(n == 1)
    }

    /// The batch `id` as the API shows it: a pending cancel request shows as `cancelling`.
    pub async fn batch(&self, id: &str) -> Result<Option<StoredBatch>, StoreError> {
        Ok(self.batches(&[id.to_owned()]).await?.pop().flatten())
    }

    /// The batches `ids` (`None` for those that do not exist), cancel requests applied.
    pub async fn batches(&self, ids: &[String]) -> Result<Vec<Option<StoredBatch>>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut keys: Vec<String> = ids.iter().map(|id| self.key(&["batch", id])).collect();
        keys.extend(ids.iter().map(|id| self.key(&["cancel", id])));
        let values: Vec<Option<String>> = self.client.mget(keys.clone()).await?;
        let (records, cancels) = values.split_at(ids.len());
        let mut out = Vec::with_capacity(ids.len());
        for ((key, record), cancel) in keys.iter().zip(records).zip(cancels) {
            let Some(json) = record else {
                out.push(None);
                continue;
            };
            let mut batch: StoredBatch = parse(key, json)?;
            if let Some(at) = cancel.as_deref().and_then(|c| c.parse::<i64>().ok()) {
                let b = &mut batch.batch.batch;
                if !b.status.is_terminal() && b.status != BatchStatus::Cancelling {
                    b.set_status(BatchStatus::Cancelling, at);
                }
            }
            out.push(Some(batch));
        }
        Ok(out)
    }

    /// A page of `tenant`'s batches, newest first, after the id `after`.
    pub async fn list_batches(
        &self,
        tenant: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Page<StoredBatch>, StoreError> {
        let index = self.key(&["batches", tenant]);
        let ids = self.range(&index, after, limit, Order::Desc).await?;
        let (ids, has_more) = split_more(ids, limit);
        let data = self.batches(&ids).await?.into_iter().flatten().collect();
        Ok(Page { data, has_more })
    }

    /// Asks for batch `id` to be cancelled. A job still waiting in the queue moves to the cancel
    /// queue, which runners take from without waiting for a free slot.
    pub async fn request_cancel(&self, id: &str) -> Result<CancelRequest, StoreError> {
        // A batch's tenant never changes: read first, its queue's key goes in KEYS.
        let tenant: Option<String> =
            HashesInterface::hget(&self.client, self.key(&["tenant_of"]), id).await?;
        let mut keys = vec![
            self.key(&["cancel", id]),
            self.key(&["queue"]),
            self.key(&["cancelq"]),
            self.key(&["tenant_of"]),
            self.key(&["tenants_queued"]),
        ];
        keys.extend(tenant.map(|t| self.key(&["tqueue", &t])));
        let n: i64 = CANCEL
            .evalsha_with_reload(
                &self.client,
                keys,
                vec![id.to_owned(), now_unix().to_string()],
            )
            .await?;
        if n != 0 {
            self.mirror_cancel(id).await?;
        }
        Ok(match n {
            0 => CancelRequest::Already,
            1 => CancelRequest::WasQueued,
            _ => CancelRequest::WasRunning,
        })
    }

    /// Whether a cancel of batch `id` was asked for.
    pub async fn cancel_requested(&self, id: &str) -> Result<bool, StoreError> {
        let n: i64 = self.client.exists(self.key(&["cancel", id])).await?;
        Ok(n == 1)
    }
}
