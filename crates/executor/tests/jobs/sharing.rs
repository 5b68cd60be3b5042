//! Jobs side by side on one endpoint (sync mode) share its limit: the endpoint serves them in
//! turn, one request each, with and without `load`, so they progress together whatever each
//! one has waiting (with `load` each job's window is `concurrency.global`, far above a small
//! pool's room); a job started late beside a big one is not kept waiting behind it; jobs of one
//! share (a tenant) take one turn together; and a job alone still takes all the room the
//! pool's load gives, above `per_endpoint`.
//!
//! The checks compare the jobs' progress with each other, never with the clock.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use batch_executor::{Executor, Job, JobSpec, Prepared};
use batch_wire::BatchStatus;
use tokio_util::sync::CancellationToken;

/// Lines of each of the three jobs side by side.
const LINES: usize = 120;

/// How often each job's progress is sampled.
const SAMPLE: Duration = Duration::from_millis(10);

/// A vLLM-like server running `max_num_seqs` at once, the rest waiting in its queue; an answer
/// of the inputs' 8 tokens takes about 60 ms.
async fn model_server(max_num_seqs: usize) -> Env {
    Env::start(GatewayConfig {
        latency_fixed: Duration::from_millis(30),
        latency_per_token: Duration::from_millis(4),
        max_num_seqs: Some(max_num_seqs),
        ..GatewayConfig::default()
    })
    .await
}

/// An executor whose `llama-3` follows the server's load (its `/metrics`) when `load` holds,
/// with the default limits.
async fn executor(env: &Env, load: bool) -> Arc<Executor> {
    let model_extra = match load {
        true => format!(
            "    load:\n      metrics_urls: [{}/metrics]\n",
            env.gateway.base_url()
        ),
        false => String::new(),
    };
    let config = env.sync_config(&["llama-3"], &model_extra, "");
    Arc::new(Executor::new(crate::support::load(&config)).await.unwrap())
}

/// The job of `lines` lines of `llama-3` written to `name`.jsonl, into the directory `name`,
/// in `share` when given.
fn job_spec(env: &Env, name: &str, lines: usize, share: Option<&str>) -> JobSpec {
    write_input(&env.path(&format!("{name}.jsonl")), lines, &["llama-3"]);
    JobSpec {
        share: share.map(str::to_owned),
        ..spec(env, &format!("{name}.jsonl"), name)
    }
}

async fn ready(executor: &Executor, spec: &JobSpec) -> Arc<Job> {
    match executor.prepare(spec).await.unwrap() {
        Prepared::Ready(job) => job,
        Prepared::Finished(batch) => panic!("finished before it started: {batch:?}"),
    }
}

/// Starts `job`, which must complete with every line answered.
fn start(executor: &Arc<Executor>, job: Arc<Job>) -> tokio::task::JoinHandle<()> {
    let executor = executor.clone();
    tokio::spawn(async move {
        let lines = job.plan().total();
        let batch = executor
            .execute(job, CancellationToken::new())
            .await
            .unwrap();
        assert_eq!(batch.status, BatchStatus::Completed);
        assert_eq!(batch.request_counts.completed, lines);
    })
}

/// Runs `specs` side by side, prepared first and started together, and returns each sample of
/// their completed lines (one count per job, every [`SAMPLE`]) until they all end, with each
/// job's lines.
async fn side_by_side(executor: &Arc<Executor>, specs: &[JobSpec]) -> (Vec<Vec<u64>>, Vec<u64>) {
    let mut jobs = Vec::new();
    for spec in specs {
        jobs.push(ready(executor, spec).await);
    }
    let totals: Vec<u64> = jobs.iter().map(|j| j.plan().total()).collect();
    let progress: Vec<_> = jobs.iter().map(|j| j.progress()).collect();
    let runs: Vec<_> = jobs.into_iter().map(|j| start(executor, j)).collect();
    let mut samples = Vec::new();
    loop {
        let now: Vec<u64> = progress
            .iter()
            .map(|p| p.borrow().counts.completed)
            .collect();
        let done = now == totals;
        samples.push(now);
        if done {
            break;
        }
        tokio::time::sleep(SAMPLE).await;
    }
    for run in runs {
        run.await.unwrap();
    }
    let every_tenth: Vec<_> = samples.iter().step_by(10).collect();
    eprintln!(
        "completed lines per job, every {:?}: {every_tenth:?}",
        SAMPLE * 10
    );
    (samples, totals)
}

/// Fails unless, at every sample taken while no job had ended, each job had answered at least
/// a third of the lines of the one furthest ahead, once that one had answered `from`; and
/// some samples were so checked. `from` leaves room for a head start: the job whose requests
/// reach the endpoint first may have a limit's worth answered before the others' first.
fn assert_together(samples: &[Vec<u64>], totals: &[u64], from: u64) {
    let mut checked = 0;
    for sample in samples {
        if sample.iter().zip(totals).any(|(done, total)| done == total) {
            break;
        }
        let leader = *sample.iter().max().unwrap();
        if leader < from {
            continue;
        }
        checked += 1;
        assert!(
            sample.iter().all(|&done| 3 * done >= leader),
            "a job left behind at {sample:?}; the samples: {samples:?}"
        );
    }
    assert!(
        checked > 0,
        "no job got to {from} lines before one ended: {samples:?}"
    );
}

/// Three jobs of [`LINES`] started together on a server that runs 8 at once, which must
/// progress together; every line is answered once, by its own answer.
async fn three_jobs_progress_together(load: bool) {
    let env = model_server(8).await;
    let executor = executor(&env, load).await;
    let specs: Vec<_> = ["a", "b", "c"]
        .map(|name| job_spec(&env, name, LINES, None))
        .into();
    let (samples, totals) = side_by_side(&executor, &specs).await;
    assert_together(&samples, &totals, 24);
    for name in ["a", "b", "c"] {
        let input = std::fs::read_to_string(env.path(&format!("{name}.jsonl"))).unwrap();
        let lines: Vec<String> = input.lines().map(str::to_owned).collect();
        Results::read(&env.path(name)).assert_answered(&lines);
    }
}

/// With `load` the limit follows the server's room (6 or so: far below each job's window of
/// 100); each job used to queue its whole window at the endpoint, served first come first
/// served, and the jobs ran one after another.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jobs_side_by_side_with_load_progress_together() {
    three_jobs_progress_together(true).await;
}

/// The same without `load`: the limiter's limit is shared as evenly.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jobs_side_by_side_without_load_progress_together() {
    three_jobs_progress_together(false).await;
}

/// Two jobs of one share (a tenant) and one job of another, with `load`: the shares take turns,
/// so the lone share's job answers about as many lines as the other share's two together (at
/// least a third of them, as above), and the two jobs of a share take turns within its turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shares_side_by_side_with_load_progress_together() {
    let env = model_server(8).await;
    let executor = executor(&env, true).await;
    let specs = [
        job_spec(&env, "a1", LINES, Some("tenant-a")),
        job_spec(&env, "a2", LINES, Some("tenant-a")),
        job_spec(&env, "b", LINES, Some("tenant-b")),
    ];
    let (samples, totals) = side_by_side(&executor, &specs).await;
    // Until b ends (before a's jobs, which have half its turns each).
    let ended = samples
        .iter()
        .position(|s| s.iter().zip(&totals).any(|(done, total)| done == total))
        .unwrap_or(samples.len());
    let running = &samples[..ended];
    let per_share: Vec<Vec<u64>> = running.iter().map(|s| vec![s[0] + s[1], s[2]]).collect();
    let within_a: Vec<Vec<u64>> = running.iter().map(|s| vec![s[0], s[1]]).collect();
    assert_together(&per_share, &[u64::MAX; 2], 24);
    assert_together(&within_a, &[u64::MAX; 2], 24);
}

/// A small job started once a big one has answered some of its lines, with `load` on a server
/// that runs 8 at once: its lines get every other turn, so the big job answers about as many
/// lines as the small one has while it runs (it used to answer its whole window, 100, before
/// the small job's first line was sent).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_small_job_is_not_kept_behind_a_big_one() {
    const SMALL: u64 = 20;
    let env = model_server(8).await;
    let executor = executor(&env, true).await;
    let big = ready(&executor, &job_spec(&env, "big", 600, None)).await;
    let big_progress = big.progress();
    let big_run = start(&executor, big);
    let big_done = || big_progress.borrow().counts.completed;
    while big_done() < 40 {
        tokio::time::sleep(SAMPLE).await;
    }
    let small = ready(&executor, &job_spec(&env, "small", SMALL as usize, None)).await;
    let before = big_done();
    start(&executor, small).await.unwrap();
    let during = big_done() - before;
    eprintln!("the big job answered {during} lines while the small one's {SMALL} ran");
    // Turns alternate (SMALL each) plus what was in flight when the small job came (the
    // limit, at most 8) and a write's lag.
    assert!(during < 3 * SMALL, "{during}");
    big_run.await.unwrap();
}

/// A job alone, with `load`, on a server with room for 40: the limit follows the room, so more
/// than `per_endpoint` (10) of its requests run at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lone_job_with_load_takes_the_room_beyond_per_endpoint() {
    let env = model_server(40).await;
    let executor = executor(&env, true).await;
    let job = ready(&executor, &job_spec(&env, "alone", 1_000, None)).await;
    let running = env.gateway.load();
    let (peak, stop) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let sampler = tokio::spawn({
        let (peak, stop) = (peak.clone(), stop.clone());
        async move {
            while !stop.load(Ordering::SeqCst) {
                peak.fetch_max(running.running(), Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    });
    start(&executor, job).await.unwrap();
    stop.store(true, Ordering::SeqCst);
    sampler.await.unwrap();
    let peak = peak.load(Ordering::SeqCst);
    eprintln!("at most {peak} running at once");
    assert!(
        peak > executor.config().concurrency.per_endpoint,
        "at most {peak} running at once"
    );
}
