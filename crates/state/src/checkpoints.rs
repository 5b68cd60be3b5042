//! Checkpoints: each running job's latest, written only while its lease holds, from which the
//! job resumes on whichever replica adopts it.

use std::sync::LazyLock;

use fred::interfaces::KeysInterface;
use fred::types::scripts::Script;

use crate::{JobLease, Store, StoreError};

static SAVE_CHECKPOINT: LazyLock<Script> =
    LazyLock::new(|| Script::from_lua(include_str!("checkpoints/save_checkpoint.lua")));

impl Store {
    /// Records job `lease.job`'s latest checkpoint (opaque JSON) while the lease holds.
    pub async fn save_checkpoint(&self, lease: &JobLease, json: &str) -> Result<bool, StoreError> {
        let keys = vec![
            self.keys.checkpoint(&lease.job),
            self.keys.lease(&lease.job),
        ];
        let n: i64 = SAVE_CHECKPOINT
            .evalsha_with_reload(&self.client, keys, vec![json.to_owned(), lease.value()])
            .await?;
        if n == 1 {
            self.mirror_checkpoint(&lease.job, json).await?;
        }
        Ok(n == 1)
    }

    /// Job `id`'s latest checkpoint.
    pub async fn checkpoint(&self, id: &str) -> Result<Option<String>, StoreError> {
        let json: Option<String> = self.client.get(self.keys.checkpoint(id)).await?;
        Ok(json)
    }

    /// Forgets job `id`'s checkpoint (it ended).
    pub async fn forget_checkpoint(&self, id: &str) -> Result<(), StoreError> {
        let _: i64 = self.client.del(self.keys.checkpoint(id)).await?;
        self.forget_checkpoint_copy(id).await?;
        Ok(())
    }
}
