#![doc = include_str!("../README.md")]

mod batches;
mod checkpoints;
mod files;
mod keys;
pub mod layout;
mod leases;
mod queue;
mod records;
mod recovery;
mod status;
mod webhooks;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use batch_wire::BatchStatus;
use fred::clients::Client;
use fred::interfaces::{ClientLike, KeysInterface, SortedSetsInterface};
use fred::types::{ClusterHash, CustomCommand, Value};
use serde::de::DeserializeOwned;

pub use batch_wire::{CachedTokens, ReasoningTokens, Usage};
pub use files::FileQuota;
pub use keys::StateKeys;
pub use layout::STATE_PREFIX;
pub use leases::{JobLease, Renewal};
pub use queue::{Candidate, SlotShare};
pub use records::{
    BatchObject, Counts, FileObject, FineCounts, Page, StatusTimes, StoredBatch, StoredFile,
    FINE_COUNTS_KEY,
};
pub use recovery::RebuildReport;
pub use status::{Advance, CancelRequest, Change};
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
    /// A listing's `after` names no object of that listing.
    #[error("no object {0:?} to list after")]
    UnknownCursor(String),
}

impl StoreError {
    /// Whether waiting may cure it (Redis down, failing over).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Redis(e) => batch_redis::is_transient(e),
            Self::Corrupt { .. } | Self::UnknownCursor(_) => false,
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

/// Where a page of a listing starts: OpenAI's `after` is an object id (its SDKs' auto-pagination
/// passes the last id seen), the batch gateway's a number of objects to skip; both are accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cursor {
    /// Just past the object with this id, which must be in the listing.
    Id(String),
    /// Past the first this many objects.
    Offset(u64),
}

impl Cursor {
    /// Reads an `after` value: all digits is an offset (no object id is all digits), anything
    /// else an id.
    pub fn parse(text: &str) -> Self {
        match text.parse::<u64>() {
            Ok(n) if text.bytes().all(|b| b.is_ascii_digit()) => Self::Offset(n),
            _ => Self::Id(text.to_owned()),
        }
    }
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

/// The service's state in Redis.
#[derive(Clone)]
pub struct Store {
    client: Client,
    keys: StateKeys,
    /// Where every record change is also written (the system of record Redis is rebuilt from).
    mirror: Option<batch_storage::Storage>,
    /// The status and lease epoch of each unfinished batch's latest storage copy.
    mirrored: Arc<Mutex<HashMap<String, (BatchStatus, u64)>>>,
}

impl Store {
    /// The state under `{prefix}:` in the Redis `client` talks to.
    pub fn new(client: Client, prefix: &str) -> Self {
        Self {
            client,
            keys: StateKeys::new(prefix),
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

    /// The names of its keys in Redis.
    pub fn keys(&self) -> &StateKeys {
        &self.keys
    }

    /// Whether the client holds a connection to Redis now. False from the moment a connection
    /// drops until it is made again: callers that should not wait out a reconnection (an API
    /// request, a scrape) answer at once instead.
    pub fn is_connected(&self) -> bool {
        fred::interfaces::ClientLike::is_connected(&self.client)
    }

    /// Whether Redis answers.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let _: Value = self.client.ping(None).await?;
        Ok(())
    }

    /// Batches by status, over every tenant.
    pub async fn status_counts(&self) -> Result<BTreeMap<String, i64>, StoreError> {
        let counts: BTreeMap<String, i64> =
            fred::interfaces::HashesInterface::hgetall(&self.client, self.keys.status_counts())
                .await?;
        Ok(counts)
    }

    /// Up to `limit + 1` ids of the sorted set `index` after `after`, in `order`; an id cursor
    /// that is not in the set is [`StoreError::UnknownCursor`] (rather than a page that silently
    /// starts over or comes back empty).
    async fn range(
        &self,
        index: &str,
        after: Option<&Cursor>,
        limit: usize,
        order: Order,
    ) -> Result<Vec<String>, StoreError> {
        let (mut from, to) = match order {
            Order::Asc => ("-".to_owned(), "+".to_owned()),
            Order::Desc => ("+".to_owned(), "-".to_owned()),
        };
        let mut skip = 0;
        match after {
            None => {}
            Some(Cursor::Offset(n)) => skip = i64::try_from(*n).unwrap_or(i64::MAX),
            Some(Cursor::Id(id)) => {
                let score: Option<f64> = self.client.zscore(index, id.as_str()).await?;
                if score.is_none() {
                    return Err(StoreError::UnknownCursor(id.clone()));
                }
                // Exclusive of the cursor itself, whichever way the listing runs.
                from = format!("({id}");
            }
        }
        let cmd = match order {
            Order::Asc => "ZRANGEBYLEX",
            Order::Desc => "ZREVRANGEBYLEX",
        };
        let cmd = CustomCommand::new_static(cmd, ClusterHash::FirstKey, false);
        let args = vec![
            Value::from(index),
            Value::from(from),
            Value::from(to),
            Value::from("LIMIT"),
            Value::from(skip),
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
    serde_json::from_str(json).map_err(|e| corrupt(key, e))
}

/// A batch record, in either shape it was stored in (see [`StoredBatch::from_json`]).
fn parse_batch(key: &str, json: &str) -> Result<StoredBatch, StoreError> {
    StoredBatch::from_json(json).map_err(|e| corrupt(key, e))
}

fn corrupt(key: &str, e: serde_json::Error) -> StoreError {
    StoreError::Corrupt {
        key: key.to_owned(),
        problem: e.to_string(),
    }
}

#[cfg(test)]
mod tests;
