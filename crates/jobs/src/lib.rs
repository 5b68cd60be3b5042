//! The batch service's state in Redis: file and batch records, each tenant's listings, the job
//! queue ordered by SLO deadline across all tenants, which replica runs which job, cancel requests.
//!
//! Every key is `{<prefix>}:…`: one hash slot, so the scripts that move a job between the queue
//! and the running set are atomic on Redis Cluster too, and the dispatcher's keys are never
//! touched. Ids sort by creation time (`file-`/`batch_` + 12 hex digits of milliseconds + 12
//! random), so a listing is a lexicographic range and its cursor is the last id of a page.
//!
//! ```no_run
//! # async fn demo(client: fred::clients::Client) -> Result<(), batch_jobs::StoreError> {
//! let store = batch_jobs::Store::new(client, "batch-processor");
//! let page = store.list_batches("tenant-a", None, 20).await?;
//! for batch in page.data {
//!     println!("{} {}", batch.batch.batch.id, batch.batch.status().as_str());
//! }
//! # Ok(()) }
//! ```

mod records;
mod recovery;
mod webhooks;

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use batch_wire::BatchStatus;
use fred::clients::Client;
use fred::interfaces::{ClientLike, KeysInterface};
use fred::types::scripts::Script;
use fred::types::{ClusterHash, CustomCommand, Value};
use serde::de::DeserializeOwned;

pub use records::{
    storage_key, BatchObject, CachedTokens, FileObject, FineCounts, Page, ReasoningTokens,
    StoredBatch, StoredFile, Usage, FINE_COUNTS_KEY,
};
pub use recovery::{RebuildReport, STATE_PREFIX};
pub use webhooks::{Delivery, StoredWebhook, WebhookEndpoint, BATCH_EVENTS};

/// Why a state operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Redis failed or could not be reached.
    #[error("Redis: {0}")]
    Redis(#[from] fred::error::Error),
    /// A record in Redis does not parse (written by another version?).
    #[error("record {key} is not valid: {problem}")]
    Corrupt {
        /// The key.
        key: String,
        /// What is wrong.
        problem: String,
    },
    /// The storage copy of a record could not be written or read (see [`Store::with_mirror`]).
    #[error(transparent)]
    Storage(#[from] batch_storage::StorageError),
}

impl StoreError {
    /// Whether waiting may cure it (Redis down, failing over).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Redis(e) => batch_redis::is_transient(e),
            Self::Corrupt { .. } => false,
            // A store that hiccups (S3 throttling, a network blip) answers again.
            Self::Storage(_) => true,
        }
    }
}

/// Unix seconds now.
pub fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// A new id: `prefix` + 12 hex digits of Unix milliseconds + 12 random ones, so that ids sort
/// by creation time.
pub fn new_id(prefix: &str) -> String {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let random = rand::random::<u64>() & 0xffff_ffff_ffff;
    format!("{prefix}{ms:012x}{random:012x}")
}

/// Which way a listing runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Oldest first.
    Asc,
    /// Newest first.
    Desc,
}

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

/// A replica's hold on a running job. The epoch grows with every new holder, so a replica that
/// lost the job (paused, cut off) cannot write for it any more: fenced writes compare it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The batch id.
    pub job: String,
    /// The holder.
    pub replica: String,
    /// The fencing epoch.
    pub epoch: u64,
}

impl Lease {
    /// The lease key's value.
    pub fn value(&self) -> String {
        format!("{}#{}", self.replica, self.epoch)
    }
}

/// What [`Store::renew`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Renewal {
    /// Leases another replica holds now: their jobs must stop writing here.
    pub lost: Vec<Lease>,
    /// Leases that had lapsed with nobody taking the job (this replica was frozen or cut off
    /// past the lease time), held again.
    pub regained: Vec<Lease>,
}

/// The service's state in Redis.
#[derive(Clone)]
pub struct Store {
    client: Client,
    prefix: String,
    scripts: std::sync::Arc<Scripts>,
    /// Where every record change is also written (the system of record Redis is rebuilt from).
    mirror: Option<batch_storage::Storage>,
    /// The status and lease epoch of each unfinished batch's latest storage copy.
    mirrored:
        std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, (BatchStatus, u64)>>>,
}

struct Scripts {
    put_file: Script,
    delete_file: Script,
    create_batch: Script,
    save_batch: Script,
    claim: Script,
    adopt: Script,
    renew: Script,
    release: Script,
    checkpoint: Script,
    cancel: Script,
    restore_batch: Script,
    unlock: Script,
}

/// KEYS: record, index, purpose index, expiry, usage bytes, usage files. ARGV: id, json,
/// expires_at or "", tenant, bytes, most bytes, most files (each "0": no quota). Counts the
/// tenant's stored bytes and files (a record stored again counts once, at its new size);
/// refused with -1 over the bytes, -2 over the files.
const PUT_FILE_LUA: &str = r#"
local old = redis.call('GET', KEYS[1])
local old_bytes = 0
if old then old_bytes = tonumber(cjson.decode(old)['file']['bytes']) or 0 end
local bytes = tonumber(redis.call('HGET', KEYS[5], ARGV[4]) or '0') - old_bytes + tonumber(ARGV[5])
if ARGV[6] ~= '0' and bytes > tonumber(ARGV[6]) then return -1 end
local files = tonumber(redis.call('HGET', KEYS[6], ARGV[4]) or '0')
if not old and ARGV[7] ~= '0' and files + 1 > tonumber(ARGV[7]) then return -2 end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[5], ARGV[4], math.max(bytes, 0))
if not old then redis.call('HINCRBY', KEYS[6], ARGV[4], 1) end
redis.call('ZADD', KEYS[2], 0, ARGV[1])
redis.call('ZADD', KEYS[3], 0, ARGV[1])
if ARGV[3] ~= '' then redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1]) end
return 1
"#;

/// KEYS: record, index, purpose index, expiry, usage bytes, usage files. ARGV: id, tenant.
/// Returns whether it existed; its bytes and the file leave the tenant's usage.
const DELETE_FILE_LUA: &str = r#"
local old = redis.call('GET', KEYS[1])
local n = redis.call('DEL', KEYS[1])
if old then
  local bytes = tonumber(cjson.decode(old)['file']['bytes']) or 0
  local left = tonumber(redis.call('HGET', KEYS[5], ARGV[2]) or '0') - bytes
  redis.call('HSET', KEYS[5], ARGV[2], math.max(left, 0))
  local files = tonumber(redis.call('HGET', KEYS[6], ARGV[2]) or '0') - 1
  redis.call('HSET', KEYS[6], ARGV[2], math.max(files, 0))
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return n
"#;

/// KEYS: record, index, queue, status counts, active, tenant_of, the tenant's queue, queued
/// tenants. ARGV: id, json, deadline, status, tenant, most unfinished batches ("0": no quota).
/// Refused with -1 when the tenant already has that many unfinished batches.
const CREATE_BATCH_LUA: &str = r#"
if ARGV[6] ~= '0' and tonumber(redis.call('HGET', KEYS[5], ARGV[5]) or '0') >= tonumber(ARGV[6]) then
  return -1
end
if redis.call('SET', KEYS[1], ARGV[2], 'NX') == false then return 0 end
redis.call('ZADD', KEYS[2], 0, ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
redis.call('HINCRBY', KEYS[4], ARGV[4], 1)
redis.call('HINCRBY', KEYS[5], ARGV[5], 1)
redis.call('HSET', KEYS[6], ARGV[1], ARGV[5])
redis.call('ZADD', KEYS[7], ARGV[3], ARGV[1])
redis.call('SADD', KEYS[8], ARGV[5])
return 1
"#;

/// KEYS: record, status counts, lease. ARGV: json, new status, the lease it needs ("" for none).
/// Moves the status count along with the record, reading the old status from the stored record
/// itself. Refused (0) when the writer no longer holds the job's lease.
///
/// KEYS also: active, tenant_of. A batch reaching a final status leaves its tenant's count of
/// unfinished batches, once: only while `tenant_of` still names it; it is then pushed on KEYS[6],
/// the list the webhook sender reads.
const SAVE_BATCH_LUA: &str = r#"
if ARGV[3] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[3] then return 0 end
local old = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1])
if old then
  local was = cjson.decode(old)['batch']['status']
  if was ~= ARGV[2] then
    redis.call('HINCRBY', KEYS[2], was, -1)
    redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
  end
else
  redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
end
local s = ARGV[2]
if s == 'completed' or s == 'failed' or s == 'expired' or s == 'cancelled' then
  local tenant = redis.call('HGET', KEYS[5], ARGV[4])
  if tenant and redis.call('HDEL', KEYS[5], ARGV[4]) == 1 then
    local left = redis.call('HINCRBY', KEYS[4], tenant, -1)
    if left < 0 then redis.call('HSET', KEYS[4], tenant, 0) end
    redis.call('RPUSH', KEYS[6], ARGV[4])
  end
end
return 1
"#;

/// KEYS: a queue, running, tenant_of, queued tenants. ARGV: replica, key prefix, lease ms,
/// share ("0": none). The most urgent job of the queue, now the replica's under a new lease:
/// `{id, epoch}`. When its tenant already runs `share` jobs (on all replicas), the most urgent
/// job of a tenant running fewer goes first, if one waits: one tenant's many queued batches do
/// not keep the others from every slot, and no slot stays idle while any batch waits.
const CLAIM_LUA: &str = r#"
local first = redis.call('ZRANGE', KEYS[1], 0, 0)
if #first == 0 then return false end
local id = first[1]
local share = tonumber(ARGV[4])
local tenant = redis.call('HGET', KEYS[3], id)
if share > 0 and tenant then
  local counts = {}
  for _, r in ipairs(redis.call('HKEYS', KEYS[2])) do
    local t = redis.call('HGET', KEYS[3], r)
    if t then counts[t] = (counts[t] or 0) + 1 end
  end
  if (counts[tenant] or 0) >= share then
    local best, best_at = nil, nil
    for _, t in ipairs(redis.call('SMEMBERS', KEYS[4])) do
      if (counts[t] or 0) < share then
        local head = redis.call('ZRANGE', ARGV[2] .. ':tqueue:' .. t, 0, 0, 'WITHSCORES')
        if #head > 0 and (best_at == nil or tonumber(head[2]) < best_at) then
          best, best_at = head[1], tonumber(head[2])
        end
      end
    end
    if best then id = best end
  end
end
redis.call('ZREM', KEYS[1], id)
local t = redis.call('HGET', KEYS[3], id)
if t then
  local tq = ARGV[2] .. ':tqueue:' .. t
  redis.call('ZREM', tq, id)
  if redis.call('ZCARD', tq) == 0 then redis.call('SREM', KEYS[4], t) end
end
local epoch = redis.call('INCR', ARGV[2] .. ':epoch:' .. id)
redis.call('SET', ARGV[2] .. ':lease:' .. id, ARGV[1] .. '#' .. epoch, 'PX', ARGV[3])
redis.call('HSET', KEYS[2], id, ARGV[1])
return {id, epoch}
"#;

/// KEYS: running, lease, epoch. ARGV: id, replica, lease ms. Takes a running job whose lease
/// lapsed (its replica is gone), or one this replica held in an earlier life; returns the new
/// epoch, which fences every earlier holder.
const ADOPT_LUA: &str = r#"
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return false end
local lease = redis.call('GET', KEYS[2])
if lease and string.match(lease, '^(.*)#') ~= ARGV[2] then return false end
local epoch = redis.call('INCR', KEYS[3])
redis.call('SET', KEYS[2], ARGV[2] .. '#' .. epoch, 'PX', ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return epoch
"#;

/// KEYS: running. ARGV: lease ms, key prefix, then job id and expected lease pairs. Renews each
/// lease still held. A lease that lapsed while nobody took the job (its epoch unchanged, the job
/// still this replica's) is taken again: nobody can have written for it meanwhile, as every other
/// writer would have needed a new epoch. Returns `n + 1` for the lease at position `n` (0-based)
/// that was lost, `-(n + 1)` for one taken again.
const RENEW_LUA: &str = r#"
local out = {}
for i = 3, #ARGV, 2 do
  local id, expected = ARGV[i], ARGV[i + 1]
  local n = math.floor((i - 3) / 2)
  local lease = ARGV[2] .. ':lease:' .. id
  local now = redis.call('GET', lease)
  if now == expected then
    redis.call('PEXPIRE', lease, ARGV[1])
  else
    local replica, epoch = string.match(expected, '^(.*)#(%d+)$')
    if now == false and redis.call('GET', ARGV[2] .. ':epoch:' .. id) == epoch
        and redis.call('HGET', KEYS[1], id) == replica then
      redis.call('SET', lease, expected, 'PX', ARGV[1])
      table.insert(out, -(n + 1))
    else
      table.insert(out, n + 1)
    end
  end
end
return out
"#;

/// KEYS: lease, running (or none). ARGV: expected lease, id. Lets go of a lease still held; with
/// `running`, the job is also no longer anybody's (it ended).
const RELEASE_LUA: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) else
  if KEYS[2] then return 0 end
end
if KEYS[2] then redis.call('HDEL', KEYS[2], ARGV[2]) end
return 1
"#;

/// KEYS: checkpoint, lease. ARGV: json, expected lease. Records a checkpoint while the lease holds.
const CHECKPOINT_LUA: &str = r#"
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"#;

/// KEYS: cancel marker, queue, cancel queue, tenant_of, queued tenants. ARGV: id, now, key
/// prefix.
const CANCEL_LUA: &str = r#"
if redis.call('SET', KEYS[1], ARGV[2], 'NX') == false then return 0 end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('ZADD', KEYS[3], 0, ARGV[1])
  local t = redis.call('HGET', KEYS[4], ARGV[1])
  if t then
    local tq = ARGV[3] .. ':tqueue:' .. t
    redis.call('ZREM', tq, ARGV[1])
    if redis.call('ZCARD', tq) == 0 then redis.call('SREM', KEYS[5], t) end
  end
  return 1
end
return 2
"#;

/// A tenant's limits on stored files; 0 is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FileQuota {
    /// The most bytes of files the tenant may store.
    pub max_bytes: u64,
    /// The most files the tenant may store.
    pub max_files: u64,
}

/// Which of a tenant's quotas a write would exceed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaExceeded {
    /// Queued and running batches.
    Batches,
    /// Bytes of stored files.
    StoredBytes,
    /// Stored files.
    Files,
}

impl Store {
    /// The state under `{prefix}:` in the Redis `client` talks to.
    pub fn new(client: Client, prefix: &str) -> Self {
        Self {
            client,
            prefix: format!("{{{prefix}}}"),
            scripts: std::sync::Arc::new(Scripts {
                put_file: Script::from_lua(PUT_FILE_LUA),
                delete_file: Script::from_lua(DELETE_FILE_LUA),
                create_batch: Script::from_lua(CREATE_BATCH_LUA),
                save_batch: Script::from_lua(SAVE_BATCH_LUA),
                claim: Script::from_lua(CLAIM_LUA),
                adopt: Script::from_lua(ADOPT_LUA),
                renew: Script::from_lua(RENEW_LUA),
                release: Script::from_lua(RELEASE_LUA),
                checkpoint: Script::from_lua(CHECKPOINT_LUA),
                cancel: Script::from_lua(CANCEL_LUA),
                restore_batch: Script::from_lua(recovery::RESTORE_BATCH_LUA),
                unlock: Script::from_lua(recovery::UNLOCK_LUA),
            }),
            mirror: None,
            mirrored: Default::default(),
        }
    }

    /// Also writes every record change to `storage` (after Redis took it, so only a write
    /// its fence let through), from which [`Store::rebuild`] restores a Redis that lost it.
    pub fn with_mirror(mut self, storage: batch_storage::Storage) -> Self {
        self.mirror = Some(storage);
        self
    }

    /// The Redis client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    fn key(&self, parts: &[&str]) -> String {
        let mut key = self.prefix.clone();
        for part in parts {
            key.push(':');
            key.push_str(part);
        }
        key
    }

    /// Whether Redis answers.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let _: Value = self.client.ping(None).await?;
        Ok(())
    }

    // ---- files ----

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
        let keys = vec![
            self.key(&["file", id]),
            self.key(&["files", &file.tenant]),
            self.key(&["files", &file.tenant, &file.file.purpose]),
            self.key(&["expiry"]),
            self.key(&["usage_bytes"]),
            self.key(&["usage_files"]),
        ];
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
        let n: i64 = self
            .scripts
            .put_file
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
        let bytes: Option<u64> = fred::interfaces::HashesInterface::hget(
            &self.client,
            self.key(&["usage_bytes"]),
            tenant,
        )
        .await?;
        let files: Option<u64> = fred::interfaces::HashesInterface::hget(
            &self.client,
            self.key(&["usage_files"]),
            tenant,
        )
        .await?;
        Ok((bytes.unwrap_or(0), files.unwrap_or(0)))
    }

    /// The file `id`, whoever owns it.
    pub async fn file(&self, id: &str) -> Result<Option<StoredFile>, StoreError> {
        let key = self.key(&["file", id]);
        let json: Option<String> = self.client.get(&key).await?;
        json.map(|j| parse(&key, &j)).transpose()
    }

    /// Deletes a file's record and listings; false when there was none.
    pub async fn delete_file(&self, file: &StoredFile) -> Result<bool, StoreError> {
        let id = &file.file.id;
        let keys = vec![
            self.key(&["file", id]),
            self.key(&["files", &file.tenant]),
            self.key(&["files", &file.tenant, &file.file.purpose]),
            self.key(&["expiry"]),
            self.key(&["usage_bytes"]),
            self.key(&["usage_files"]),
        ];
        let n: i64 = self
            .scripts
            .delete_file
            .evalsha_with_reload(&self.client, keys, vec![id.clone(), file.tenant.clone()])
            .await?;
        self.unmirror_file(id).await?;
        Ok(n == 1)
    }

    /// A page of `tenant`'s files, optionally of one purpose, after the id `after`.
    pub async fn list_files(
        &self,
        tenant: &str,
        purpose: Option<&str>,
        after: Option<&str>,
        limit: usize,
        order: Order,
    ) -> Result<Page<StoredFile>, StoreError> {
        let index = match purpose {
            Some(p) => self.key(&["files", tenant, p]),
            None => self.key(&["files", tenant]),
        };
        let ids = self.range(&index, after, limit, order).await?;
        let (ids, has_more) = split_more(ids, limit);
        let keys: Vec<String> = ids.iter().map(|id| self.key(&["file", id])).collect();
        let data = self.get_all(&keys).await?;
        Ok(Page { data, has_more })
    }

    /// Up to `limit` ids of files whose `expires_at` is past `now`.
    pub async fn expired_files(&self, now: i64, limit: usize) -> Result<Vec<String>, StoreError> {
        let cmd = CustomCommand::new_static("ZRANGE", ClusterHash::FirstKey, false);
        let args = vec![
            Value::from(self.key(&["expiry"])),
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
            .custom(
                cmd,
                vec![Value::from(self.key(&["expiry"])), Value::from(id)],
            )
            .await?;
        Ok(())
    }

    // ---- batches ----

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
        let n: i64 = self
            .scripts
            .create_batch
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
            fred::interfaces::HashesInterface::hget(&self.client, self.key(&["active"]), tenant)
                .await?;
        Ok(n.unwrap_or(0))
    }

    /// Replaces a batch's record, as the holder of `lease` (`None`: unfenced, for tools).
    /// Returns false, writing nothing, when the lease is no longer held.
    pub async fn save_batch(
        &self,
        batch: &StoredBatch,
        lease: Option<&Lease>,
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
        let expected = lease.map(Lease::value).unwrap_or_default();
        let n: i64 = self
            .scripts
            .save_batch
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
        let keys = vec![
            self.key(&["cancel", id]),
            self.key(&["queue"]),
            self.key(&["cancelq"]),
            self.key(&["tenant_of"]),
            self.key(&["tenants_queued"]),
        ];
        let n: i64 = self
            .scripts
            .cancel
            .evalsha_with_reload(
                &self.client,
                keys,
                vec![id.to_owned(), now_unix().to_string(), self.prefix.clone()],
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

    /// Takes the most urgent queued job (earliest deadline) for `replica` under a new lease;
    /// when its tenant already runs `share` jobs (0: no share), the most urgent job of a tenant
    /// running fewer, if one waits.
    pub async fn claim_queued(
        &self,
        replica: &str,
        ttl: Duration,
        share: usize,
    ) -> Result<Option<Lease>, StoreError> {
        self.claim("queue", replica, ttl, share).await
    }

    /// Takes a job whose cancel was asked while it waited in the queue.
    pub async fn claim_cancelled(
        &self,
        replica: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        self.claim("cancelq", replica, ttl, 0).await
    }

    async fn claim(
        &self,
        queue: &str,
        replica: &str,
        ttl: Duration,
        share: usize,
    ) -> Result<Option<Lease>, StoreError> {
        let keys = vec![
            self.key(&[queue]),
            self.key(&["running"]),
            self.key(&["tenant_of"]),
            self.key(&["tenants_queued"]),
        ];
        let args = vec![
            replica.to_owned(),
            self.prefix.clone(),
            millis(ttl),
            share.to_string(),
        ];
        let got: Option<(String, u64)> = self
            .scripts
            .claim
            .evalsha_with_reload(&self.client, keys, args)
            .await?;
        Ok(got.map(|(id, epoch)| Lease {
            job: id,
            replica: replica.to_owned(),
            epoch,
        }))
    }

    /// Takes over job `id` if its lease lapsed, or if `replica` held it before (a restart).
    pub async fn adopt(
        &self,
        id: &str,
        replica: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        let keys = vec![
            self.key(&["running"]),
            self.key(&["lease", id]),
            self.key(&["epoch", id]),
        ];
        let args = vec![id.to_owned(), replica.to_owned(), millis(ttl)];
        let epoch: Option<u64> = self
            .scripts
            .adopt
            .evalsha_with_reload(&self.client, keys, args)
            .await?;
        Ok(epoch.map(|epoch| Lease {
            job: id.to_owned(),
            replica: replica.to_owned(),
            epoch,
        }))
    }

    /// Renews `leases`: says which were lost (another replica took the job) and which had
    /// lapsed with nobody taking the job, and are held again.
    pub async fn renew(&self, leases: &[Lease], ttl: Duration) -> Result<Renewal, StoreError> {
        if leases.is_empty() {
            return Ok(Renewal::default());
        }
        let mut args = vec![millis(ttl), self.prefix.clone()];
        for lease in leases {
            args.push(lease.job.clone());
            args.push(lease.value());
        }
        let outcomes: Vec<i64> = self
            .scripts
            .renew
            .evalsha_with_reload(&self.client, vec![self.key(&["running"])], args)
            .await?;
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
    pub async fn hold(&self, lease: &Lease, ttl: Duration) -> Result<bool, StoreError> {
        let renewal = self.renew(std::slice::from_ref(lease), ttl).await?;
        Ok(renewal.lost.is_empty())
    }

    /// Lets go of a lease (a shutdown: another replica may take the job at once).
    pub async fn release_lease(&self, lease: &Lease) -> Result<(), StoreError> {
        let keys = vec![self.key(&["lease", &lease.job])];
        let _: i64 = self
            .scripts
            .release
            .evalsha_with_reload(&self.client, keys, vec![lease.value(), lease.job.clone()])
            .await?;
        Ok(())
    }

    /// Marks a job that ended as nobody's: its lease and running entry go. False when the lease
    /// was lost meanwhile (the new holder finishes it).
    pub async fn release(&self, lease: &Lease) -> Result<bool, StoreError> {
        let keys = vec![self.key(&["lease", &lease.job]), self.key(&["running"])];
        let n: i64 = self
            .scripts
            .release
            .evalsha_with_reload(&self.client, keys, vec![lease.value(), lease.job.clone()])
            .await?;
        Ok(n == 1)
    }

    /// Forgets a running entry whatever its lease (its batch has no record).
    pub async fn forget_running(&self, id: &str) -> Result<(), StoreError> {
        let _: i64 =
            fred::interfaces::HashesInterface::hdel(&self.client, self.key(&["running"]), id)
                .await?;
        Ok(())
    }

    /// Every running job and the replica it was given to.
    pub async fn running(&self) -> Result<BTreeMap<String, String>, StoreError> {
        let all: BTreeMap<String, String> =
            fred::interfaces::HashesInterface::hgetall(&self.client, self.key(&["running"]))
                .await?;
        Ok(all)
    }

    /// Of `ids`, those whose lease lapsed.
    pub async fn unleased(&self, ids: &[String]) -> Result<Vec<String>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = ids.iter().map(|id| self.key(&["lease", id])).collect();
        let values: Vec<Option<String>> = self.client.mget(keys).await?;
        Ok(ids
            .iter()
            .zip(values)
            .filter(|(_, v)| v.is_none())
            .map(|(id, _)| id.clone())
            .collect())
    }

    /// Records job `lease.job`'s latest checkpoint (opaque JSON) while the lease holds.
    pub async fn save_checkpoint(&self, lease: &Lease, json: &str) -> Result<bool, StoreError> {
        let keys = vec![
            self.key(&["checkpoint", &lease.job]),
            self.key(&["lease", &lease.job]),
        ];
        let n: i64 = self
            .scripts
            .checkpoint
            .evalsha_with_reload(&self.client, keys, vec![json.to_owned(), lease.value()])
            .await?;
        if n == 1 {
            self.mirror_checkpoint(&lease.job, json).await?;
        }
        Ok(n == 1)
    }

    /// Job `id`'s latest checkpoint.
    pub async fn checkpoint(&self, id: &str) -> Result<Option<String>, StoreError> {
        let json: Option<String> = self.client.get(self.key(&["checkpoint", id])).await?;
        Ok(json)
    }

    /// Forgets job `id`'s checkpoint (it ended).
    pub async fn forget_checkpoint(&self, id: &str) -> Result<(), StoreError> {
        let _: i64 = self.client.del(self.key(&["checkpoint", id])).await?;
        self.forget_checkpoint_copy(id).await?;
        Ok(())
    }

    /// How many jobs are queued (not yet claimed).
    pub async fn queued(&self) -> Result<u64, StoreError> {
        let n: u64 =
            fred::interfaces::SortedSetsInterface::zcard(&self.client, self.key(&["queue"]))
                .await?;
        Ok(n)
    }

    /// Batches by status, over every tenant.
    pub async fn status_counts(&self) -> Result<BTreeMap<String, i64>, StoreError> {
        let counts: BTreeMap<String, i64> =
            fred::interfaces::HashesInterface::hgetall(&self.client, self.key(&["status_counts"]))
                .await?;
        Ok(counts)
    }

    // ---- helpers ----

    async fn range(
        &self,
        index: &str,
        after: Option<&str>,
        limit: usize,
        order: Order,
    ) -> Result<Vec<String>, StoreError> {
        let (cmd, from, to) = match (order, after) {
            (Order::Asc, None) => ("ZRANGEBYLEX", "-".to_owned(), "+".to_owned()),
            (Order::Asc, Some(a)) => ("ZRANGEBYLEX", format!("({a}"), "+".to_owned()),
            (Order::Desc, None) => ("ZREVRANGEBYLEX", "+".to_owned(), "-".to_owned()),
            (Order::Desc, Some(a)) => ("ZREVRANGEBYLEX", format!("({a}"), "-".to_owned()),
        };
        let cmd = CustomCommand::new_static(cmd, ClusterHash::FirstKey, false);
        let args = vec![
            Value::from(index),
            Value::from(from),
            Value::from(to),
            Value::from("LIMIT"),
            Value::from(0),
            Value::from(limit as i64 + 1),
        ];
        let ids: Vec<String> = self.client.custom(cmd, args).await?;
        Ok(ids)
    }

    async fn get_all<T: DeserializeOwned>(&self, keys: &[String]) -> Result<Vec<T>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let values: Vec<Option<String>> = self.client.mget(keys.to_vec()).await?;
        keys.iter()
            .zip(values)
            .filter_map(|(k, v)| v.map(|v| parse(k, &v)))
            .collect()
    }
}

fn millis(d: Duration) -> String {
    d.as_millis().max(1).to_string()
}

fn split_more(mut ids: Vec<String>, limit: usize) -> (Vec<String>, bool) {
    let more = ids.len() > limit;
    ids.truncate(limit);
    (ids, more)
}

fn parse<T: DeserializeOwned>(key: &str, json: &str) -> Result<T, StoreError> {
    serde_json::from_str(json).map_err(|e| StoreError::Corrupt {
        key: key.to_owned(),
        problem: e.to_string(),
    })
}

#[cfg(test)]
mod tests;
