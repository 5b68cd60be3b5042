//! When Redis forgets: notices that Redis lost the service's state (its marker key is gone:
//! flushed, evicted, restarted empty) and rebuilds it from storage, one replica at a time under
//! a lock, while `/ready` says so. Jobs that were running come back as orphans that a replica
//! adopts and resumes from its last checkpoint (see [`batch_state::Store::rebuild`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use batch_state::{RebuildReport, Store, StoreError};
use batch_storage::Storage;
use tokio_util::sync::CancellationToken;

/// How often the marker is looked at: a loss is noticed within this.
const WATCH_INTERVAL: Duration = Duration::from_secs(1);
/// How long the rebuild lock holds without its holder letting go (a holder that died).
const LOCK_TTL: Duration = Duration::from_secs(120);
/// How often a replica waiting for another's rebuild looks again.
const WAIT_INTERVAL: Duration = Duration::from_millis(250);

/// What this replica knows of the state generation in Redis.
pub(crate) struct StateGuard {
    store: Store,
    storage: Storage,
    replica: String,
    /// The generation seen last.
    seen: Mutex<Option<String>>,
    /// Set from the loss being noticed until the state is back.
    recovering: AtomicBool,
    /// How many losses this replica has noticed.
    losses: AtomicU64,
}

impl StateGuard {
    pub(crate) fn new(store: Store, storage: Storage, replica: &str) -> Self {
        Self {
            store,
            storage,
            replica: replica.to_owned(),
            seen: Mutex::new(None),
            recovering: AtomicBool::new(false),
            losses: AtomicU64::new(0),
        }
    }

    /// How many losses were noticed so far.
    pub(crate) fn losses(&self) -> u64 {
        self.losses.load(Ordering::SeqCst)
    }

    /// Why `/ready` must fail now, if it must.
    pub(crate) fn not_ready(&self) -> Option<String> {
        self.recovering
            .load(Ordering::SeqCst)
            .then(|| "redis: it lost the service's state; rebuilding it from storage\n".to_owned())
    }

    /// Looks at the marker now: true when the state was lost since this replica last looked
    /// (gone, or rebuilt by another replica meanwhile). Logs the loss once.
    pub(crate) async fn check(&self) -> Result<bool, StoreError> {
        let now = self.store.state_generation().await?;
        let mut seen = self.seen.lock().expect("seen lock");
        match now {
            None => {
                if !self.recovering.swap(true, Ordering::SeqCst) {
                    self.losses.fetch_add(1, Ordering::SeqCst);
                    tracing::error!("Redis lost the service's state (its marker key is gone: flushed, evicted or restarted empty); the jobs running here stop, and the state is rebuilt from storage");
                    metrics::counter!("batch_redis_state_losses_total").increment(1);
                }
                Ok(true)
            }
            Some(g) if seen.as_deref().is_some_and(|s| s != g) => {
                // Rebuilt by another replica: the state is back.
                if !self.recovering.swap(false, Ordering::SeqCst) {
                    self.losses.fetch_add(1, Ordering::SeqCst);
                    tracing::error!("Redis lost the service's state and another replica rebuilt it from storage meanwhile; the jobs running here stop and are resumed from their checkpoints");
                    metrics::counter!("batch_redis_state_losses_total").increment(1);
                }
                *seen = Some(g);
                Ok(true)
            }
            Some(g) => {
                *seen = Some(g);
                Ok(false)
            }
        }
    }

    /// Makes sure Redis holds the state: when its marker is gone (or `force`), rebuilds it from
    /// storage under the rebuild lock, or waits for the replica that holds the lock. Returns the
    /// report when this replica rebuilt.
    pub(crate) async fn ensure(
        &self,
        force: bool,
        stop: &CancellationToken,
    ) -> Result<Option<RebuildReport>, StoreError> {
        let holder = batch_state::new_id(&format!("{}#", self.replica));
        loop {
            let generation = self.store.state_generation().await?;
            if let (Some(g), false) = (&generation, force) {
                *self.seen.lock().expect("seen lock") = Some(g.clone());
                self.recovering.store(false, Ordering::SeqCst);
                return Ok(None);
            }
            if self.store.lock_rebuild(&holder, LOCK_TTL).await? {
                let outcome = self.rebuild(&holder, generation).await;
                self.store.unlock_rebuild(&holder).await?;
                let report = outcome?;
                self.recovering.store(false, Ordering::SeqCst);
                return Ok(Some(report));
            }
            tracing::info!("another replica is rebuilding the state from storage; waiting");
            tokio::select! {
                _ = stop.cancelled() => return Ok(None),
                _ = tokio::time::sleep(WAIT_INTERVAL) => {}
            }
        }
    }

    /// Rebuilds; a new generation only when the state was lost (`kept`: the marker there, a
    /// rebuild asked for): other replicas would take a new one for a loss.
    async fn rebuild(
        &self,
        holder: &str,
        kept: Option<String>,
    ) -> Result<RebuildReport, StoreError> {
        let started = std::time::Instant::now();
        let report = self.store.rebuild(&self.storage).await?;
        let generation = match kept {
            Some(g) => g,
            None => self.store.mark_state().await?,
        };
        *self.seen.lock().expect("seen lock") = Some(generation.clone());
        tracing::warn!(
            holder,
            generation,
            files = report.files,
            batches = report.batches,
            queued = report.queued,
            resumed = report.resumed,
            cancelling = report.cancelling,
            present = report.present,
            ms = started.elapsed().as_millis() as u64,
            "rebuilt the service's state from storage"
        );
        Ok(report)
    }

    /// Watches the marker until stopped; on a loss, rebuilds (or waits for the rebuild), then
    /// wakes the runner to take the jobs put back.
    pub(crate) async fn watch(&self, stop: CancellationToken, wake: impl Fn()) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(WATCH_INTERVAL) => {}
            }
            match self.check().await {
                Ok(false) => {}
                Ok(true) => match self.ensure(false, &stop).await {
                    Ok(_) => wake(),
                    Err(e) => tracing::warn!(error = %e, "could not rebuild the state yet"),
                },
                // Redis down: nothing to learn until it answers.
                Err(e) => tracing::debug!(error = %e, "could not read the state marker"),
            }
        }
    }
}
