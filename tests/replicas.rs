//! Several `processor serve` replicas on one Redis, one simulated dispatcher and one storage
//! directory (issue #12): batches spread over replicas, a replica killed with its disk, a rolling
//! restart, a replica frozen past its leases (fencing), a cancel sent through another replica;
//! and, on a gated dispatcher, a dead or stopped replica's jobs taken over (before queued
//! batches) and a frozen replica with nobody to take over going on with its job.
//!
//! Each replica is the real binary with its own `work_dir` and `replica_id`, short leases
//! (`lease_ttl` 2-3 s) and checkpoints, and a short `lost_request_timeout` so that requests
//! lost with a dead replica's disk are sent again soon.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use batch_testkit::RedisServer;
use bytes::Bytes;
use dispatcher_sim::{DispatcherHandle, GatewayConfig};
use hyper::Method;
use serde_json::Value;
use support::batches::*;
use support::serve::*;
use support::*;
use tokio_util::sync::CancellationToken;

/// The service's Redis keys under the default `serve.state_prefix`.
fn keys() -> batch_state::StateKeys {
    batch_state::StateKeys::new("batch-processor")
}
/// Every replica's `serve.lease_ttl`.
const LEASE_TTL: Duration = Duration::from_secs(3);
/// How long a whole set of batches may take to finish: 12 × 5,000 lines took 270-310 s on a
/// 2-core machine loaded by other builds (most of the CPU going to the simulators in this
/// process), so twice that.
const FINISH_LIMIT: Duration = Duration::from_secs(600);

// ---- the cluster: Redis, gateway, dispatcher, shared storage, N replicas ----

struct Cluster {
    env: Env,
    sim: Option<DispatcherHandle>,
    replicas: Vec<Service>,
    /// The bases the monitor may poll (replicas that answer now).
    live: Arc<Mutex<Vec<String>>>,
    /// The replicas' configs and stderr: kept when a test fails, removed by
    /// [`Cluster::shutdown`].
    logs: PathBuf,
    /// The S3 server (moto) when storage is S3 rather than a directory.
    _s3: Option<batch_testkit::S3Server>,
}

/// A submitted batch: its id, input lines, and the replica it was created through.
struct Submitted {
    id: String,
    lines: Vec<String>,
    via: usize,
}

impl Cluster {
    /// `n` replicas, each running up to `max_active_jobs` jobs; the gateway answers after
    /// `latency` and the dispatcher sends at most `concurrency` requests at once, which sets
    /// how long the batches run.
    ///
    /// `lost_request_timeout` is short (4 s) in the tests that lose a replica's disk or freeze
    /// it: the lines it had answered since its last checkpoint must be sent again. It is long
    /// elsewhere, because every quiet job then scans the dispatcher's whole request set.
    async fn start(
        n: usize,
        max_active_jobs: usize,
        latency: Duration,
        concurrency: usize,
        lost_request_timeout: &str,
    ) -> Self {
        Self::start_with(
            n,
            max_active_jobs,
            latency,
            concurrency,
            lost_request_timeout,
            false,
        )
        .await
    }

    /// [`Cluster::start`], on S3 storage (moto) when `s3`.
    async fn start_with(
        n: usize,
        max_active_jobs: usize,
        latency: Duration,
        concurrency: usize,
        lost_request_timeout: &str,
        s3: bool,
    ) -> Self {
        let s3 = s3.then(batch_testkit::S3Server::start);
        let env = Env::start(GatewayConfig {
            latency_fixed: latency,
            ..GatewayConfig::default()
        })
        .await;
        let sim = env
            .dispatcher(&["pool-a"], |c| c.concurrency = concurrency)
            .await;
        let storage = env.path("storage");
        std::fs::create_dir_all(&storage).unwrap();
        let storage_url = match &s3 {
            Some(s3) => format!("s3://{}/svc", s3.bucket()),
            None => format!("file://{}", storage.display()),
        };
        let test = std::thread::current()
            .name()
            .unwrap_or("test")
            .rsplit("::")
            .next()
            .unwrap_or("test")
            .to_owned();
        let logs = std::env::temp_dir().join(format!("replicas-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&logs).unwrap();
        let mut replicas = Vec::new();
        for i in 0..n {
            let name = format!("r{i}");
            let work_dir = env.path(&format!("work-{name}"));
            let yaml = format!(
                "dispatch_mode: async\n\
                 redis_url_file: {redis}\n\
                 work_dir: {work}\n\
                 async_dispatch:\n  result_poll_timeout: 200ms\n  lost_request_timeout: {lost_request_timeout}\n\
                 model_gateways:\n  llama-3:\n    inference_pool_name: pool-a\n\
                 serve:\n  storage: {storage_url}\n  reaper_interval: 200ms\n  \
                 replica_id: {name}\n  lease_ttl: {ttl}s\n  checkpoint_interval: 1s\n  \
                 max_active_jobs: {max_active_jobs}\n",
                redis = env.redis_url_file.display(),
                work = work_dir.display(),
                ttl = LEASE_TTL.as_secs(),
            );
            let config = logs.join(format!("{name}.yaml"));
            std::fs::write(&config, yaml).unwrap();
            let mut launch = Launch::new(&config).name(&name).work_dir(&work_dir);
            if let Some(s3) = &s3 {
                launch = launch.s3(s3);
            }
            replicas.push(launch.start());
        }
        let live = Arc::new(Mutex::new(
            replicas.iter().map(|r| r.base.clone()).collect(),
        ));
        Cluster {
            env,
            sim: Some(sim),
            replicas,
            live,
            logs,
            _s3: s3,
        }
    }

    fn redis(&self) -> &RedisServer {
        &self.env.redis
    }

    fn api(&self, i: usize) -> Api {
        self.replicas[i].client(None)
    }

    /// Takes replica `i` out of the monitor's rotation (before stopping or freezing it).
    fn unlist(&self, i: usize) {
        let base = &self.replicas[i].base;
        self.live.lock().unwrap().retain(|b| b != base);
    }

    fn relist(&self, i: usize) {
        self.live
            .lock()
            .unwrap()
            .push(self.replicas[i].base.clone());
    }

    /// Uploads and creates `count` batches of `lines` lines, through replica `k % n` for the
    /// k-th one.
    async fn submit(&self, count: usize, lines: usize) -> Vec<Submitted> {
        let mut out = Vec::new();
        for k in 0..count {
            let via = k % self.replicas.len();
            let api = self.api(via);
            let (text, input) = input_jsonl(&format!("b{k}"), lines, "llama-3");
            let file = api.upload_ok(&format!("b{k}.jsonl"), text.as_bytes()).await;
            let batch = api.create_batch_ok(&file).await;
            out.push(Submitted {
                id: batch["id"].as_str().expect("a batch id").to_owned(),
                lines: input,
                via,
            });
        }
        out
    }

    /// Which replica each running job was given to (`{prefix}:running`).
    fn running(&self) -> BTreeMap<String, String> {
        let flat = self.redis().command_list(&["HGETALL", &keys().running()]);
        flat.chunks(2)
            .map(|kv| (kv[0].clone(), kv[1].clone()))
            .collect()
    }

    /// Job `id`'s lease value `replica#epoch`, if held.
    fn lease(&self, id: &str) -> Option<String> {
        let v = self.redis().command(&["GET", &keys().lease(id)]);
        (v != "(nil)").then_some(v)
    }

    /// The jobs replica `name` runs now (by their leases).
    fn jobs_of(&self, name: &str) -> Vec<String> {
        self.running()
            .into_keys()
            .filter(|id| {
                self.lease(id)
                    .is_some_and(|l| l.split('#').next() == Some(name))
            })
            .collect()
    }

    /// Waits until every batch is final; returns them as replica `via` shows them.
    async fn wait_all_final(&self, batches: &[Submitted], via: usize) -> Vec<Value> {
        let api = self.api(via);
        let deadline = Instant::now() + FINISH_LIMIT;
        let mut out = Vec::new();
        for b in batches {
            loop {
                let batch = api.batch(&b.id).await;
                if is_final(batch["status"].as_str().unwrap_or("")) {
                    out.push(batch);
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "not final within {FINISH_LIMIT:?}: {batch}\n{}",
                    self.all_stderr()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        out
    }

    /// Checks a finished batch through replica `via`: completed, every line once across its
    /// output and error files, each answer its own line's, counts to match.
    async fn check_completed(&self, b: &Submitted, batch: &Value, via: usize) {
        assert_eq!(batch["status"], "completed", "{batch}");
        let results = self.api(via).results(batch).await;
        results.assert_each_once(&b.lines);
        results.assert_answers_match(&b.lines);
        let n = b.lines.len() as u64;
        assert_eq!(batch["request_counts"]["total"], n, "{batch}");
        assert_eq!(
            batch["request_counts"]["completed"].as_u64().unwrap()
                + batch["request_counts"]["failed"].as_u64().unwrap(),
            n,
            "{batch}"
        );
        assert_eq!(
            batch["request_counts"]["completed"].as_u64().unwrap(),
            results.output.len() as u64,
            "{batch}"
        );
        // A job resumed from a checkpoint counts each line's usage once, as a run without a
        // break would: the sum over the lines uploaded.
        let sum = |key: &str| -> u64 {
            results
                .output
                .iter()
                .map(|l| l["response"]["body"]["usage"][key].as_u64().unwrap_or(0))
                .sum()
        };
        let usage = &batch["usage"];
        assert_eq!(usage["input_tokens"], sum("prompt_tokens"), "{batch}");
        assert_eq!(usage["output_tokens"], sum("completion_tokens"), "{batch}");
        assert_eq!(usage["total_tokens"], sum("total_tokens"), "{batch}");
    }

    fn all_stderr(&self) -> String {
        let tails = self
            .replicas
            .iter()
            .map(|r| format!("==== {} (last lines) ====\n{}", r.name(), r.stderr_tail(40)))
            .collect::<Vec<_>>()
            .join("\n");
        format!("{tails}\n(all logs in {})", self.logs.display())
    }

    async fn shutdown(mut self) {
        for r in &mut self.replicas {
            r.kill9();
        }
        let _ = std::fs::remove_dir_all(&self.logs);
        if let Some(sim) = self.sim.take() {
            sim.shutdown().await;
        }
    }
}

// ---- a monitor: polls every batch through live replicas and keeps what it saw ----

#[derive(Debug, Clone)]
struct Sample {
    at: Instant,
    status: String,
    completed: u64,
    failed: u64,
    /// The epoch of the job's checkpoint record in Redis (0: none).
    checkpoint_epoch: u64,
    /// The job's lease holder (`replica#epoch`), empty when none.
    holder: String,
}

struct Monitor {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<HashMap<String, Vec<Sample>>>,
}

impl Monitor {
    fn start(cluster: &Cluster, ids: Vec<String>) -> Monitor {
        let stop = CancellationToken::new();
        let live = cluster.live.clone();
        let redis_port = cluster.redis().port();
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let mut seen: HashMap<String, Vec<Sample>> = HashMap::new();
            let mut turn = 0usize;
            while !token.is_cancelled() {
                for id in &ids {
                    let bases = live.lock().unwrap().clone();
                    let mut batch = None;
                    for k in 0..bases.len() {
                        let api = Api::new(&bases[(turn + k) % bases.len()], None);
                        if let Ok(resp) = api
                            .try_send(Method::GET, &format!("/v1/batches/{id}"), &[], Bytes::new())
                            .await
                        {
                            if resp.status == 200 {
                                batch = serde_json::from_slice::<Value>(&resp.body).ok();
                                break;
                            }
                        }
                    }
                    turn += 1;
                    let Some(batch) = batch else { continue };
                    let key = keys().checkpoint(id);
                    let checkpoint = batch_testkit::command_on(redis_port, &["GET", &key]);
                    let checkpoint_epoch = serde_json::from_str::<Value>(&checkpoint[0])
                        .ok()
                        .and_then(|c| c["epoch"].as_u64())
                        .unwrap_or(0);
                    let key = keys().lease(id);
                    let lease = batch_testkit::command_on(redis_port, &["GET", &key]);
                    let holder = lease[0].replace("(nil)", "");
                    let counts = &batch["request_counts"];
                    seen.entry(id.clone()).or_default().push(Sample {
                        at: Instant::now(),
                        status: batch["status"].as_str().unwrap_or("").to_owned(),
                        completed: counts["completed"].as_u64().unwrap_or(0),
                        failed: counts["failed"].as_u64().unwrap_or(0),
                        checkpoint_epoch,
                        holder,
                    });
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            seen
        });
        Monitor { stop, task }
    }

    async fn finish(self) -> HashMap<String, Vec<Sample>> {
        self.stop.cancel();
        self.task.await.expect("the monitor")
    }
}

/// Panics if any batch was seen cancelled, cancelling, failed or expired.
fn assert_never_stopped(seen: &HashMap<String, Vec<Sample>>) {
    for (id, samples) in seen {
        for s in samples {
            assert!(
                !matches!(
                    s.status.as_str(),
                    "cancelled" | "cancelling" | "failed" | "expired"
                ),
                "{id} was seen {}",
                s.status
            );
        }
    }
}

/// The longest time a batch that had started making progress went without any, before all its
/// lines were done.
fn longest_idle(samples: &[Sample], total: u64) -> Duration {
    let mut longest = Duration::ZERO;
    let mut last: Option<(Instant, u64)> = None;
    for s in samples {
        let done = s.completed + s.failed;
        if done >= total || is_final(&s.status) {
            break;
        }
        match last {
            Some((_, d)) if d == done => {}
            _ if done == 0 => {}
            _ => last = Some((s.at, done)),
        }
        if let Some((since, _)) = last {
            longest = longest.max(s.at - since);
        }
    }
    longest
}

/// Panics if the counts of a batch went backwards at or after `from`.
fn assert_monotone_from(id: &str, samples: &[Sample], from: Instant) {
    let mut prev: Option<&Sample> = None;
    for s in samples.iter().filter(|s| s.at >= from) {
        if let Some(p) = prev {
            assert!(
                s.completed >= p.completed && s.failed >= p.failed,
                "{id}: counts went back from {}/{} to {}/{} (completed/failed): a stale record was saved",
                p.completed,
                p.failed,
                s.completed,
                s.failed
            );
            assert!(
                s.checkpoint_epoch == 0 || s.checkpoint_epoch >= p.checkpoint_epoch,
                "{id}: the checkpoint went back from epoch {} to {}",
                p.checkpoint_epoch,
                s.checkpoint_epoch
            );
        }
        prev = Some(s);
    }
}

// ---- the tests ----

/// How long a batch that had started may go without progress during a handover.
const IDLE_LIMIT: Duration = Duration::from_secs(10);

/// The index of the replica named `name`.
fn index_of(name: &str) -> usize {
    name.trim_start_matches('r')
        .parse()
        .expect("a replica name r<i>")
}

/// The replica part of a lease value `replica#epoch`.
fn holder_name(lease: &str) -> &str {
    lease.split('#').next().unwrap_or("")
}

/// Waits until every batch runs under a lease and one of them is part done; returns that one's
/// index. (The dispatcher takes the earliest deadline first, so batches created one after the
/// other are answered mostly one after the other.)
async fn wait_running(cluster: &Cluster, batches: &[Submitted]) -> usize {
    eventually(
        "every batch to run under a lease",
        Duration::from_secs(60),
        || batches.iter().all(|b| cluster.lease(&b.id).is_some()),
    )
    .await;
    let api = cluster.api(0);
    let start = Instant::now();
    loop {
        for (i, b) in batches.iter().enumerate() {
            let batch = api.batch(&b.id).await;
            let c = &batch["request_counts"];
            let done = c["completed"].as_u64().unwrap_or(0) + c["failed"].as_u64().unwrap_or(0);
            if done > 0 && done < b.lines.len() as u64 {
                return i;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no batch part done within 60 s\n{}",
            cluster.all_stderr()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The replica holding batch `id`'s lease, and every job it holds.
fn holder_of(cluster: &Cluster, id: &str) -> (usize, Vec<String>) {
    let lease = cluster.lease(id).expect("a lease");
    let name = holder_name(&lease);
    (index_of(name), cluster.jobs_of(name))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_complete_twelve_batches_each_line_once() {
    let cluster = Cluster::start(3, 16, Duration::ZERO, 64, "10m").await;
    let started = Instant::now();
    let batches = cluster.submit(12, LINES_12).await;
    let monitor = Monitor::start(&cluster, batches.iter().map(|b| b.id.clone()).collect());
    let finals = cluster.wait_all_final(&batches, 1).await;
    eprintln!(
        "12 × {LINES_12} lines on 3 replicas: {:?}",
        started.elapsed()
    );
    // Read back through another replica than the one the batch was created through.
    for (b, batch) in batches.iter().zip(&finals) {
        cluster.check_completed(b, batch, (b.via + 1) % 3).await;
    }
    let seen = monitor.finish().await;
    assert_never_stopped(&seen);
    // The work was spread: every replica held some job's lease.
    let holders: std::collections::BTreeSet<String> = seen
        .values()
        .flatten()
        .map(|s| holder_name(&s.holder).to_owned())
        .filter(|h| !h.is_empty())
        .collect();
    assert_eq!(holders.len(), 3, "leases were held by {holders:?} only");
    assert!(cluster.running().is_empty(), "{:?}", cluster.running());
    cluster.shutdown().await;
}

/// Lines per batch in the twelve-batch test.
const LINES_12: usize = 5000;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_killed_with_its_disk_loses_no_job_and_no_line() {
    let mut cluster = Cluster::start(3, 4, SLOW_LATENCY, SLOW_CONCURRENCY, "4s").await;
    let batches = cluster.submit(4, LINES_SLOW).await;
    let monitor = Monitor::start(&cluster, batches.iter().map(|b| b.id.clone()).collect());
    let current = wait_running(&cluster, &batches).await;
    let (victim, lost) = holder_of(&cluster, &batches[current].id);
    // Each of its jobs has a checkpoint to be restored from.
    eventually(
        "checkpoints of the victim's jobs",
        Duration::from_secs(30),
        || {
            lost.iter()
                .all(|id| cluster.redis().command(&["EXISTS", &keys().checkpoint(id)]) == ":1")
        },
    )
    .await;
    let name = cluster.replicas[victim].name().to_owned();
    cluster.unlist(victim);
    cluster.replicas[victim].kill9();
    let killed = Instant::now();
    std::fs::remove_dir_all(cluster.replicas[victim].work_dir()).expect("deleting its work dir");

    let adopted = eventually(
        "the killed replica's jobs to be taken over",
        LEASE_TTL + Duration::from_secs(20),
        || {
            lost.iter()
                .all(|id| cluster.lease(id).is_some_and(|l| holder_name(&l) != name))
        },
    )
    .await;
    let alive = [(victim + 1) % 3, (victim + 2) % 3];
    let finals = cluster.wait_all_final(&batches, alive[0]).await;
    eprintln!(
        "{name} killed with {} jobs: taken over after {adopted:?}, all final after {:?}",
        lost.len(),
        killed.elapsed()
    );
    for (b, batch) in batches.iter().zip(&finals) {
        cluster.check_completed(b, batch, alive[1]).await;
    }
    let seen = monitor.finish().await;
    assert_never_stopped(&seen);
    // The adopters rebuilt the lost jobs from their checkpoints in storage.
    let logs: String = alive
        .iter()
        .map(|&i| cluster.replicas[i].all_stderr())
        .collect();
    for id in &lost {
        assert!(
            logs.lines()
                .any(|l| l.contains("resuming from a checkpoint") && l.contains(id.as_str())),
            "no replica resumed {id} from its checkpoint:\n{}",
            cluster.all_stderr()
        );
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rolling_restart_fails_no_job_and_idles_none() {
    let mut cluster = Cluster::start(3, 6, SLOW_LATENCY, SLOW_CONCURRENCY, "10m").await;
    let batches = cluster.submit(4, LINES_SLOW).await;
    let monitor = Monitor::start(&cluster, batches.iter().map(|b| b.id.clone()).collect());
    wait_running(&cluster, &batches).await;
    let mut handed_over = 0;
    for i in 0..3 {
        let name = cluster.replicas[i].name().to_owned();
        let had = cluster.jobs_of(&name);
        cluster.unlist(i);
        let (status, took) =
            cluster.replicas[i].signal_and_wait(libc::SIGTERM, Duration::from_secs(15));
        assert!(
            status.success(),
            "{name} exited with {status} after SIGTERM:\n{}",
            cluster.replicas[i].all_stderr()
        );
        // Its leases were let go: the others take its jobs without waiting for them to lapse.
        let adopted = eventually(
            "the stopped replica's jobs to be taken over",
            Duration::from_secs(20),
            || {
                had.iter().all(|id| {
                    cluster.lease(id).is_some_and(|l| holder_name(&l) != name)
                        || !cluster.running().contains_key(id)
                })
            },
        )
        .await;
        eprintln!(
            "{name}: stopped in {took:?} with {} jobs, taken over after {adopted:?}",
            had.len()
        );
        handed_over += had.len();
        cluster.replicas[i].restart();
        cluster.relist(i);
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    assert!(handed_over > 0, "no job ran on a stopped replica");
    let finals = cluster.wait_all_final(&batches, 0).await;
    for (b, batch) in batches.iter().zip(&finals) {
        cluster.check_completed(b, batch, 1).await;
    }
    // Each line reached the gateway once: what the dispatcher was sending when a replica
    // stopped was not taken for lost by the replica that took its job over.
    let lines: usize = batches.iter().map(|b| b.lines.len()).sum();
    assert_eq!(
        cluster.env.gateway.stats().total,
        lines as u64,
        "lines sent more than once"
    );
    let seen = monitor.finish().await;
    assert_never_stopped(&seen);
    for b in &batches {
        let idle = longest_idle(&seen[&b.id], b.lines.len() as u64);
        eprintln!("{}: longest without progress {idle:?}", b.id);
        assert!(
            idle < IDLE_LIMIT,
            "{} made no progress for {idle:?}\n{}",
            b.id,
            cluster.all_stderr()
        );
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_replica_is_fenced_and_writes_nothing_more() {
    let cluster = Cluster::start(3, 4, SLOW_LATENCY, SLOW_CONCURRENCY, "4s").await;
    let batches = cluster.submit(4, LINES_SLOW).await;
    let monitor = Monitor::start(&cluster, batches.iter().map(|b| b.id.clone()).collect());
    let current = wait_running(&cluster, &batches).await;
    let (victim, lost) = holder_of(&cluster, &batches[current].id);
    let name = cluster.replicas[victim].name().to_owned();
    let epochs: Vec<u64> = lost
        .iter()
        .map(|id| {
            let lease = cluster.lease(id).expect("a lease");
            lease.rsplit('#').next().unwrap().parse().expect("an epoch")
        })
        .collect();
    let alive = [(victim + 1) % 3, (victim + 2) % 3];
    let api = cluster.api(alive[0]);
    cluster.unlist(victim);
    cluster.replicas[victim].signal(libc::SIGSTOP);
    // A save in flight when it froze may still land.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let frozen = Instant::now();
    let mut frozen_counts = Vec::new();
    for id in &lost {
        frozen_counts.push(api.batch(id).await["request_counts"].clone());
    }
    let adopted = eventually(
        "the frozen replica's jobs to be taken over",
        LEASE_TTL + Duration::from_secs(20),
        || {
            lost.iter()
                .all(|id| cluster.lease(id).is_some_and(|l| holder_name(&l) != name))
        },
    )
    .await;
    // The new holder of the batch that was being answered publishes its own counts before the
    // frozen replica wakes up.
    let start = Instant::now();
    let at = lost
        .iter()
        .position(|id| *id == batches[current].id)
        .expect("the current batch");
    {
        let (id, before) = (&lost[at], &frozen_counts[at]);
        loop {
            let b = api.batch(id).await;
            if &b["request_counts"] != before || is_final(b["status"].as_str().unwrap()) {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{id}: the new holder published nothing: {b}\n{}",
                cluster.all_stderr()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let from = Instant::now();
    cluster.replicas[victim].signal(libc::SIGCONT);
    let noticed = eventually(
        "the resumed replica to notice its lost leases",
        Duration::from_secs(20),
        || {
            let log = cluster.replicas[victim].all_stderr();
            lost.iter().all(|id| {
                log.lines().any(|l| {
                    l.contains("lost the job's lease to another replica") && l.contains(id.as_str())
                })
            })
        },
    )
    .await;
    eprintln!(
        "{name} frozen with {} jobs: taken over after {adopted:?}; after SIGCONT it saw the loss in {noticed:?}",
        lost.len()
    );
    // It still serves (and may take new jobs); only its old leases are gone.
    let health = cluster.api(victim).get("/health").await;
    assert_eq!(health.status, 200);
    cluster.relist(victim);
    let finals = cluster.wait_all_final(&batches, alive[1]).await;
    for (b, batch) in batches.iter().zip(&finals) {
        cluster.check_completed(b, batch, victim).await;
    }
    // The replica that lost its leases counts none of those jobs' requests in flight any more.
    for replica in &cluster.replicas {
        replica.expect_idle_gauges(Duration::from_secs(5)).await;
    }
    let seen = monitor.finish().await;
    assert_never_stopped(&seen);
    for (id, before) in lost.iter().zip(&frozen_counts) {
        // From the new holder's first change on (it may restart from an older checkpoint).
        let samples = &seen[id];
        let changed = samples
            .iter()
            .filter(|s| s.at >= frozen)
            .find(|s| {
                s.completed != before["completed"].as_u64().unwrap()
                    || s.failed != before["failed"].as_u64().unwrap()
            })
            .map_or(from, |s| s.at);
        assert_monotone_from(id, samples, changed);
    }
    // Every lost job moved to a later epoch, which fences the frozen replica's writes.
    for (id, epoch) in lost.iter().zip(&epochs) {
        let now: u64 = cluster
            .redis()
            .command(&["GET", &keys().epoch(id)])
            .parse()
            .expect("an epoch");
        assert!(
            now > *epoch,
            "{id}: epoch {now}, the frozen replica had {epoch}"
        );
        // Its result files were uploaded under the new holder's epoch only.
        let results = cluster.env.path("storage").join("results").join(id);
        let dirs: Vec<String> = std::fs::read_dir(&results)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        assert!(
            !dirs.contains(&epoch.to_string()),
            "{id}: the frozen replica uploaded results under epoch {epoch}: {dirs:?}"
        );
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_through_another_replica_reaches_the_running_one() {
    let cluster = Cluster::start(3, 4, SLOW_LATENCY, SLOW_CONCURRENCY, "10m").await;
    // Created through r0.
    let batches = cluster.submit(1, LINES_SLOW).await;
    let b = &batches[0];
    wait_running(&cluster, &batches).await;
    let runner = index_of(holder_name(&cluster.lease(&b.id).expect("a lease")));
    // Cancelled through a replica that does not run it, polled through the third one.
    let (canceller, poller) = match runner {
        0 => (1, 2),
        1 => (2, 0),
        _ => (1, 0),
    };
    let polled = cluster.api(poller).batch(&b.id).await;
    assert_eq!(polled["status"], "in_progress", "{polled}");
    let answer = cluster.api(canceller).cancel(&b.id).await;
    assert_eq!(answer["status"], "cancelling", "{answer}");
    let reached = eventually(
        "the running replica to see the cancel",
        Duration::from_secs(20),
        || {
            cluster.replicas[runner]
                .all_stderr()
                .lines()
                .any(|l| l.contains("cancel requested") && l.contains(b.id.as_str()))
        },
    )
    .await;
    eprintln!("the cancel reached r{runner} after {reached:?}");
    assert!(
        reached < Duration::from_secs(10),
        "the cancel took {reached:?} to reach the running replica"
    );
    let batch = cluster.wait_all_final(&batches, poller).await.remove(0);
    assert_eq!(batch["status"], "cancelled", "{batch}");
    let results = cluster.api(poller).results(&batch).await;
    results.assert_each_once(&b.lines);
    let codes = results.error_codes();
    assert!(
        codes.get("batch_cancelled").is_some_and(|&n| n > 0),
        "the cancel came after every line: {codes:?}"
    );
    assert_eq!(
        batch["request_counts"]["completed"].as_u64().unwrap(),
        results.output.len() as u64,
        "{batch}"
    );
    cluster.shutdown().await;
}

/// The gateway's latency and the dispatcher's concurrency of the tests that act mid-run: slow
/// enough that batches of [`LINES_SLOW`] run for a while.
const SLOW_LATENCY: Duration = Duration::from_millis(20);
const SLOW_CONCURRENCY: usize = 10;
/// Lines per batch in the tests that act mid-run.
const LINES_SLOW: usize = 1000;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_running_batch_shows_its_lines_so_far_through_another_replica() {
    // Slow enough (1000 lines, 4 at a time, 50 ms each: 12 s at least) for checkpoints to come
    // while it runs.
    let cluster = Cluster::start(2, 4, Duration::from_millis(50), 4, "10m").await;
    let batches = cluster.submit(1, LINES_SLOW).await;
    let b = &batches[0];
    wait_running(&cluster, &batches).await;
    let runner = index_of(holder_name(&cluster.lease(&b.id).expect("a lease")));
    let other = cluster.api(1 - runner);
    let start = Instant::now();
    let (so_far, batch) = loop {
        let lines = other
            .get(&format!("/v1/batches/{}/output", b.id))
            .await
            .jsonl();
        // Still running after the lines were read: they were read while it ran.
        let batch = other.batch(&b.id).await;
        let running = !is_final(batch["status"].as_str().unwrap_or(""));
        if running && !lines.is_empty() {
            break (lines, batch);
        }
        assert!(
            running && start.elapsed() < FINISH_LIMIT,
            "r{} showed no line of {} while it ran on r{runner}: {batch}\n{}",
            1 - runner,
            b.id,
            cluster.all_stderr()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "r{} showed {} lines after {:?} (status {})",
        1 - runner,
        so_far.len(),
        start.elapsed(),
        batch["status"]
    );
    let partial = support::Results {
        output: so_far,
        error: Vec::new(),
    };
    partial.assert_answers_match(&b.lines);
    let mut ids: Vec<&str> = partial
        .output
        .iter()
        .map(|l| l["custom_id"].as_str().unwrap())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), partial.output.len(), "a line shown twice");
    let batch = cluster.wait_all_final(&batches, 1 - runner).await.remove(0);
    cluster.check_completed(b, &batch, 1 - runner).await;
    cluster.shutdown().await;
}

// ---- Redis loses the service's state (issue #29) ----

/// How Redis loses the state.
#[derive(Debug, Clone, Copy)]
enum Loss {
    /// `FLUSHALL`.
    Flush,
    /// Killed and started again with no persistence: empty.
    RestartEmpty,
}

/// How soon every batch must be listed again after the loss.
const RELIST_LIMIT: Duration = Duration::from_secs(30);

/// Every batch of the tenant as one page (`limit=100`), ids and metadata; `None` while the
/// service does not answer 200.
async fn listing(api: &Api) -> Option<Vec<(String, Value)>> {
    let resp = api.get("/v1/batches?limit=100").await;
    if resp.status != 200 {
        return None;
    }
    let page = resp.json();
    Some(
        page["data"]
            .as_array()?
            .iter()
            .map(|b| {
                (
                    b["id"].as_str().unwrap_or("").to_owned(),
                    b["metadata"].clone(),
                )
            })
            .collect(),
    )
}

/// Six batches on two replicas of two slots each (four running, two queued), one cancelled
/// while it runs; Redis loses everything. Each batch is listed again (same metadata, same
/// pages) within [`RELIST_LIMIT`] and ends with every line once; the input files stay readable.
async fn batches_survive_a_redis_that_forgets(s3: bool, loss: Loss) {
    let mut cluster = Cluster::start_with(2, 2, SLOW_LATENCY, SLOW_CONCURRENCY, "4s", s3).await;
    let api = cluster.api(0);
    let mut batches = Vec::new();
    let mut inputs = Vec::new();
    for k in 0..6 {
        let (text, lines) = input_jsonl(&format!("b{k}"), LINES_SLOW, "llama-3");
        let file = api.upload_ok(&format!("b{k}.jsonl"), text.as_bytes()).await;
        let body = serde_json::json!({
            "input_file_id": file,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "metadata": {"k": k.to_string()},
        });
        let batch = api.post_json("/v1/batches", &body).await.expect(200);
        let id = batch["id"].as_str().expect("a batch id").to_owned();
        batches.push(Submitted { id, lines, via: 0 });
        inputs.push((file, text));
    }
    let checkpoints = keys().checkpoint("*");
    eventually(
        "four batches running, one checkpointed",
        Duration::from_secs(60),
        || {
            cluster.running().len() >= 4
                && !cluster
                    .redis()
                    .command_list(&["KEYS", &checkpoints])
                    .is_empty()
        },
    )
    .await;
    let running: Vec<String> = cluster.running().into_keys().collect();
    let cancelled = running[0].clone();
    let answer = api.cancel(&cancelled).await;
    assert_eq!(answer["status"], "cancelling", "{answer}");
    let before = api.list_all("/v1/batches", "", 2).await;
    let files_before = api.list_all("/v1/files", "", 4).await;
    assert_eq!(before.len(), 6);
    let want: Vec<(String, Value)> = before
        .iter()
        .map(|b| (b["id"].as_str().unwrap().to_owned(), b["metadata"].clone()))
        .collect();

    match loss {
        Loss::Flush => assert_eq!(cluster.redis().command(&["FLUSHALL"]), "+OK"),
        Loss::RestartEmpty => cluster.env.redis.restart(),
    }
    let lost_at = Instant::now();
    for i in 0..2 {
        let api = cluster.api(i);
        loop {
            if listing(&api).await.as_ref() == Some(&want) {
                break;
            }
            assert!(
                lost_at.elapsed() < RELIST_LIMIT,
                "r{i} did not list every batch again within {RELIST_LIMIT:?}: {:?}\n{}",
                listing(&api).await,
                cluster.all_stderr()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let relisted = lost_at.elapsed();
    eprintln!("every batch listed again on both replicas {relisted:?} after the loss");
    // The same pages, the same cursors.
    let after = cluster.api(1).list_all("/v1/batches", "", 2).await;
    assert_eq!(
        after.iter().map(|b| b["id"].clone()).collect::<Vec<_>>(),
        before.iter().map(|b| b["id"].clone()).collect::<Vec<_>>()
    );
    // Result files of batches that ended since come on top; those listed before stay, in order.
    let files_before: Vec<Value> = files_before.iter().map(|f| f["id"].clone()).collect();
    let files_after: Vec<Value> = cluster
        .api(1)
        .list_all("/v1/files", "", 4)
        .await
        .iter()
        .map(|f| f["id"].clone())
        .filter(|id| files_before.contains(id))
        .collect();
    assert_eq!(files_after, files_before);

    let finals = cluster.wait_all_final(&batches, 1).await;
    for (b, batch) in batches.iter().zip(&finals) {
        if b.id == cancelled {
            assert_eq!(batch["status"], "cancelled", "{batch}");
            cluster
                .api(1)
                .results(batch)
                .await
                .assert_each_once(&b.lines);
        } else {
            cluster.check_completed(b, batch, 1).await;
        }
        assert_eq!(
            batch["metadata"],
            want.iter().find(|w| w.0 == b.id).unwrap().1
        );
    }
    for (file, text) in &inputs {
        let content = cluster
            .api(1)
            .get(&format!("/v1/files/{file}/content"))
            .await;
        assert_eq!(content.status, 200, "{file}: {}", content.text());
        assert!(content.body == text.as_bytes(), "{file}: other content");
    }
    let logs: String = cluster.replicas.iter().map(|r| r.all_stderr()).collect();
    assert!(
        logs.contains("Redis lost the service's state"),
        "the loss was not named:\n{}",
        cluster.all_stderr()
    );
    assert!(
        !logs.contains("lost the job's lease to another replica"),
        "the loss was blamed on another replica:\n{}",
        logs.lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flushall_while_batches_run_loses_no_batch() {
    batches_survive_a_redis_that_forgets(false, Loss::Flush).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_restarted_empty_while_batches_run_loses_no_batch() {
    batches_survive_a_redis_that_forgets(false, Loss::RestartEmpty).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flushall_loses_no_batch_on_s3() {
    batches_survive_a_redis_that_forgets(true, Loss::Flush).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_restarted_empty_loses_no_batch_on_s3() {
    batches_survive_a_redis_that_forgets(true, Loss::RestartEmpty).await;
}

// Two replicas on a gated dispatcher: takeover of a dead or stopped replica's jobs, and a
// frozen replica with nobody to take over.

/// The config of replica `n` of one service: shared Redis, storage and keys; its own work
/// directory (its own disk) and name; a 2 s job lease, checkpoints every 300 ms, two jobs at
/// once. Lines whose results went down with a replica's disk are sent again after 3 s.
fn replica_config(env: &Env, n: usize) -> PathBuf {
    let shared = env.async_config(&[("llama-3", "pool-a")], "  lost_request_timeout: 3s\n");
    let own_work_dir = std::fs::read_to_string(&shared).unwrap().replace(
        &format!("work_dir: {}\n", env.path("work").display()),
        &format!("work_dir: {}\n", env.path(&format!("work-{n}")).display()),
    );
    let config = env.path(&format!("replica-{n}.yaml"));
    std::fs::write(&config, own_work_dir).unwrap();
    let storage = env.path("storage");
    std::fs::create_dir_all(&storage).unwrap();
    add_serve_section(
        &config,
        &storage,
        TWO_TENANTS,
        &format!(
            "  replica_id: replica-{n}\n  lease_ttl: 2s\n  checkpoint_interval: 300ms\n  max_active_jobs: 2\n"
        ),
        "",
    );
    config
}

/// Two replicas running one job at a time, four batches: replica 1 dies with its job mid-way.
/// The slot replica 2 frees next goes to that job, before the two batches still queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_freed_slot_takes_over_a_dead_replicas_job_before_a_queued_one() {
    let env = Env::start(slow_gateway()).await;
    let sim = gated_dispatcher(&env).await;
    let one_at_a_time = |n| {
        let config = replica_config(&env, n);
        let yaml = std::fs::read_to_string(&config).unwrap();
        std::fs::write(
            &config,
            yaml.replace("max_active_jobs: 2", "max_active_jobs: 1"),
        )
        .unwrap();
        config
    };
    let mut one = Service::start(&one_at_a_time(1));
    let two = Service::start(&one_at_a_time(2));
    let api = two.client(Some(KEY_A));
    let mut batches = Vec::new();
    for i in 0..4 {
        let (text, lines) = input_jsonl(&format!("q{i}"), 150, "llama-3");
        let file = api.upload_ok(&format!("q{i}.jsonl"), text.as_bytes()).await;
        batches.push((id_of(&api.create_batch_ok(&file).await), lines));
    }
    let running = || -> BTreeMap<String, String> {
        let flat = env.redis.command_list(&["HGETALL", &keys().running()]);
        flat.chunks(2)
            .map(|kv| (kv[0].clone(), kv[1].clone()))
            .collect()
    };
    let deadline = Instant::now() + FINISH;
    while running().len() < 2 {
        assert!(Instant::now() < deadline, "two jobs did not start");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let held = running();
    let dead = held
        .iter()
        .find(|(_, r)| r.as_str() == "replica-1")
        .map(|(id, _)| id.clone())
        .expect("replica 1 runs a job");
    let queued: Vec<String> = batches
        .iter()
        .map(|(id, _)| id.clone())
        .filter(|id| !held.contains_key(id))
        .collect();
    // The gate stays closed until the dead replica's lease is gone, so replica 2's own job
    // cannot finish and free its slot while the dead job still looks alive, however fast or
    // slow the machine (the dispatcher sends the older job's lines first, so any opening before
    // could finish replica 2's job).
    one.kill9();
    let lease = keys().lease(&dead);
    while env.redis.command(&["EXISTS", &lease]) != ":0" {
        assert!(
            Instant::now() < deadline,
            "the dead replica's lease did not lapse"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let own = held
        .keys()
        .find(|id| **id != dead)
        .expect("replica 2 runs a job");
    let own = api.batch(own).await;
    assert_eq!(
        count(&own, "completed"),
        0,
        "lines went through a closed gate: {own}"
    );
    gate(&env, true);
    for (id, lines) in &batches {
        let batch = api.wait_final(id, FINISH).await;
        assert_eq!(batch["status"], "completed", "{batch}");
        api.results(&batch).await.assert_each_once(lines);
    }
    let adopted = api.batch(&dead).await;
    for id in &queued {
        let later = api.batch(id).await;
        assert!(
            adopted["completed_at"].as_u64() <= later["in_progress_at"].as_u64(),
            "a queued batch started before the dead replica's job was done: {adopted} {later}"
        );
    }
    sim.shutdown().await;
}

/// Four batches of 60 lines on two replicas, two each at once; `stop` ends replica 1 mid-way.
/// Replica 2 finishes every batch, each line exactly once, and lists everything as before.
async fn a_replica_stopped_mid_job_is_taken_over(stop: impl FnOnce(&mut Service)) {
    let env = Env::start(slow_gateway()).await;
    let sim = gated_dispatcher(&env).await;
    let mut one = Service::start(&replica_config(&env, 1));
    let two = Service::start(&replica_config(&env, 2));
    let a1 = one.client(Some(KEY_A));
    let a2 = two.client(Some(KEY_A));
    let mut batches = Vec::new();
    for i in 0..4 {
        let (text, lines) = input_jsonl(&format!("r{i}"), 60, "llama-3");
        // Uploaded through one replica, created through the other: the state is shared.
        let file = a1.upload_ok(&format!("r{i}.jsonl"), text.as_bytes()).await;
        batches.push((id_of(&a2.create_batch_ok(&file).await), lines));
    }
    // All four start while the gate is closed, so none can end before the stop: two at most
    // on each replica, so replica 1 holds two.
    let deadline = Instant::now() + FINISH;
    for (id, _) in &batches {
        while a1.batch(id).await["status"] != "in_progress" {
            assert!(Instant::now() < deadline, "{id} did not start");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    gate(&env, true);
    loop {
        let mut done = 0;
        for (id, _) in &batches {
            done += count(&a1.batch(id).await, "completed");
        }
        if done >= 30 {
            break;
        }
        assert!(Instant::now() < deadline, "fewer than 30 lines done");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = inventory(&a2).await;
    stop(&mut one);
    for (id, lines) in &batches {
        let batch = a2.wait_final(id, FINISH).await;
        assert_eq!(batch["status"], "completed", "{batch}");
        assert_eq!(count(&batch, "completed"), 60, "{batch}");
        let results = a2.results(&batch).await;
        results.assert_each_once(lines);
        results.assert_answers_match(lines);
    }
    assert_kept(&before, &inventory(&a2).await);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_jobs_of_a_replica_killed_with_9_are_taken_over_by_another() {
    a_replica_stopped_mid_job_is_taken_over(|one| one.kill9()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_hands_a_replicas_jobs_over_to_another() {
    a_replica_stopped_mid_job_is_taken_over(|one| {
        let (status, took) = one.signal_and_wait(libc::SIGTERM, Duration::from_secs(30));
        assert_eq!(status.code(), Some(0), "{}", one.stderr_text());
        assert!(took < Duration::from_secs(10), "took {took:?} to stop");
    })
    .await;
}

/// A replica frozen past its lease with no other replica to take the job: once it runs again it
/// takes the same lease back (same epoch: nobody wrote meanwhile) and goes on with the job where
/// it was, instead of stopping it and starting it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_frozen_past_its_lease_with_nobody_to_take_over_goes_on() {
    let env = Env::start(slow_gateway()).await;
    let sim = gated_dispatcher(&env).await;
    let one = Service::start(&replica_config(&env, 1));
    let api = one.client(Some(KEY_A));
    let (_, id, lines) = submit(&api, "frozen", 60).await;
    let deadline = Instant::now() + FINISH;
    while count(&api.batch(&id).await, "completed") < 10 {
        if api.batch(&id).await["status"] == "in_progress" {
            gate(&env, true);
        }
        assert!(Instant::now() < deadline, "fewer than 10 lines done");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let epoch_key = keys().epoch(&id);
    let lease_key = keys().lease(&id);
    assert_eq!(env.redis.command(&["GET", &epoch_key]), "1");
    // Frozen for twice the 2 s lease.
    assert_eq!(unsafe { libc::kill(one.pid(), libc::SIGSTOP) }, 0);
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        env.redis.command(&["EXISTS", &lease_key]),
        ":0",
        "the lease outlived the freeze"
    );
    assert_eq!(unsafe { libc::kill(one.pid(), libc::SIGCONT) }, 0);
    let batch = api.wait_final(&id, FINISH).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    let results = api.results(&batch).await;
    results.assert_answered(&lines);
    let log = one.stderr_text();
    assert!(log.contains("holding it again"), "{log}");
    assert!(!log.contains("lost the job's lease"), "{log}");
    assert!(!log.contains("taking over"), "{log}");
    assert_eq!(
        env.redis.command(&["GET", &epoch_key]),
        "1",
        "the job was adopted again instead of going on: {log}"
    );
    sim.shutdown().await;
}
