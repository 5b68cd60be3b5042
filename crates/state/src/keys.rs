//! Every Redis key the service's state uses, named once.
//!
//! Each key is `{<prefix>}:<name>[:<part>…]`: the prefix in braces is a Redis Cluster hash tag,
//! so every key of the state sits in one hash slot and a script may touch any of them. The key
//! strings are what Redis already holds: changing one strands the data written under the old
//! name (the test `keys_keep_their_names` pins them).
//!
//! The scripts never build a key: each is handed the keys it touches in `KEYS`, in the order its
//! header lists. Which script takes which key:
//!
//! | key | scripts |
//! |---|---|
//! | [`batch`](StateKeys::batch) | `create_batch`, `save_batch`, `cancel`, `restore_batch`, `fan_out` |
//! | [`batches`](StateKeys::batches) | `create_batch`, `restore_batch` |
//! | [`queue`](StateKeys::queue) | `create_batch`, `cancel`, `pick`, `take`, `restore_batch` |
//! | [`cancel_queue`](StateKeys::cancel_queue) | `cancel`, `pick`, `take`, `restore_batch` |
//! | [`tenant_queue`](StateKeys::tenant_queue) | `create_batch`, `cancel`, `pick`, `take`, `restore_batch` |
//! | [`tenants_queued`](StateKeys::tenants_queued) | `create_batch`, `cancel`, `take`, `restore_batch` |
//! | [`status_counts`](StateKeys::status_counts) | `create_batch`, `save_batch`, `cancel`, `restore_batch` |
//! | [`active`](StateKeys::active) | `create_batch`, `save_batch`, `restore_batch` |
//! | [`tenant_of`](StateKeys::tenant_of) | `create_batch`, `save_batch`, `cancel`, `pick`, `restore_batch` |
//! | [`cancel`](StateKeys::cancel) | `cancel`, `restore_batch` |
//! | [`running`](StateKeys::running) | `pick`, `take`, `adopt`, `renew`, `release`, `restore_batch` |
//! | [`lease`](StateKeys::lease) | `save_batch`, `take`, `adopt`, `renew`, `release`, `save_checkpoint` |
//! | [`epoch`](StateKeys::epoch) | `cancel`, `take`, `adopt`, `renew`, `restore_batch` |
//! | [`checkpoint`](StateKeys::checkpoint) | `save_checkpoint`, `restore_batch` |
//! | [`file`](StateKeys::file), [`files`](StateKeys::files), [`files_of_purpose`](StateKeys::files_of_purpose), [`expiry`](StateKeys::expiry), [`usage_bytes`](StateKeys::usage_bytes), [`usage_files`](StateKeys::usage_files) | `put_file`, `delete_file` |
//! | [`state`](StateKeys::state) | none (read and written directly) |
//! | [`rebuild_lock`](StateKeys::rebuild_lock) | `unlock` |
//! | [`webhook_ended`](StateKeys::webhook_ended) | `save_batch`, `fan_out` |
//! | [`webhook_due`](StateKeys::webhook_due) | `claim_delivery` |
//! | [`webhook_due_of`](StateKeys::webhook_due_of), [`webhook_due_tenants`](StateKeys::webhook_due_tenants) | `fan_out`, `claim_delivery` |
//! | [`webhook_served`](StateKeys::webhook_served) | `claim_delivery` |
//! | [`webhooks`](StateKeys::webhooks) | `add_endpoint`, `fan_out` |
//! | [`webhook`](StateKeys::webhook), [`webhook_delivery`](StateKeys::webhook_delivery) | `fan_out` |
//! | [`webhook_secret`](StateKeys::webhook_secret) | none |
//!
//! ```
//! let keys = batch_state::StateKeys::new("batch-processor");
//! assert_eq!(keys.lease("batch_1"), "{batch-processor}:lease:batch_1");
//! ```

/// The names of the service's Redis keys under one prefix (`serve.state_prefix`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateKeys {
    /// `{<prefix>}`: the hash tag every key starts with.
    tag: String,
}

impl StateKeys {
    /// The keys under `{prefix}:`.
    pub fn new(prefix: &str) -> Self {
        Self {
            tag: format!("{{{prefix}}}"),
        }
    }

    /// `{prefix}`, braces included: what every key starts with.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    fn key(&self, parts: &[&str]) -> String {
        let mut key = self.tag.clone();
        for part in parts {
            key.push(':');
            key.push_str(part);
        }
        key
    }

    // Batches.

    /// Batch `id`'s record (a string of JSON).
    pub fn batch(&self, id: &str) -> String {
        self.key(&["batch", id])
    }

    /// `tenant`'s batches (a sorted set of ids, all score 0: a lexicographic listing).
    pub fn batches(&self, tenant: &str) -> String {
        self.key(&["batches", tenant])
    }

    /// Batches by status, over every tenant (a hash: status → count).
    pub fn status_counts(&self) -> String {
        self.key(&["status_counts"])
    }

    /// Each tenant's unfinished (queued or running) batches (a hash: tenant → count).
    pub fn active(&self) -> String {
        self.key(&["active"])
    }

    /// The tenant of each unfinished batch (a hash: id → tenant).
    pub fn tenant_of(&self) -> String {
        self.key(&["tenant_of"])
    }

    /// The mark that a cancel of batch `id` was asked (a string: the Unix second it was).
    pub fn cancel(&self, id: &str) -> String {
        self.key(&["cancel", id])
    }

    // The job queue.

    /// Every tenant's queued batches (a sorted set of ids by deadline).
    pub fn queue(&self) -> String {
        self.key(&["queue"])
    }

    /// Batches whose cancel was asked while they were queued (a sorted set of ids).
    pub fn cancel_queue(&self) -> String {
        self.key(&["cancelq"])
    }

    /// `tenant`'s queued batches (a sorted set of ids by deadline).
    pub fn tenant_queue(&self, tenant: &str) -> String {
        self.key(&["tqueue", tenant])
    }

    /// The tenants with a batch queued (a set).
    pub fn tenants_queued(&self) -> String {
        self.key(&["tenants_queued"])
    }

    /// Running jobs asked to give their slot back to a tenant below its share (a hash: id →
    /// `<replica>#<tenant>`, the job's holder and the tenant its slot goes to).
    pub fn yielding(&self) -> String {
        self.key(&["yielding"])
    }

    // Leases and checkpoints.

    /// The running jobs (a hash: id → the replica it was given to).
    pub fn running(&self) -> String {
        self.key(&["running"])
    }

    /// Job `id`'s lease (a string `<replica>#<epoch>` with an expiry).
    pub fn lease(&self, id: &str) -> String {
        self.key(&["lease", id])
    }

    /// Job `id`'s fencing epoch (a counter, one up per new holder).
    pub fn epoch(&self, id: &str) -> String {
        self.key(&["epoch", id])
    }

    /// Job `id`'s latest checkpoint (a string of JSON).
    pub fn checkpoint(&self, id: &str) -> String {
        self.key(&["checkpoint", id])
    }

    // Files.

    /// File `id`'s record (a string of JSON).
    pub fn file(&self, id: &str) -> String {
        self.key(&["file", id])
    }

    /// `tenant`'s files (a sorted set of ids, all score 0).
    pub fn files(&self, tenant: &str) -> String {
        self.key(&["files", tenant])
    }

    /// `tenant`'s files of `purpose` (a sorted set of ids, all score 0).
    pub fn files_of_purpose(&self, tenant: &str, purpose: &str) -> String {
        self.key(&["files", tenant, purpose])
    }

    /// Files by expiry (a sorted set of ids by `expires_at`).
    pub fn expiry(&self) -> String {
        self.key(&["expiry"])
    }

    /// Bytes of files each tenant stores (a hash: tenant → bytes).
    pub fn usage_bytes(&self) -> String {
        self.key(&["usage_bytes"])
    }

    /// Files each tenant stores (a hash: tenant → count).
    pub fn usage_files(&self) -> String {
        self.key(&["usage_files"])
    }

    // Recovery.

    /// The state's generation marker (a string), gone when Redis lost the state.
    pub fn state(&self) -> String {
        self.key(&["state"])
    }

    /// The rebuild lock (a string: its holder, with an expiry).
    pub fn rebuild_lock(&self) -> String {
        self.key(&["rebuild_lock"])
    }

    // Webhooks.

    /// Batches that reached a final status, to fan out to webhooks (a list of ids).
    pub fn webhook_ended(&self) -> String {
        self.key(&["webhook_ended"])
    }

    /// Deliveries by due time as an earlier version queued them, every tenant's in one sorted
    /// set (`<tenant>/<batch>:<endpoint>` or `<batch>:<endpoint>`, by ms); drained as they end
    /// or move to their tenant's set ([`webhook_due_of`](Self::webhook_due_of)) at a retry.
    pub fn webhook_due(&self) -> String {
        self.key(&["webhook_due"])
    }

    /// `tenant`'s deliveries by due time (a sorted set of `<tenant>/<batch>:<endpoint>` by ms):
    /// one set per tenant, so a claim weighs every tenant's most overdue, however many another
    /// has queued.
    pub fn webhook_due_of(&self, tenant: &str) -> String {
        self.key(&["webhook_due", tenant])
    }

    /// The tenants whose due set may hold deliveries (a set; a claim drops those found empty).
    pub fn webhook_due_tenants(&self) -> String {
        self.key(&["webhook_due_tenants"])
    }

    /// The due set of delivery `member`: its tenant's, or the shared one of an earlier version
    /// for a member without a tenant (`<batch>:<endpoint>`).
    pub fn webhook_due_for(&self, member: &str) -> String {
        match member.split_once('/') {
            Some((tenant, _)) => self.webhook_due_of(tenant),
            None => self.webhook_due(),
        }
    }

    /// When each tenant's delivery was last claimed (a hash: tenant → ms).
    pub fn webhook_served(&self) -> String {
        self.key(&["webhook_served"])
    }

    /// `tenant`'s webhook endpoints (a sorted set of ids by creation time).
    pub fn webhooks(&self, tenant: &str) -> String {
        self.key(&["webhooks", tenant])
    }

    /// Webhook endpoint `id`'s record (a string of JSON).
    pub fn webhook(&self, id: &str) -> String {
        self.key(&["webhook", id])
    }

    /// Webhook endpoint `id`'s signing secret (a string), apart from the record listings read.
    pub fn webhook_secret(&self, id: &str) -> String {
        self.key(&["webhook_secret", id])
    }

    /// The record of a queued delivery (a string of JSON), named by its member of
    /// [`webhook_due`](Self::webhook_due), `<tenant>/<batch>:<endpoint>` (or `<batch>:<endpoint>`,
    /// as queued by an earlier version): the key is `webhook_delivery:<batch>:<endpoint>`.
    pub fn webhook_delivery(&self, member: &str) -> String {
        let record = member.split_once('/').map_or(member, |(_, record)| record);
        self.key(&["webhook_delivery", record])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names Redis already holds data under: a change here strands that data.
    #[test]
    fn keys_keep_their_names() {
        let k = StateKeys::new("batch-processor");
        assert_eq!(k.tag(), "{batch-processor}");
        assert_eq!(k.batch("batch_1"), "{batch-processor}:batch:batch_1");
        assert_eq!(k.batches("t"), "{batch-processor}:batches:t");
        assert_eq!(k.status_counts(), "{batch-processor}:status_counts");
        assert_eq!(k.active(), "{batch-processor}:active");
        assert_eq!(k.tenant_of(), "{batch-processor}:tenant_of");
        assert_eq!(k.cancel("b"), "{batch-processor}:cancel:b");
        assert_eq!(k.queue(), "{batch-processor}:queue");
        assert_eq!(k.cancel_queue(), "{batch-processor}:cancelq");
        assert_eq!(k.tenant_queue("t"), "{batch-processor}:tqueue:t");
        assert_eq!(k.tenants_queued(), "{batch-processor}:tenants_queued");
        assert_eq!(k.running(), "{batch-processor}:running");
        assert_eq!(k.lease("b"), "{batch-processor}:lease:b");
        assert_eq!(k.epoch("b"), "{batch-processor}:epoch:b");
        assert_eq!(k.checkpoint("b"), "{batch-processor}:checkpoint:b");
        assert_eq!(k.file("file-1"), "{batch-processor}:file:file-1");
        assert_eq!(k.files("t"), "{batch-processor}:files:t");
        assert_eq!(
            k.files_of_purpose("t", "batch"),
            "{batch-processor}:files:t:batch"
        );
        assert_eq!(k.expiry(), "{batch-processor}:expiry");
        assert_eq!(k.usage_bytes(), "{batch-processor}:usage_bytes");
        assert_eq!(k.usage_files(), "{batch-processor}:usage_files");
        assert_eq!(k.state(), "{batch-processor}:state");
        assert_eq!(k.rebuild_lock(), "{batch-processor}:rebuild_lock");
        assert_eq!(k.webhook_ended(), "{batch-processor}:webhook_ended");
        assert_eq!(k.webhook_due(), "{batch-processor}:webhook_due");
        assert_eq!(k.webhook_due_of("t"), "{batch-processor}:webhook_due:t");
        assert_eq!(k.webhook_due_for("t/b:we_1"), k.webhook_due_of("t"));
        assert_eq!(k.webhook_due_for("b:we_1"), k.webhook_due());
        assert_eq!(
            k.webhook_due_tenants(),
            "{batch-processor}:webhook_due_tenants"
        );
        assert_eq!(k.webhook_served(), "{batch-processor}:webhook_served");
        assert_eq!(k.webhooks("t"), "{batch-processor}:webhooks:t");
        assert_eq!(k.webhook("we_1"), "{batch-processor}:webhook:we_1");
        assert_eq!(
            k.webhook_secret("we_1"),
            "{batch-processor}:webhook_secret:we_1"
        );
        assert_eq!(
            k.webhook_delivery("t/b:we_1"),
            "{batch-processor}:webhook_delivery:b:we_1"
        );
        assert_eq!(
            k.webhook_delivery("b:we_1"),
            "{batch-processor}:webhook_delivery:b:we_1"
        );
    }
}
