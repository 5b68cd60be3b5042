//! Deletes files past their `expires_at`: bytes from storage, then the record. Batches that
//! used them stay listed.

use std::time::Duration;

use batch_state::{now_unix, Store, StoreError};
use batch_storage::{Storage, StorageError};
use tokio_util::sync::CancellationToken;

/// Files deleted per look.
const CHUNK: usize = 500;

pub(crate) async fn run(store: Store, storage: Storage, every: Duration, stop: CancellationToken) {
    loop {
        match reap(&store, &storage).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(files = n, "expired files deleted"),
            Err(e) => {
                tracing::warn!(error = %e, "could not delete expired files; trying again later")
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// Why a pass stopped; the next pass tries again.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReapError {
    /// Reading or deleting a file's record failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Deleting a file's bytes failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
}

/// One pass: every file expired now.
pub(crate) async fn reap(store: &Store, storage: &Storage) -> Result<usize, ReapError> {
    let mut deleted = 0;
    loop {
        let ids = store.expired_files(now_unix(), CHUNK).await?;
        if ids.is_empty() {
            return Ok(deleted);
        }
        for id in &ids {
            match store.file(id).await? {
                Some(file) => {
                    storage.delete(&file.storage_key()).await?;
                    store.delete_file(&file).await?;
                    metrics::counter!("batch_service_files_expired_total").increment(1);
                    deleted += 1;
                }
                None => store.forget_expiry(id).await?,
            }
        }
    }
}
