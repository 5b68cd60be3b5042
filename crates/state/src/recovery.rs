//! Storage as the system of record: every change of a file or batch record, cancel request and
//! checkpoint record the [`Store`] writes to Redis is also written to storage, after Redis took
//! it (so only writes that passed their lease fence land there). A Redis that lost the service's
//! state (flushed, evicted, restarted empty) is rebuilt from that copy by [`Store::rebuild`].
//!
//! Its keys are in [`crate::layout`].
//!
//! Listings need no stored score: ids sort by creation time and every listing is a
//! lexicographic range over them, so the same ids give the same pages and `after` cursors.
//!
//! Loss is detected by a marker key, `{prefix}:state`, holding a generation id written when the
//! state was (re)built: when it is gone, so is everything else written before.

use std::sync::LazyLock;
use std::time::Duration;

use batch_storage::{Storage, StorageError};
use batch_wire::BatchStatus;
use bytes::Bytes;
use fred::interfaces::KeysInterface;
use fred::types::scripts::Script;
use fred::types::{Expiration, SetOptions, Value};
use serde::{Deserialize, Serialize};

use crate::{layout, new_id, JobLease, Store, StoreError, StoredBatch, StoredFile};

static RESTORE_BATCH: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("recovery/restore_batch.lua")));
static UNLOCK: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("recovery/unlock.lua")));

/// A batch record's storage copy.
#[derive(Debug, Serialize, Deserialize)]
struct BatchCopy {
    /// The lease epoch of the write that made it (0: unfenced).
    epoch: u64,
    /// The record, in either shape it was stored in (see [`StoredBatch::from_json`]).
    #[serde(deserialize_with = "any_shape")]
    record: StoredBatch,
}

fn any_shape<'de, D: serde::Deserializer<'de>>(d: D) -> Result<StoredBatch, D::Error> {
    let raw = Box::<serde_json::value::RawValue>::deserialize(d)?;
    StoredBatch::from_json(raw.get()).map_err(serde::de::Error::custom)
}

/// What [`Store::rebuild`] found in storage and put back.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RebuildReport {
    /// File records put back.
    pub files: usize,
    /// Batch records put back (every status).
    pub batches: usize,
    /// Of those, batches that had ended.
    pub finished: usize,
    /// Batches queued again (not started).
    pub queued: usize,
    /// Started batches put back to be resumed from their checkpoint.
    pub resumed: usize,
    /// Of the unfinished batches, those with a cancel asked.
    pub cancelling: usize,
    /// Records already in Redis (written after the loss), left as they are.
    pub present: usize,
    /// Copies that did not parse, skipped.
    pub unreadable: usize,
}

async fn read_opt(storage: &Storage, key: &str) -> Result<Option<Bytes>, StorageError> {
    match storage.get_bytes(key).await {
        Ok(b) => Ok(Some(b)),
        Err(StorageError::NotFound(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

async fn put_batch_copy(m: &Storage, record: &StoredBatch, epoch: u64) -> Result<(), StoreError> {
    let copy = BatchCopy {
        epoch,
        record: record.clone(),
    };
    let key = layout::batch_copy(&record.id);
    m.put_bytes(&key, json(&copy)).await?;
    Ok(())
}

fn json(value: &impl Serialize) -> Bytes {
    Bytes::from(serde_json::to_vec(value).expect("a record serializes"))
}

impl Store {
    pub(crate) async fn mirror_file(&self, file: &StoredFile) -> Result<(), StoreError> {
        if let Some(m) = &self.mirror {
            m.put_bytes(&layout::file_copy(&file.file.id), json(file))
                .await?;
        }
        Ok(())
    }

    pub(crate) async fn unmirror_file(&self, id: &str) -> Result<(), StoreError> {
        if let Some(m) = &self.mirror {
            m.delete(&layout::file_copy(id)).await?;
        }
        Ok(())
    }

    pub(crate) async fn mirror_batch(
        &self,
        batch: &StoredBatch,
        lease: Option<&JobLease>,
    ) -> Result<(), StoreError> {
        let Some(m) = &self.mirror else {
            return Ok(());
        };
        let id = &batch.id;
        let status = batch.status;
        let epoch = lease.map_or(0, |l| l.epoch);
        {
            // Progress saves (every half second) change only counts, which a resume takes from
            // the checkpoint: one PUT per status and lease, not per save.
            let mut last = self.mirrored.lock().expect("mirrored lock");
            if status.is_terminal() {
                last.remove(id);
            } else if last.insert(id.clone(), (status, epoch)) == Some((status, epoch)) {
                return Ok(());
            }
        }
        put_batch_copy(m, batch, epoch).await?;
        if batch.status.is_terminal() {
            // An ended batch's cancel request means nothing any more.
            m.delete(&layout::cancel_copy(id)).await?;
        }
        Ok(())
    }

    /// Copies a cancel request and the `cancelling` record it made, under the job's lease
    /// `epoch` (0: never claimed).
    pub(crate) async fn mirror_cancel(
        &self,
        id: &str,
        record: &StoredBatch,
        epoch: u64,
    ) -> Result<(), StoreError> {
        if let Some(m) = &self.mirror {
            let at = crate::now_unix().to_string();
            m.put_bytes(&layout::cancel_copy(id), Bytes::from(at))
                .await?;
            put_batch_copy(m, record, epoch).await?;
        }
        Ok(())
    }

    pub(crate) async fn mirror_checkpoint(&self, id: &str, json: &str) -> Result<(), StoreError> {
        if let Some(m) = &self.mirror {
            m.put_bytes(&layout::checkpoint_copy(id), Bytes::from(json.to_owned()))
                .await?;
        }
        Ok(())
    }

    pub(crate) async fn forget_checkpoint_copy(&self, id: &str) -> Result<(), StoreError> {
        if let Some(m) = &self.mirror {
            m.delete(&layout::checkpoint_copy(id)).await?;
        }
        Ok(())
    }

    /// The generation of the state Redis holds: `None` when the marker is gone, and with it
    /// (flushed, evicted, restarted empty) everything the service wrote before.
    pub async fn state_generation(&self) -> Result<Option<String>, StoreError> {
        let g: Option<String> = self.client.get(self.keys.state()).await?;
        Ok(g)
    }

    /// Writes a new state generation (after a rebuild, or on a first start) and returns it.
    pub async fn mark_state(&self) -> Result<String, StoreError> {
        let generation = new_id("gen_");
        let _: Value = self
            .client
            .set(self.keys.state(), generation.as_str(), None, None, false)
            .await?;
        Ok(generation)
    }

    /// Takes the rebuild lock for `holder` for `ttl` (one replica rebuilds at a time); false
    /// when another holds it.
    pub async fn lock_rebuild(&self, holder: &str, ttl: Duration) -> Result<bool, StoreError> {
        let got: Option<String> = self
            .client
            .set(
                self.keys.rebuild_lock(),
                holder,
                Some(Expiration::PX(ttl.as_millis().max(1) as i64)),
                Some(SetOptions::NX),
                false,
            )
            .await?;
        Ok(got.is_some())
    }

    /// Lets go of the rebuild lock if `holder` still holds it.
    pub async fn unlock_rebuild(&self, holder: &str) -> Result<(), StoreError> {
        let _: i64 = UNLOCK
            .evalsha_with_reload(
                &self.client,
                vec![self.keys.rebuild_lock()],
                vec![holder.to_owned()],
            )
            .await?;
        Ok(())
    }

    /// Puts back, from `storage`'s copy, every file and batch record with its listings, the
    /// file expiry index, the quotas' counts, the job queue and cancel requests: batches not
    /// started are queued again, started ones are left for a replica to adopt and resume from
    /// their checkpoint. Records Redis already has are left as they are, so a rebuild may run
    /// again. Call it under [`Store::lock_rebuild`].
    pub async fn rebuild(&self, storage: &Storage) -> Result<RebuildReport, StoreError> {
        let mut report = RebuildReport::default();
        // The copies exist already: writing them again would only cost.
        let plain = Store {
            mirror: None,
            ..self.clone()
        };
        for key in storage.list(&layout::file_copies()).await? {
            let Some(bytes) = read_opt(storage, &key).await? else {
                continue;
            };
            let Ok(file) = serde_json::from_slice::<StoredFile>(&bytes) else {
                tracing::warn!(key, "an unreadable file record copy; skipped");
                report.unreadable += 1;
                continue;
            };
            if plain.file(&file.file.id).await?.is_some() {
                report.present += 1;
                continue;
            }
            plain.put_file(&file).await?;
            report.files += 1;
        }
        for key in storage.list(&layout::batch_copies()).await? {
            let Some(bytes) = read_opt(storage, &key).await? else {
                continue;
            };
            let Ok(copy) = serde_json::from_slice::<BatchCopy>(&bytes) else {
                tracing::warn!(key, "an unreadable batch record copy; skipped");
                report.unreadable += 1;
                continue;
            };
            self.restore_batch(storage, layout::id_of_copy(&key), copy, &mut report)
                .await?;
        }
        tracing::info!(?report, "rebuilt the service's state from storage");
        Ok(report)
    }

    async fn restore_batch(
        &self,
        storage: &Storage,
        id: &str,
        copy: BatchCopy,
        report: &mut RebuildReport,
    ) -> Result<(), StoreError> {
        let record = &copy.record;
        if record.id != id {
            report.unreadable += 1;
            return Ok(());
        }
        let terminal = record.status.is_terminal();
        let (cancel, checkpoint) = match terminal {
            true => (None, None),
            false => unfinished_copies(storage, id).await?,
        };
        let checkpoint_epoch = checkpoint
            .as_deref()
            .and_then(|c| serde_json::from_str::<serde_json::Value>(c).ok())
            .and_then(|v| v.get("epoch").and_then(|e| e.as_u64()))
            .unwrap_or(0);
        let floor = copy.epoch.max(checkpoint_epoch) + 1;
        let mode = restore_mode(&copy, checkpoint_epoch, cancel.is_some());
        let args = vec![
            id.to_owned(),
            serde_json::to_string(record).expect("a batch record serializes"),
            record.status.as_str().to_owned(),
            record.tenant.clone(),
            record.expires_at.to_string(),
            mode.to_owned(),
            floor.to_string(),
            cancel.clone().unwrap_or_default(),
            checkpoint.unwrap_or_default(),
        ];
        let n: i64 = RESTORE_BATCH
            .evalsha_with_reload(&self.client, self.restore_keys(id, &record.tenant), args)
            .await?;
        if n == 0 {
            report.present += 1;
            return Ok(());
        }
        report.batches += 1;
        match mode {
            "done" => report.finished += 1,
            "resume" => report.resumed += 1,
            _ => report.queued += 1,
        }
        if cancel.is_some() && !terminal {
            report.cancelling += 1;
        }
        Ok(())
    }

    /// The keys `RESTORE_BATCH` writes for batch `id` of `tenant`.
    fn restore_keys(&self, id: &str, tenant: &str) -> Vec<String> {
        vec![
            self.keys.batch(id),
            self.keys.batches(tenant),
            self.keys.status_counts(),
            self.keys.active(),
            self.keys.tenant_of(),
            self.keys.queue(),
            self.keys.tenant_queue(tenant),
            self.keys.tenants_queued(),
            self.keys.running(),
            self.keys.epoch(id),
            self.keys.cancel(id),
            self.keys.cancel_queue(),
            self.keys.checkpoint(id),
        ]
    }
}

/// The storage copies of an unfinished batch's cancel request and checkpoint, if any.
async fn unfinished_copies(
    storage: &Storage,
    id: &str,
) -> Result<(Option<String>, Option<String>), StoreError> {
    let cancel = read_opt(storage, &layout::cancel_copy(id)).await?;
    let checkpoint = read_opt(storage, &layout::checkpoint_copy(id)).await?;
    let text = |c: Bytes| String::from_utf8_lossy(&c).into_owned();
    Ok((cancel.map(text), checkpoint.map(text)))
}

/// Where `RESTORE_BATCH` puts a batch back: `done`, `queue`, `cancelq` or `resume`.
fn restore_mode(copy: &BatchCopy, checkpoint_epoch: u64, cancelled: bool) -> &'static str {
    let b = &copy.record;
    // A batch nobody claimed yet (validating, or cancelled while queued; no epoch written)
    // goes back to its queue; any other unfinished one to the running set, to be adopted
    // with its checkpoint.
    let started = copy.epoch > 0
        || checkpoint_epoch > 0
        || b.times.in_progress.is_some()
        || !matches!(b.status, BatchStatus::Validating | BatchStatus::Cancelling);
    match (b.status.is_terminal(), started, cancelled) {
        (true, _, _) => "done",
        (false, false, false) => "queue",
        (false, false, true) => "cancelq",
        (false, true, _) => "resume",
    }
}
