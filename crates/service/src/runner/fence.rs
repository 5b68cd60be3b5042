//! Fencing: every write for a job holds only while the job's lease does. A write refused by
//! its fence is made once more if the lease had only lapsed (nobody took the job) and is held
//! again; otherwise another replica runs the job now and this one stops writing for it.

use std::time::Duration;

use batch_redis::Backoff;
use batch_state::{Advance, Change, JobLease, Store, StoreError, StoredBatch};
use batch_storage::StorageError;
use tokio_util::sync::CancellationToken;

/// What went wrong with one job's bookkeeping (the job itself fails through the executor).
#[derive(Debug, thiserror::Error)]
pub(crate) enum RunError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error(transparent)]
    Exec(#[from] batch_executor::ExecError),
    #[error(transparent)]
    Sink(#[from] batch_sink::SinkError),
    /// A blocking task of the job's bookkeeping panicked.
    #[error("{what} panicked: {error}")]
    Panicked {
        what: &'static str,
        #[source]
        error: tokio::task::JoinError,
    },
    /// A file of the job's work directory.
    #[error("{}: {error}", path.display())]
    Io {
        path: std::path::PathBuf,
        #[source]
        error: std::io::Error,
    },
    #[error("stopped")]
    Stopped,
    /// Another replica holds the job now.
    #[error("the job's lease was lost to another replica")]
    Fenced,
}

/// Runs `op` until it succeeds, fails for good, or `stop` fires.
pub(crate) async fn retry<T, F, Fut>(
    stop: &CancellationToken,
    what: &str,
    mut op: F,
) -> Result<T, RunError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut backoff = Backoff::default();
    let mut warned = false;
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) if e.is_transient() => {
                if !warned {
                    tracing::warn!(operation = what, error = %e, "Redis is not answering; waiting for it");
                    warned = true;
                }
            }
            Err(e) => return Err(e.into()),
        }
        if !backoff.wait(stop).await {
            return Err(RunError::Stopped);
        }
    }
}

/// The writes for one job under its lease: all that finishing a batch needs of the runner.
pub(crate) struct Fence<'a> {
    pub(crate) store: &'a Store,
    pub(crate) lease: &'a JobLease,
    /// The lease time a lapsed lease is held again for.
    pub(crate) ttl: Duration,
    /// Fired on shutdown: retries give up.
    pub(crate) stop: &'a CancellationToken,
}

impl Fence<'_> {
    /// Runs `op` until it succeeds, fails for good, or the service stops.
    pub(crate) async fn retry<T, F, Fut>(&self, what: &str, op: F) -> Result<T, RunError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        retry(self.stop, what, op).await
    }

    /// A write for the job was refused: true when the lease had only lapsed and is held
    /// again, so the write may be made again.
    pub(crate) async fn regain(&self) -> Result<bool, RunError> {
        let held = self
            .retry("renewing a lease", || self.store.hold(self.lease, self.ttl))
            .await?;
        if held {
            log_regained(self.lease);
        }
        Ok(held)
    }

    /// Makes a write that holds only under the lease (`op` says whether it was made), once more
    /// if the lease had only lapsed; [`RunError::Fenced`] when another replica holds the job.
    pub(crate) async fn write<F, Fut>(&self, what: &str, mut op: F) -> Result<(), RunError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool, StoreError>>,
    {
        if self.retry(what, &mut op).await? {
            return Ok(());
        }
        if self.regain().await? && self.retry(what, &mut op).await? {
            return Ok(());
        }
        Err(RunError::Fenced)
    }

    /// Applies `change` to `record` and saves it as the holder of the lease (see
    /// [`Store::advance`]), once more if the lease had only lapsed; [`RunError::Fenced`] when
    /// another replica holds the job.
    pub(crate) async fn advance(
        &self,
        record: &mut StoredBatch,
        change: Change<'_>,
    ) -> Result<(), RunError> {
        for regained in [false, true] {
            if regained && !self.regain().await? {
                break;
            }
            let (advance, saved) = self
                .retry("saving a batch", || {
                    let mut r = record.clone();
                    async move {
                        let a = self.store.advance(&mut r, change, Some(self.lease)).await?;
                        Ok((a, r))
                    }
                })
                .await?;
            if advance == Advance::Saved {
                *record = saved;
                return Ok(());
            }
        }
        Err(RunError::Fenced)
    }
}

pub(crate) fn log_regained(lease: &JobLease) {
    tracing::warn!(job = %lease.job, epoch = lease.epoch, "the job's lease lapsed (this replica was frozen or cut off) but nobody took the job; holding it again");
}
