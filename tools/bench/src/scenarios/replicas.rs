//! Several `processor serve` replicas on one Redis, one simulator and one storage (issue #12):
//! the same batches run by 1 replica and by 3 (jobs per minute, requests per second), and the
//! time from a replica's SIGKILL to its jobs held by another replica and progressing again.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use batch_state::StateKeys;
use fred::interfaces::{HashesInterface, KeysInterface};
use tokio_util::sync::CancellationToken;

use super::simulator::Simulator;
use super::Ctx;
use crate::inputs::write_input;
use crate::lab::{info, info_field, Lab};
use crate::report::{Report, Row, Target, Unit};
use crate::service::{
    cpu_seconds, create_batches, load_average, stop, upload_for_batches, wait_completed, Api,
    ReplicaSetup, ServeSetup, Service,
};
use crate::stats::Summary;
use crate::BenchError;

mod takeover;

use takeover::takeover;

const REPLICAS: &str = "Replicas";
/// `serve.state_prefix`; the service's keys are `{bench-replicas}:…`.
const STATE_PREFIX: &str = "bench-replicas";

/// The service's Redis keys under [`STATE_PREFIX`].
fn state_keys() -> StateKeys {
    StateKeys::new(STATE_PREFIX)
}
/// The gateway's latency, for every request.
const LATENCY: Duration = Duration::from_millis(50);
/// `serve.max_active_jobs` of every replica in the throughput runs.
const MAX_ACTIVE_JOBS: usize = 2;
/// The dispatcher's HTTP workers in the throughput runs: more than 3 replicas' running jobs
/// can keep busy, so the dispatcher's concurrency is never what caps them.
const DISPATCHER_CONCURRENCY: usize = 1024;
/// Sync mode: `concurrency.global` and `per_endpoint` of each replica, fixed (no limiter).
const SYNC_LIMIT: usize = 32;
/// POST /v1/batches in flight while submitting.
const SUBMITTERS: usize = 8;
/// How often completion is polled in the throughput runs.
const POLL: Duration = Duration::from_millis(100);
/// The takeover runs: batches, created in one second so they share a deadline and the
/// dispatcher interleaves their lines.
const TAKEOVER_BATCHES: usize = 6;
/// `serve.max_active_jobs` in the takeover runs: room for the dead replica's jobs on the others.
const TAKEOVER_MAX_ACTIVE_JOBS: usize = 4;
/// The dispatcher's HTTP workers in the takeover runs: few, so the jobs run long enough.
const TAKEOVER_CONCURRENCY: usize = 24;
/// The short lease of the takeover runs.
const SHORT_LEASE: Duration = Duration::from_secs(5);
/// The default `serve.lease_ttl`.
const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// `serve.checkpoint_interval` in the takeover runs (so the dead replica's jobs have one).
const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(1);
/// `async_dispatch.lost_request_timeout` in the takeover runs: the lines the dead replica had
/// written since its last checkpoint are sent again after this.
const LOST_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How often leases and counts are read after the kill.
const TAKEOVER_POLL: Duration = Duration::from_millis(50);
/// How often the runner looks for jobs to take over: a quarter of the lease, within 200 ms..1 s
/// (crates/service/src/runner.rs).
fn takeover_poll(ttl: Duration) -> Duration {
    (ttl / 4).clamp(Duration::from_millis(200), Duration::from_secs(1))
}

/// How the replicas send their requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Through the dispatcher simulator, as the service runs in production.
    Async,
    /// Straight to the gateway, each replica with its own fixed concurrency.
    Sync,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Async => "async",
            Mode::Sync => "sync",
        }
    }
}

/// One throughput run.
struct Throughput {
    secs: f64,
    /// Jobs each replica held a lease of, by replica.
    jobs_by_replica: BTreeMap<String, usize>,
    /// CPU seconds over the run: the replicas, the bench (simulator and client), Redis.
    cpu: [f64; 3],
}

/// One takeover run: per job of the killed replica, seconds from the kill.
struct Takeover {
    held: Vec<f64>,
    progressing: Vec<f64>,
    /// Every batch was created in the same second (one deadline).
    one_deadline: bool,
}

pub(crate) async fn run(cx: Ctx<'_>, report: &mut Report) -> Result<(), BenchError> {
    let Ctx { lab, s, progress } = cx;
    s.require_processor()?;
    let load_before = load_average();
    let (batches, lines) = (s.replicas_batches, s.replicas_batch_lines);
    let input = lab.path("replicas-batch.jsonl");
    write_input(&input, lines, s.request_bytes)?;
    lab.flush_redis().await?;

    let sim = Simulator::new(lab, LATENCY, DISPATCHER_CONCURRENCY).await?;
    let url = sim.gateway.base_url();
    let mut measured: Vec<(Mode, usize, Vec<Throughput>)> = Vec::new();
    let mut failed = None;
    'modes: for mode in [Mode::Async, Mode::Sync] {
        let mut by_n: [Vec<Throughput>; 2] = [Vec::new(), Vec::new()];
        for run in 0..s.long_runs {
            for (k, n) in [1, 3].into_iter().enumerate() {
                match throughput(lab, s, mode, n, run, &url, &input).await {
                    Ok(t) => {
                        progress(&format!(
                            "   {} run {run}, {n} replica(s): {:.2} s, {:.0} req/s, jobs by replica {:?}, CPU s replicas/bench/redis {:.1}/{:.1}/{:.1}; load {}",
                            mode.name(), t.secs, (batches * lines) as f64 / t.secs,
                            t.jobs_by_replica, t.cpu[0], t.cpu[1], t.cpu[2], load_average()
                        ));
                        by_n[k].push(t);
                    }
                    Err(e) => {
                        failed = Some(e);
                        break 'modes;
                    }
                }
            }
        }
        let [one, three] = by_n;
        measured.push((mode, 1, one));
        measured.push((mode, 3, three));
    }
    sim.stop().await;
    if let Some(e) = failed {
        return Err(e);
    }

    let takeover_input = lab.path("replicas-takeover.jsonl");
    write_input(&takeover_input, s.takeover_lines, s.request_bytes)?;
    let sim = Simulator::new(lab, LATENCY, TAKEOVER_CONCURRENCY).await?;
    let mut leases = vec![(SHORT_LEASE, s.long_runs)];
    if s.takeover_default_lease {
        leases.push((DEFAULT_LEASE, 1));
    }
    let mut takeovers: Vec<(Duration, Vec<Takeover>)> = Vec::new();
    for (ttl, runs) in leases {
        let mut seen = Vec::new();
        for run in 0..runs {
            match takeover(cx, ttl, run, &takeover_input).await {
                Ok(t) => seen.push(t),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        takeovers.push((ttl, seen));
        if failed.is_some() {
            break;
        }
    }
    sim.stop().await;
    if let Some(e) = failed {
        return Err(e);
    }
    let load_after = load_average();

    let work = format!("{batches} batches × {} lines", super::lines(lines));
    let requests = (batches * lines) as f64;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    for (mode, n, runs) in &measured {
        let col = |f: &dyn Fn(&Throughput) -> f64| Summary::new(runs.iter().map(f).collect());
        let what = format!(
            "{}, {work}, {n} replica{}",
            mode.name(),
            if *n == 1 { "" } else { "s" }
        );
        report.rows.push(Row::new(
            REPLICAS,
            format!("{what}: jobs per minute"),
            Unit::PerSecond("jobs/min"),
            col(&|t| batches as f64 * 60.0 / t.secs),
        ));
        report.rows.push(Row::new(
            REPLICAS,
            format!("{what}: requests per second"),
            Unit::PerSecond("req/s"),
            col(&|t| requests / t.secs),
        ));
        report.rows.push(Row::new(
            REPLICAS,
            format!("{what}: CPU of replicas + simulator + Redis, share of {cores} cores"),
            Unit::Percent,
            col(&|t| t.cpu.iter().sum::<f64>() / t.secs / cores),
        ));
        if *n == 3 {
            let one = measured
                .iter()
                .find(|(m, k, _)| m == mode && *k == 1)
                .map(|(_, _, r)| r);
            if let Some(one) = one {
                let ratios = one.iter().zip(runs).map(|(a, b)| a.secs / b.secs).collect();
                report.rows.push(Row::new(
                    REPLICAS,
                    format!(
                        "{}, {work}: 3 replicas / 1 replica, throughput",
                        mode.name()
                    ),
                    Unit::Factor,
                    Summary::new(ratios),
                ));
            }
        }
    }
    for (ttl, runs) in &takeovers {
        let bound = *ttl + takeover_poll(*ttl);
        let what = format!("lease_ttl {} s: SIGKILL of a replica", ttl.as_secs());
        let all = |f: &dyn Fn(&Takeover) -> &Vec<f64>| {
            Summary::new(runs.iter().flat_map(|t| f(t).iter().copied()).collect())
        };
        report.rows.push(
            Row::new(
                REPLICAS,
                format!("{what} → each of its jobs' leases held by another"),
                Unit::Seconds,
                all(&|t| &t.held),
            )
            .limit("lease_ttl", ttl.as_secs_f64())
            .target(Target::AtMost(bound.as_secs_f64())),
        );
        report.rows.push(
            Row::new(
                REPLICAS,
                format!("{what} → each of its jobs' completed count growing again"),
                Unit::Seconds,
                all(&|t| &t.progressing),
            )
            .limit("lease_ttl", ttl.as_secs_f64()),
        );
    }

    let running_key = state_keys().running();
    let lease_key = state_keys().lease("<batch>");
    let spread = |mode: Mode| {
        measured
            .iter()
            .filter(|(m, n, _)| *m == mode && *n == 3)
            .flat_map(|(_, _, runs)| runs.iter())
            .map(|t| {
                t.jobs_by_replica
                    .values()
                    .map(|c| c.to_string())
                    .collect::<Vec<_>>()
                    .join("/")
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    report.note(REPLICAS, format!(
        "Each replica is `processor serve` ({}) as a child process with its own `work_dir` and `serve.replica_id` (r0, r1, r2), all on the same redis-server, the same storage directory and the same simulator in the bench's process: a gateway answering every request after {} ms and, in async mode, the dispatcher simulator polling every 10 ms. Every run starts fresh replicas on an empty Redis and stops them with SIGTERM.",
        s.processor.display(), LATENCY.as_millis()
    ));
    report.note(REPLICAS, format!(
        "Throughput: one input file of {} lines of {} B uploaded once; {batches} batches naming it created through the replicas in turn ({SUBMITTERS} POST /v1/batches in flight), timed from the first POST until GET /v1/batches (polled every {} ms) shows the last completed, each with every line a success. Every replica has `serve.max_active_jobs` {MAX_ACTIVE_JOBS}, default leases (30 s). Async: the dispatcher has {DISPATCHER_CONCURRENCY} HTTP workers (a job's lines are all in flight at once; {DISPATCHER_CONCURRENCY} × 1 / {} ms = {} req/s is far above what the machine can run). Sync: each replica sends straight to the gateway with `concurrency.global` = `per_endpoint` = {SYNC_LIMIT} and no limiter, so one replica can do at most {SYNC_LIMIT} / {} ms = {} req/s and three {} req/s. The ratio is per run (1 replica then 3, alternating). Jobs per replica (leases seen in `{running_key}` every 100 ms), 3-replica runs: async {}; sync {}. CPU: user + system time of the replica processes (/proc/<pid>/stat), of the bench process (simulator, gateway and HTTP client) and of redis-server (INFO cpu) over the run, divided by the run's time and the cores.",
        super::lines(lines), s.request_bytes, POLL.as_millis(), LATENCY.as_millis(),
        crate::report::thousands(DISPATCHER_CONCURRENCY as f64 / LATENCY.as_secs_f64()),
        LATENCY.as_millis(), crate::report::thousands(SYNC_LIMIT as f64 / LATENCY.as_secs_f64()),
        crate::report::thousands(3.0 * SYNC_LIMIT as f64 / LATENCY.as_secs_f64()),
        spread(Mode::Async), spread(Mode::Sync),
    ));
    let deadlines: Vec<bool> = takeovers
        .iter()
        .flat_map(|(_, runs)| runs.iter().map(|t| t.one_deadline))
        .collect();
    report.note(REPLICAS, format!(
        "Takeover: 3 replicas (async, `max_active_jobs` {TAKEOVER_MAX_ACTIVE_JOBS}, `checkpoint_interval` {} s, `lost_request_timeout` {} s), {TAKEOVER_BATCHES} batches of {} lines created through them in turn within one second ({} of {} runs had one deadline, so the dispatcher, with {TAKEOVER_CONCURRENCY} HTTP workers, interleaves their lines and every job progresses at once). Once every batch runs under a lease and each job of the replica holding the most has a checkpoint and a tenth of its lines done, that replica gets SIGKILL; then every {} ms the bench reads each of its jobs' lease `{lease_key}` from Redis and its `request_counts.completed` from GET /v1/batches/{{id}} on another replica. Held: the first read naming another replica. Growing: the first read, once held, whose count is above the read before it (the adopter writes its counts every 500 ms; the dead replica cannot write any more). Every batch must then complete with every line a success. Median and min–max over every job of the killed replica in every run ({} runs with lease_ttl {} s{}).",
        CHECKPOINT_INTERVAL.as_secs(), LOST_REQUEST_TIMEOUT.as_secs(), super::lines(s.takeover_lines),
        deadlines.iter().filter(|d| **d).count(), deadlines.len(),
        TAKEOVER_POLL.as_millis(), s.long_runs, SHORT_LEASE.as_secs(),
        if s.takeover_default_lease { format!(", 1 with the default {} s", DEFAULT_LEASE.as_secs()) } else { String::new() },
    ));
    report.note(REPLICAS, format!(
        "Expected: a replica renews its leases every lease_ttl / 3, so a lease outlives its replica by between 2/3 of lease_ttl and lease_ttl; the others look for lapsed leases every lease_ttl / 4 clamped to 200 ms..1 s ({} ms at 5 s and at 30 s). So held ≤ lease_ttl + {} ms (the target). Growing needs the adopter to restore the job from its checkpoint in storage (it cannot see the dead replica's disk, so deleting that `work_dir` changes nothing here) and to get results for it again.",
        takeover_poll(SHORT_LEASE).as_millis(), takeover_poll(SHORT_LEASE).as_millis(),
    ));
    report.note(REPLICAS, format!(
        "The machine is shared: the 1-minute load average was {load_before} when the scenario started and {load_after} when it ended, on {cores} cores."
    ));
    Ok(())
}

/// The replicas of one run, each in `dir/r<i>`, sharing `dir/storage`.
async fn start_replicas(
    lab: &Lab,
    s: &crate::Settings,
    dir: &Path,
    n: usize,
    configure: impl Fn(ServeSetup) -> ServeSetup,
) -> Result<Vec<Service>, BenchError> {
    let mut services = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("r{i}");
        let setup = configure(ServeSetup {
            storage: dir.join("storage"),
            ..ServeSetup::new(&dir.join(&id), MAX_ACTIVE_JOBS, STATE_PREFIX)
        });
        let setup = ServeSetup {
            replica: setup.replica.map(|r| ReplicaSetup { id, ..r }),
            ..setup
        };
        services.push(setup.start(lab, &s.processor).await?);
    }
    Ok(services)
}

async fn throughput(
    lab: &Lab,
    s: &crate::Settings,
    mode: Mode,
    n: usize,
    run: usize,
    gateway: &str,
    input: &Path,
) -> Result<Throughput, BenchError> {
    lab.flush_redis().await?;
    let dir = lab.fresh_dir(&format!("replicas-{}-{n}-{run}", mode.name()))?;
    let services = start_replicas(lab, s, &dir, n, |setup| ServeSetup {
        replica: Some(ReplicaSetup {
            id: String::new(),
            lease_ttl: DEFAULT_LEASE,
            checkpoint_interval: Duration::from_secs(30),
        }),
        sync: (mode == Mode::Sync).then(|| (gateway.to_owned(), SYNC_LIMIT)),
        ..setup
    })
    .await?;
    let apis: Vec<Api> = services
        .iter()
        .map(|r| Api::new(r.base(), SUBMITTERS))
        .collect();
    let body = upload_for_batches(&apis[0], input).await?;
    let cpu_before = cpu(lab, &services).await?;
    let sampling = CancellationToken::new();
    let sampler = tokio::spawn(sample_holders(lab.client().clone(), sampling.clone()));
    let started = Instant::now();
    let lines = s.replicas_batch_lines;
    let limit = Duration::from_secs(300 + (s.replicas_batches * lines) as u64 / 100);
    let done = match create_batches(&apis, &body, s.replicas_batches, SUBMITTERS).await {
        Ok(ids) => wait_completed(&apis[0], &ids, lines, started, POLL, limit).await,
        Err(e) => Err(e),
    };
    sampling.cancel();
    let holders = sampler
        .await
        .map_err(|e| BenchError::Check(format!("the lease sampler failed: {e}")))??;
    let cpu_after = cpu(lab, &services).await?;
    let secs = done?;
    for service in services {
        stop(service).await?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mut jobs_by_replica: BTreeMap<String, usize> =
        (0..n).map(|i| (format!("r{i}"), 0)).collect();
    for replicas in holders.values() {
        for r in replicas {
            *jobs_by_replica.entry(r.clone()).or_default() += 1;
        }
    }
    Ok(Throughput {
        secs,
        jobs_by_replica,
        cpu: [0, 1, 2].map(|i| cpu_after[i] - cpu_before[i]),
    })
}

/// CPU seconds used so far by the replicas, this process and redis-server.
async fn cpu(lab: &Lab, services: &[Service]) -> Result<[f64; 3], BenchError> {
    let replicas = services
        .iter()
        .map(|r| cpu_seconds(r.pid()).unwrap_or(f64::NAN))
        .sum();
    let me = cpu_seconds(std::process::id()).unwrap_or(f64::NAN);
    let info = info(lab.client(), "cpu").await?;
    let field = |name: &str| info_field(&info, name).unwrap_or(f64::NAN);
    let redis = field("used_cpu_sys:") + field("used_cpu_user:");
    Ok([replicas, me, redis])
}

/// Which replicas held each job, from `{prefix}:running` every 100 ms until `stop`.
async fn sample_holders(
    client: fred::clients::Client,
    stop: CancellationToken,
) -> Result<HashMap<String, BTreeSet<String>>, BenchError> {
    let key = state_keys().running();
    let mut seen: HashMap<String, BTreeSet<String>> = HashMap::new();
    loop {
        let running: HashMap<String, String> = client.hgetall(key.as_str()).await?;
        for (job, replica) in running {
            seen.entry(job).or_default().insert(replica);
        }
        tokio::select! {
            _ = stop.cancelled() => return Ok(seen),
            _ = tokio::time::sleep(POLL) => {}
        }
    }
}

/// Job `id`'s lease value `replica#epoch`, if held.
async fn lease(lab: &Lab, id: &str) -> Result<Option<String>, BenchError> {
    Ok(lab.client().get(state_keys().lease(id)).await?)
}

fn holder(lease: &str) -> &str {
    lease.split('#').next().unwrap_or_default()
}

/// `request_counts.completed` of batch `id`, and its `created_at`.
async fn completed(api: &Api, id: &str) -> Result<(u64, i64), BenchError> {
    let path = format!("/v1/batches/{id}");
    let batch = api.get(&path).await?.json(&format!("GET {path}"))?;
    Ok((
        batch["request_counts"]["completed"]
            .as_u64()
            .unwrap_or_default(),
        batch["created_at"].as_i64().unwrap_or_default(),
    ))
}
