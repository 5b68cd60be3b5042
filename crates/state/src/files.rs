//! Files: their records, each tenant's listings (all and by purpose), the expiry index and the
//! per-tenant counts the quotas check.

use std::sync::LazyLock;

use fred::interfaces::{ClientLike, KeysInterface};
use fred::types::scripts::Script;
use fred::types::{ClusterHash, CustomCommand, Value};

use crate::{parse, split_more, Cursor, Order, Page, QuotaExceeded, Store, StoreError, StoredFile};

static PUT_FILE: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("files/put_file.lua")));
static DELETE_FILE: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("files/delete_file.lua")));

/// A tenant's limits on stored files; 0 is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FileQuota {
    /// The most bytes of files the tenant may store.
    pub max_bytes: u64,
    /// The most files the tenant may store.
    pub max_files: u64,
}

impl Store {
    /// Stores a file record and lists it, counting it in its tenant's usage whatever the quota
    /// (the service's own result files).
    pub async fn put_file(&self, file: &StoredFile) -> Result<(), StoreError> {
        // Without a quota it is never refused.
        let _ = self.put_file_within(file, &FileQuota::default()).await?;
        Ok(())
    }

    /// Stores a file record and lists it unless its tenant would then be over `quota`, which
    /// is checked and counted in one step (two uploads cannot both pass the last bytes).
    pub async fn put_file_within(
        &self,
        file: &StoredFile,
        quota: &FileQuota,
    ) -> Result<Result<(), QuotaExceeded>, StoreError> {
        let id = &file.file.id;
        let keys = self.file_keys(file);
        let expires = file
            .file
            .expires_at
            .map(|t| t.to_string())
            .unwrap_or_default();
        let json = serde_json::to_string(file).expect("a file record serializes");
        let args = vec![
            id.clone(),
            json,
            expires,
            file.tenant.clone(),
            file.file.bytes.to_string(),
            quota.max_bytes.to_string(),
            quota.max_files.to_string(),
        ];
        let n: i64 = PUT_FILE
            .evalsha_with_reload(&self.client, keys, args)
            .await?;
        Ok(match n {
            -1 => Err(QuotaExceeded::StoredBytes),
            -2 => Err(QuotaExceeded::Files),
            _ => {
                self.mirror_file(file).await?;
                Ok(())
            }
        })
    }

    /// The bytes and files `tenant` has stored.
    pub async fn usage(&self, tenant: &str) -> Result<(u64, u64), StoreError> {
        let bytes: Option<u64> =
            fred::interfaces::HashesInterface::hget(&self.client, self.keys.usage_bytes(), tenant)
                .await?;
        let files: Option<u64> =
            fred::interfaces::HashesInterface::hget(&self.client, self.keys.usage_files(), tenant)
                .await?;
        Ok((bytes.unwrap_or(0), files.unwrap_or(0)))
    }

    /// The file `id`, whoever owns it.
    pub async fn file(&self, id: &str) -> Result<Option<StoredFile>, StoreError> {
        let key = self.keys.file(id);
        let json: Option<String> = self.client.get(&key).await?;
        json.map(|j| parse(&key, &j)).transpose()
    }

    /// Deletes a file's record and listings; false when there was none.
    pub async fn delete_file(&self, file: &StoredFile) -> Result<bool, StoreError> {
        let id = &file.file.id;
        let keys = self.file_keys(file);
        let n: i64 = DELETE_FILE
            .evalsha_with_reload(&self.client, keys, vec![id.clone(), file.tenant.clone()])
            .await?;
        self.unmirror_file(id).await?;
        Ok(n == 1)
    }

    /// A page of `tenant`'s files, optionally of one purpose, after `after`.
    pub async fn list_files(
        &self,
        tenant: &str,
        purpose: Option<&str>,
        after: Option<&Cursor>,
        limit: usize,
        order: Order,
    ) -> Result<Page<StoredFile>, StoreError> {
        let index = match purpose {
            Some(p) => self.keys.files_of_purpose(tenant, p),
            None => self.keys.files(tenant),
        };
        let ids = self.range(&index, after, limit, order).await?;
        let (ids, has_more) = split_more(ids, limit);
        let keys: Vec<String> = ids.iter().map(|id| self.keys.file(id)).collect();
        let data = self.get_all(&keys).await?;
        Ok(Page { data, has_more })
    }

    /// Up to `limit` ids of files whose `expires_at` is past `now`.
    pub async fn expired_files(&self, now: i64, limit: usize) -> Result<Vec<String>, StoreError> {
        let cmd = CustomCommand::new_static("ZRANGE", ClusterHash::FirstKey, false);
        let args = vec![
            Value::from(self.keys.expiry()),
            Value::from("-inf"),
            Value::from(now),
            Value::from("BYSCORE"),
            Value::from("LIMIT"),
            Value::from(0),
            Value::from(limit as i64),
        ];
        let ids: Vec<String> = self.client.custom(cmd, args).await?;
        Ok(ids)
    }

    /// Forgets an expiry entry whose record is already gone.
    pub async fn forget_expiry(&self, id: &str) -> Result<(), StoreError> {
        let cmd = CustomCommand::new_static("ZREM", ClusterHash::FirstKey, false);
        let _: i64 = self
            .client
            .custom(cmd, vec![Value::from(self.keys.expiry()), Value::from(id)])
            .await?;
        Ok(())
    }

    /// The KEYS of the scripts that store and delete `file`'s record: the record, the tenant's
    /// listings, expiry and usage counts.
    fn file_keys(&self, file: &StoredFile) -> Vec<String> {
        vec![
            self.keys.file(&file.file.id),
            self.keys.files(&file.tenant),
            self.keys.files_of_purpose(&file.tenant, &file.file.purpose),
            self.keys.expiry(),
            self.keys.usage_bytes(),
            self.keys.usage_files(),
        ]
    }
}
