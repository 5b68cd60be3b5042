//! Batches: their records, each tenant's listing, the counts by status and of each tenant's
//! unfinished batches. Their status moves in [`crate::status`].

use std::sync::LazyLock;

use fred::interfaces::{HashesInterface, KeysInterface};
use fred::types::scripts::Script;

use crate::{
    parse_batch, split_more, Cursor, JobLease, Order, Page, QuotaExceeded, Store, StoreError,
    StoredBatch,
};

static CREATE_BATCH: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("batches/create_batch.lua")));
static SAVE_BATCH: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("batches/save_batch.lua")));

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
        let b = batch;
        let keys = vec![
            self.keys.batch(&b.id),
            self.keys.batches(&batch.tenant),
            self.keys.queue(),
            self.keys.status_counts(),
            self.keys.active(),
            self.keys.tenant_of(),
            self.keys.tenant_queue(&batch.tenant),
            self.keys.tenants_queued(),
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
            HashesInterface::hget(&self.client, self.keys.active(), tenant).await?;
        Ok(n.unwrap_or(0))
    }

    /// Replaces a batch's record, as the holder of `lease` (`None`: unfenced), in Redis and its
    /// storage copy; only [`Store::advance`] calls it. Returns 1 when saved, 0 (nothing written)
    /// when the lease is no longer held, 2 when the batch is cancelling and `batch` would move
    /// it back (see `save_batch.lua`).
    pub(crate) async fn save_batch(
        &self,
        batch: &StoredBatch,
        lease: Option<&JobLease>,
    ) -> Result<i64, StoreError> {
        let b = batch;
        let keys = vec![
            self.keys.batch(&b.id),
            self.keys.status_counts(),
            self.keys.lease(&b.id),
            self.keys.active(),
            self.keys.tenant_of(),
            self.keys.webhook_ended(),
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
        Ok(n)
    }

    /// The batch `id`, as stored.
    pub async fn batch(&self, id: &str) -> Result<Option<StoredBatch>, StoreError> {
        Ok(self.batch_json(id).await?.map(|(_, b)| b))
    }

    /// The batch `id` and its record's JSON as stored.
    pub(crate) async fn batch_json(
        &self,
        id: &str,
    ) -> Result<Option<(String, StoredBatch)>, StoreError> {
        let key = self.keys.batch(id);
        let json: Option<String> = self.client.get(&key).await?;
        json.map(|j| parse_batch(&key, &j).map(|b| (j, b)))
            .transpose()
    }

    /// The batches `ids` (`None` for those that do not exist), as stored.
    pub async fn batches(&self, ids: &[String]) -> Result<Vec<Option<StoredBatch>>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = ids.iter().map(|id| self.keys.batch(id)).collect();
        let values: Vec<Option<String>> = self.client.mget(keys.clone()).await?;
        keys.iter()
            .zip(values)
            .map(|(key, json)| json.map(|j| parse_batch(key, &j)).transpose())
            .collect()
    }

    /// A page of `tenant`'s batches, newest first, after `after`.
    pub async fn list_batches(
        &self,
        tenant: &str,
        after: Option<&Cursor>,
        limit: usize,
    ) -> Result<Page<StoredBatch>, StoreError> {
        let index = self.keys.batches(tenant);
        let ids = self.range(&index, after, limit, Order::Desc).await?;
        let (ids, has_more) = split_more(ids, limit);
        let data = self.batches(&ids).await?.into_iter().flatten().collect();
        Ok(Page { data, has_more })
    }

    /// Whether a cancel of batch `id` was asked for.
    pub async fn cancel_requested(&self, id: &str) -> Result<bool, StoreError> {
        let n: i64 = self.client.exists(self.keys.cancel(id)).await?;
        Ok(n == 1)
    }
}
