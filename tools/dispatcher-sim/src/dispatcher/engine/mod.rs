//! The dispatcher's moving parts: one poller per request queue, one retry poller, and a worker
//! per message, all sharing a Redis client, an HTTP client and a pool of worker permits. In
//! v0.10 a heartbeat renews the leases of the claims in hand and a reclaimer returns expired
//! ones.

mod claims;
mod leases;
mod retries;
mod worker;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fred::prelude::{
    Client as RedisClient, ClientLike, KeysInterface, LuaInterface, ReconnectPolicy,
    SortedSetsInterface, Value,
};
use hyper::Uri;
use rand::rngs::StdRng;
use rand::SeedableRng;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use claims::ClaimKeys;

use super::config::{DispatcherConfig, DispatcherVersion, ExpiredPolicy, SimOptions};
use super::gate::{Gate, GateRelease, Verdict};
use super::stats::{Counters, DispatcherStats};
use super::wire::{self, codes, Envelope, ResultMessage};
use crate::{http, GatewayHandle, SimError};
use claims::Scripts;

/// The path used when neither the message nor the queue entry names one.
const DEFAULT_PATH: &str = "/v1/completions";

/// How many expired claims one pass of the reclaimer returns per sorted set at most.
const RECLAIM_BATCH: i64 = 100;

/// v0.10 caps a lease at the deadline plus this (scaled like the lease).
const LEASE_GRACE: Duration = Duration::from_secs(300);

/// One request queue, resolved.
pub(crate) struct Queue {
    name: String,
    /// Written into `internal.queue_id` of members the dispatcher re-adds.
    id: String,
    base_url: String,
    path: String,
    objective: Option<String>,
    result_queue: Option<String>,
    gate: Gate,
    claims: Arc<ClaimKeys>,
}

/// v0.10: the lease under which a message is held.
pub(crate) struct Claim {
    keys: Arc<ClaimKeys>,
    key: String,
}

/// The claims in hand: (sorted set, claim key) → (its keys, the request's deadline).
type Held = HashMap<(String, String), (Arc<ClaimKeys>, i64)>;

/// A message in hand, with its claim in v0.10 and its gate slot.
pub(crate) struct Taken {
    env: Envelope,
    claim: Option<Claim>,
    /// Freed once its result or retry is written (a `local-max-concurrency` gate's slot).
    release: Option<GateRelease>,
}

/// State shared by every task of one dispatcher.
pub(crate) struct Shared {
    redis: RedisClient,
    http: http::Client,
    queues: Vec<Arc<Queue>>,
    default_result_queue: String,
    retry_queue: String,
    poll_interval: Duration,
    batch_size: usize,
    concurrency: usize,
    request_timeout: Duration,
    sim: SimOptions,
    counters: Counters,
    permits: Arc<Semaphore>,
    rng: Mutex<StdRng>,
    /// Stop taking new messages (graceful shutdown).
    stop: CancellationToken,
    /// Abort every task at its next await point.
    kill: CancellationToken,
    /// Fired by crash-after only.
    crash: CancellationToken,
    crashed: AtomicBool,
    /// Takes reserved against `crash_after`, so that no more than N are ever popped.
    take_slots: AtomicU64,
    workers: TaskTracker,
    version: DispatcherVersion,
    instance_id: String,
    scripts: Scripts,
    /// v0.10: the claims in hand, by (sorted set, claim key), with their deadline; the
    /// heartbeat renews them.
    held: Mutex<Held>,
}

fn non_empty(s: &Option<String>) -> Option<&str> {
    s.as_deref().map(str::trim).filter(|s| !s.is_empty())
}

fn normalize_path(p: &str) -> String {
    if p.starts_with('/') {
        p.to_owned()
    } else {
        format!("/{p}")
    }
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn now_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The contract's expiry rule: `deadline < now`, in whole seconds.
fn expired(deadline: i64) -> bool {
    deadline < now_secs()
}

impl Queue {
    fn resolve(
        entry: &super::QueueEntry,
        embedded: Option<&GatewayHandle>,
        cache_ttl: Duration,
    ) -> Result<Self, SimError> {
        let name = entry.queue_name.trim().to_owned();
        let (base, served_by) = match (non_empty(&entry.igw_base_url), embedded) {
            (Some(url), _) => (url.to_owned(), None),
            (None, Some(gw)) => (gw.base_url(), Some(gw)),
            (None, None) => {
                return Err(SimError::Config(format!(
                    "queue {name}: no igw_base_url; set one or run with --embedded-gateway"
                )))
            }
        };
        let base = base.trim_end_matches('/').to_owned();
        if !base.starts_with("http://") {
            return Err(SimError::Config(format!(
                "queue {name}: igw_base_url must be http://host[:port] (the simulator speaks plain HTTP), got {base:?}"
            )));
        }
        let path = normalize_path(non_empty(&entry.request_path_url).unwrap_or(DEFAULT_PATH));
        let url = format!("{base}{path}");
        url.parse::<Uri>().map_err(|e| {
            SimError::Config(format!("queue {name}: {url:?} is not a valid URL: {e}"))
        })?;
        let gate = Gate::from_entry(entry, served_by, &base)?.with_cache_ttl(cache_ttl);
        Ok(Queue {
            id: non_empty(&entry.id).unwrap_or(&name).to_owned(),
            base_url: base,
            path,
            objective: non_empty(&entry.inference_objective).map(str::to_owned),
            result_queue: non_empty(&entry.result_queue_name).map(str::to_owned),
            gate,
            claims: Arc::new(ClaimKeys::for_queue(&name)),
            name,
        })
    }
}

/// Built through batch-redis, so the simulator takes the processor's URL forms and TLS settings.
fn redis_client(url: &str, tls: Option<&batch_redis::RedisTls>) -> Result<RedisClient, SimError> {
    let options = batch_redis::ConnectOptions {
        connect_timeout: Duration::from_secs(2),
        command_timeout: Duration::from_secs(5),
        tls: tls.cloned(),
        ..batch_redis::ConnectOptions::default()
    };
    // The errors show the URL without its password.
    let mut builder = batch_redis::builder(url, &options).map_err(|e| match e {
        batch_redis::ConnectError::BadUrl { url, reason } => {
            SimError::Redis(format!("the redis URL {url} is invalid: {reason}"))
        }
        other => SimError::Redis(other.to_string()),
    })?;
    // Keep retrying when Redis is down at start, like every later outage.
    builder
        .with_config(|c| c.fail_fast = false)
        .set_policy(ReconnectPolicy::new_exponential(0, 100, 2_000, 2));
    builder
        .build()
        .map_err(|e| SimError::Redis(format!("cannot build the redis client: {e}")))
}

impl Shared {
    pub fn new(
        config: &DispatcherConfig,
        embedded: Option<&GatewayHandle>,
    ) -> Result<Self, SimError> {
        let queues = config
            .queues
            .iter()
            .map(|e| Queue::resolve(e, embedded, config.prometheus_cache_ttl).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        let redis = redis_client(&config.redis_url, config.redis_tls.as_ref())?;
        // Connects in the background; commands wait for the connection (up to their timeout).
        drop(redis.connect());
        let rng = match config.sim.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Ok(Self {
            redis,
            http: http::client(),
            queues,
            default_result_queue: config.default_result_queue.clone(),
            retry_queue: config.retry_queue.clone(),
            poll_interval: config.poll_interval,
            batch_size: config.batch_size,
            concurrency: config.concurrency,
            request_timeout: config.request_timeout,
            sim: config.sim.clone(),
            counters: Counters::default(),
            permits: Arc::new(Semaphore::new(config.concurrency)),
            rng: Mutex::new(rng),
            stop: CancellationToken::new(),
            kill: CancellationToken::new(),
            crash: CancellationToken::new(),
            crashed: AtomicBool::new(false),
            take_slots: AtomicU64::new(0),
            workers: TaskTracker::new(),
            version: config.version,
            instance_id: config.instance_id.clone(),
            scripts: Scripts::new(),
            held: Mutex::new(HashMap::new()),
        })
    }

    /// Starts the pollers; the handles end when taking stops.
    pub fn spawn_loops(self: Arc<Self>) -> Vec<JoinHandle<()>> {
        let mut tasks: Vec<JoinHandle<()>> = self
            .queues
            .iter()
            .map(|q| tokio::spawn(self.guarded(self.clone().poll_queue(q.clone()))))
            .collect();
        if self.version == DispatcherVersion::V0_10 {
            // v0.9.0 has no retry set: its retries go straight back into the request queue.
            tasks.push(tokio::spawn(self.guarded(self.clone().move_retries())));
            // Not ended by `stop`: leases in hand must be renewed until the last worker is
            // done, and only `kill` (or a crash) ends them.
            tokio::spawn(self.guarded(self.clone().heartbeat()));
            tokio::spawn(self.guarded(self.clone().reclaimer()));
        }
        tasks
    }

    /// Makes a task stop at its next await point once the dispatcher is killed.
    fn guarded<F: Future<Output = ()>>(&self, fut: F) -> impl Future<Output = ()> {
        let kill = self.kill.clone();
        async move {
            kill.run_until_cancelled(fut).await;
        }
    }

    pub fn stats(&self) -> DispatcherStats {
        let in_flight = self.concurrency - self.permits.available_permits();
        self.counters.snapshot(in_flight as u64)
    }

    pub fn crash_signal(&self) -> &CancellationToken {
        &self.crash
    }

    pub fn has_crashed(&self) -> bool {
        self.crashed.load(Ordering::SeqCst)
    }

    pub fn stop_taking(&self) {
        self.stop.cancel();
    }

    pub fn kill(&self) {
        self.kill.cancel();
    }

    /// Waits up to `grace` for workers and result writes in progress.
    pub async fn drain(&self, grace: Duration) {
        self.workers.close();
        let _ = tokio::time::timeout(grace, self.workers.wait()).await;
    }

    pub fn quit_in_background(&self) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let redis = self.redis.clone();
            runtime.spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(1), redis.quit()).await;
            });
        }
    }

    pub async fn quit(&self) {
        let _ = tokio::time::timeout(Duration::from_secs(1), self.redis.quit()).await;
    }

    /// Abrupt stop, as `kill -9` does to the real dispatcher: whatever is in hand is lost.
    fn crash(&self) {
        self.crashed.store(true, Ordering::SeqCst);
        tracing::error!(
            taken = self.counters.taken.load(Ordering::SeqCst),
            "crash-after reached: stopping abruptly"
        );
        self.crash.cancel();
        self.kill.cancel();
    }

    /// Reserves one take against `crash_after`; false once all are used.
    fn reserve_take(&self) -> bool {
        match self.sim.crash_after {
            None => true,
            Some(n) => {
                if self.take_slots.fetch_add(1, Ordering::SeqCst) < n {
                    true
                } else {
                    self.take_slots.fetch_sub(1, Ordering::SeqCst);
                    false
                }
            }
        }
    }

    fn unreserve_take(&self) {
        if self.sim.crash_after.is_some() {
            self.take_slots.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Counts a take; true when it was the one that triggers the crash.
    fn count_take(&self) -> bool {
        let taken = Counters::bump(&self.counters.taken);
        if self.sim.crash_after == Some(taken) {
            self.crash();
            return true;
        }
        false
    }

    fn redis_error(&self, what: &str, e: &fred::error::Error) {
        Counters::bump(&self.counters.redis_errors);
        tracing::warn!(operation = what, error = %e, "redis command failed");
    }

    /// Runs a Redis write until it succeeds; gives up only when the dispatcher crashed (or is
    /// killed, which ends the task).
    async fn redis_write<T, F, Fut>(&self, what: &str, mut op: F) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, fred::error::Error>>,
    {
        let mut pause = Duration::from_millis(50);
        loop {
            if self.has_crashed() {
                return None;
            }
            match op().await {
                Ok(v) => return Some(v),
                Err(e) => {
                    self.redis_error(what, &e);
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    async fn poll_queue(self: Arc<Self>, q: Arc<Queue>) {
        let mut ticker = tokio::time::interval(self.poll_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut failures: u32 = 0;
        loop {
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = ticker.tick() => {}
            }
            let budget = q.gate.budget(&self.redis, &self.http).await;
            let n = (self.batch_size as f64 * budget).floor() as usize;
            if n == 0 {
                // The real poller reads the depth of a queue its gate keeps shut (for a
                // metric); the same command keeps MONITOR traces alike.
                if let Err(e) = self.redis.zcard::<i64, _>(q.name.as_str()).await {
                    self.redis_error("ZCARD", &e);
                }
                continue;
            }
            let outcome = match self.version {
                DispatcherVersion::V0_9 => self.pop_each(&q, n).await,
                DispatcherVersion::V0_10 => self.claim_each(&q, n).await,
            };
            match outcome {
                Ok(Continue::Yes) => failures = 0,
                Ok(Continue::Stop) => return,
                Err(()) => {
                    failures = failures.saturating_add(1);
                    let pause = (self.poll_interval * failures.min(6)).min(Duration::from_secs(5));
                    tokio::select! {
                        _ = self.stop.cancelled() => return,
                        _ = tokio::time::sleep(pause) => {}
                    }
                }
            }
        }
    }

    /// v0.9: up to `n` ZPOPMIN, each message checked and handed to a worker.
    async fn pop_each(self: &Arc<Self>, q: &Arc<Queue>, n: usize) -> Result<Continue, ()> {
        for _ in 0..n {
            if self.stop.is_cancelled() || !self.reserve_take() {
                return Ok(Continue::Stop);
            }
            match self.zpopmin(&q.name).await {
                Ok(Some((member, score))) => {
                    if self.count_take() {
                        return Ok(Continue::Stop);
                    }
                    match Envelope::parse(&member) {
                        Ok(env) => {
                            let taken = Taken {
                                env,
                                claim: None,
                                release: None,
                            };
                            self.clone().take(q.clone(), taken, member, score).await;
                        }
                        Err(why) => self.drop_invalid(q, &why),
                    }
                }
                Ok(None) => {
                    self.unreserve_take();
                    break;
                }
                Err(e) => {
                    self.unreserve_take();
                    self.redis_error("ZPOPMIN", &e);
                    return Err(());
                }
            }
        }
        Ok(Continue::Yes)
    }

    /// One ZPOPMIN: the lowest score, i.e. the earliest deadline.
    async fn zpopmin(&self, key: &str) -> Result<Option<(String, f64)>, fred::error::Error> {
        let reply: Value = self.redis.zpopmin(key, None).await?;
        let Value::Array(items) = reply else {
            return Ok(None);
        };
        let mut items = items.into_iter();
        let (Some(member), Some(score)) = (items.next(), items.next()) else {
            return Ok(None);
        };
        let member = match member.as_bytes() {
            Some(b) => String::from_utf8_lossy(b).into_owned(),
            None => member.as_string().unwrap_or_default(),
        };
        Ok(Some((member, score.as_f64().unwrap_or(0.0))))
    }

    /// The checks made at dequeue, then a worker.
    async fn take(self: Arc<Self>, q: Arc<Queue>, taken: Taken, member: String, score: f64) {
        let env = &taken.env;
        if expired(env.data.deadline) {
            let answer = self.version == DispatcherVersion::V0_10
                || self.sim.expired == ExpiredPolicy::Result;
            if answer {
                let result = ResultMessage::failed(
                    &env.data.id,
                    codes::DEADLINE_EXCEEDED,
                    "deadline exceeded",
                );
                self.deliver(&q, taken, result);
            } else {
                Counters::bump(&self.counters.dropped_expired);
                tracing::info!(queue = %q.name, id = %env.data.id, deadline = env.data.deadline, "dropping an expired message");
                // The real one still clears the request's active and cancel keys.
                self.clear_request_state(env).await;
            }
            return;
        }
        if self.is_cancelled(env).await {
            self.deliver_cancelled(&q, taken);
            return;
        }
        // The gate decides here, in the poller, message by message: a refused member goes
        // back at its bare deadline and the next ZPOPMIN of this same poll may take it again.
        let mut taken = taken;
        match q.gate.apply(&self.redis, &self.http).await {
            Verdict::Refuse => {
                self.refuse(&q, taken).await;
                return;
            }
            Verdict::Continue(release) => taken.release = release,
        }
        // The real poller blocks here, message in hand, until a worker is free.
        let permit = tokio::select! {
            p = self.permits.clone().acquire_owned() => p,
            _ = self.stop.cancelled() => {
                self.put_back(&q.name, score, &member, taken.claim.as_ref()).await;
                return;
            }
        };
        let Ok(permit) = permit else { return };
        self.workers
            .spawn(self.guarded(self.clone().work(q, taken, permit)));
    }

    /// Graceful shutdown with a message in hand: return it unchanged (and release its claim).
    async fn put_back(&self, queue: &str, score: f64, member: &str, claim: Option<&Claim>) {
        self.redis_write("ZADD (put back)", || {
            self.redis
                .zadd::<i64, _, _>(queue, None, None, false, false, (score, member))
        })
        .await;
        if let Some(claim) = claim {
            self.release(claim).await;
        }
    }

    /// Writes the `CANCELLED` result.
    fn deliver_cancelled(self: &Arc<Self>, q: &Queue, taken: Taken) {
        let result = ResultMessage::failed(&taken.env.data.id, codes::CANCELLED, "cancelled");
        self.deliver(q, taken, result);
    }

    /// Whether the request's cancel marker matches its token.
    async fn is_cancelled(&self, env: &Envelope) -> bool {
        let Some(token) = env.token() else {
            return false;
        };
        let key = wire::cancel_marker_key(&env.data.id);
        match self.redis.get::<Option<String>, _>(key).await {
            Ok(marker) => marker.as_deref() == Some(token),
            Err(e) => {
                self.redis_error("GET cancel marker", &e);
                false
            }
        }
    }

    /// The real dispatcher's clean-up once a request is answered (or dropped as expired):
    /// `request-active:<id>` and `request-cancel:<id>` are deleted when they hold its token.
    async fn clear_request_state(&self, env: &Envelope) {
        let Some(token) = env.token() else { return };
        // One key per script: the two keys may live in different slots of a cluster.
        for key in [
            format!("request-active:{}", env.data.id),
            wire::cancel_marker_key(&env.data.id),
        ] {
            let cleared: Result<Value, _> = self
                .redis
                .eval(CLEAR_REQUEST_STATE, vec![key], vec![token.to_owned()])
                .await;
            if let Err(e) = cleared {
                self.redis_error("EVAL (clear request state)", &e);
            }
        }
    }
}

/// Deletes each key given (a request's active or cancel key) that holds the token ARGV[1]; the
/// caller never passes an empty token.
const CLEAR_REQUEST_STATE: &str = r#"
for _, key in ipairs(KEYS) do
  if redis.call("GET", key) == ARGV[1] then redis.call("DEL", key) end
end
return #KEYS
"#;

/// Whether a poller goes on after one batch.
enum Continue {
    Yes,
    Stop,
}
