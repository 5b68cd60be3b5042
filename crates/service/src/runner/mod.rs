//! Runs the service's jobs: takes queued batches by deadline while it has a free slot (up to
//! `max_active_jobs`), each under a lease renewed by a heartbeat; takes over the jobs of
//! replicas whose leases lapsed; checkpoints running jobs to storage; uploads their result files
//! at the end. Every write for a job is fenced by its lease epoch.
//!
//! One module per concern: [`schedule`] (which jobs to take), [`leases`] (the heartbeat, lost
//! and lapsed leases), [`fence`] (writes that hold only under a lease; all that
//! [`crate::finalize`] is given), [`lifecycle`] (a job from start to end), [`preempt`] (a slot
//! given back for a fairer share), [`checkpoints`] and [`watcher`].

mod checkpoints;
pub(crate) mod fence;
mod leases;
mod lifecycle;
mod preempt;
mod schedule;
mod watcher;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use batch_executor::Executor;
use batch_state::{JobLease, Store, StoreError};
use batch_storage::Storage;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::recover::StateGuard;
pub(crate) use fence::RunError;

/// How often an idle runner looks at the queue (a batch created here wakes it at once).
const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// How the runner is set up.
#[derive(Debug, Clone)]
pub(crate) struct RunnerConfig {
    pub replica: String,
    pub work_dir: PathBuf,
    pub max_active_jobs: usize,
    pub lease_ttl: Duration,
    pub checkpoint_interval: Duration,
    /// How a free slot is shared among tenants: `serve.tenant_max_running_batches` and
    /// `serve.tenant_weights`.
    pub tenant_share: batch_state::SlotShare,
    /// `serve.tenant_max_requests_in_flight`: requests of one tenant's jobs in flight at once
    /// on this replica, sync mode (0: no cap but `concurrency.global`).
    pub tenant_requests: usize,
    /// `serve.tenant_preemption`: a running batch gives its slot back to a tenant below its
    /// share, after running this long again when it gave one back before
    /// (`serve.tenant_preemption_min_run`); `None`: never.
    pub preemption: Option<Duration>,
}

/// A job this replica runs now.
struct Active {
    /// The executor's job, once prepared: what the API shows of its lines so far.
    job: Option<Arc<batch_executor::Job>>,
    lease: JobLease,
    /// Fired when the lease is lost: the job stops writing at once.
    fenced: CancellationToken,
    /// How many losses of Redis's state were noticed when it started here.
    losses: u64,
    /// Once prepared: what a preemption looks at.
    run: Option<Run>,
    /// Its slot among `max_active_jobs` (none for a job cancelled while queued). Given up as
    /// soon as the job is asked to give its slot back, not once it has stopped: the waiting
    /// batch it yields to starts while its last requests end and it checkpoints.
    permit: Option<OwnedSemaphorePermit>,
}

/// A prepared job's terms, for [`preempt`].
struct Run {
    tenant: String,
    /// Its deadline (Unix seconds): the least urgent is asked first.
    expires_at: i64,
    /// When it was prepared here.
    since: std::time::Instant,
}

/// The part of the service that runs jobs.
pub(crate) struct Runner {
    pub(crate) store: Store,
    pub(crate) storage: Storage,
    pub(crate) executor: Arc<Executor>,
    pub(crate) config: RunnerConfig,
    slots: Arc<Semaphore>,
    pub(crate) wake: Notify,
    /// Wakes the preemption check (a batch created here may wait for a slot).
    pub(crate) preempt_wake: Notify,
    /// Fired on shutdown: stop taking jobs (the executor's pause stops the running ones).
    pub(crate) stop: CancellationToken,
    active: Mutex<HashMap<String, Active>>,
    /// Held while this replica looks for jobs to take over and adopts one: the take-over task
    /// and a freed slot look at once, and the adoption script lets a replica take again a job
    /// it holds itself, so two unguarded looks adopted one job twice.
    adopting: tokio::sync::Mutex<()>,
    /// When a freed slot last looked for a job to take over ([`Runner::orphans_due`]).
    orphans_looked: Mutex<Option<std::time::Instant>>,
    pub(crate) tasks: TaskTracker,
    /// Whether Redis lost the service's state.
    state: Arc<StateGuard>,
    /// Each tenant's share of requests in flight ([`RunnerConfig::tenant_requests`]).
    tenant_slots: Mutex<HashMap<String, Arc<Semaphore>>>,
}

impl Runner {
    pub(crate) fn new(
        state: Arc<StateGuard>,
        store: Store,
        storage: Storage,
        executor: Arc<Executor>,
        config: RunnerConfig,
    ) -> Arc<Self> {
        Arc::new(Self {
            store,
            storage,
            executor,
            slots: Arc::new(Semaphore::new(config.max_active_jobs)),
            config,
            wake: Notify::new(),
            preempt_wake: Notify::new(),
            stop: CancellationToken::new(),
            active: Mutex::new(HashMap::new()),
            adopting: tokio::sync::Mutex::new(()),
            orphans_looked: Mutex::new(None),
            tasks: TaskTracker::new(),
            state,
            tenant_slots: Mutex::new(HashMap::new()),
        })
    }

    /// The permits `tenant`'s jobs share for their requests in flight, when capped.
    pub(crate) fn tenant_slots(&self, tenant: &str) -> Option<Arc<Semaphore>> {
        let size = self.config.tenant_requests;
        if size == 0 {
            return None;
        }
        let mut slots = self.tenant_slots.lock().expect("tenant slots lock");
        Some(
            slots
                .entry(tenant.to_owned())
                .or_insert_with(|| Arc::new(Semaphore::new(size)))
                .clone(),
        )
    }

    fn job_dir(&self, id: &str) -> PathBuf {
        self.config.work_dir.join("serve").join(id)
    }

    /// The executor's job `id`, when it runs here and was prepared.
    fn running_job(&self, id: &str) -> Option<Arc<batch_executor::Job>> {
        let active = self.active.lock().expect("active lock");
        active.get(id).and_then(|a| a.job.clone())
    }

    /// How many jobs run here now.
    pub(crate) fn active_jobs(&self) -> usize {
        self.active.lock().expect("active lock").len()
    }

    /// Runs `op` until it succeeds, fails for good, or the service stops.
    pub(crate) async fn retry<T, F, Fut>(&self, what: &str, op: F) -> Result<T, RunError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        fence::retry(&self.stop, what, op).await
    }
}
