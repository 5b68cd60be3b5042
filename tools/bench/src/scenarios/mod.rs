//! The scenarios, and what they share.

mod aimd;
pub(crate) mod cluster;
mod drain;
mod e2e;
mod enqueue;
mod json;
mod limits;
mod memory;
mod prefix;
mod replicas;
mod serve;
mod simulator;
mod yielding;

use std::future::Future;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use batch_config::ProcessorConfig;
use batch_executor::{ExecError, Executor, Job, JobProgress, JobSpec, Prepared};
use batch_producer::JobMessages;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::lab::{load, Lab};
use crate::report::Report;
use crate::{BenchError, Settings};

/// A group of figures measured together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// Enqueue a job (and cancel it: the cancel figure comes from the same runs); also on a
    /// Redis Cluster unless [`Settings::cluster_primaries`] is 0.
    Enqueue,
    /// Write results already waiting in the result list; also on a Redis Cluster unless
    /// [`Settings::cluster_primaries`] is 0.
    Drain,
    /// A job through the dispatcher simulator.
    EndToEnd,
    /// Sync mode against a gateway of limited capacity.
    Aimd,
    /// Peak RSS of the `processor` binary.
    Memory,
    /// Prefix-cache hits with plan-ordered against equal scores.
    Prefix,
    /// `processor serve` through its HTTP API: upload, GET under load, many batches at once.
    Serve,
    /// 3 `processor serve` replicas against 1 on the same batches, and the time from a
    /// replica's SIGKILL to its jobs running on another.
    Replicas,
    /// The hand-written JSON passes against serde_json doing the same work.
    Json,
    /// A batch beside online traffic on a vLLM-like server: online latency and the batch's
    /// share of the spare capacity, with and without `load`.
    Yield,
}

impl Scenario {
    /// Every scenario, in run order.
    pub const ALL: [Scenario; 10] = [
        Scenario::Enqueue,
        Scenario::Drain,
        Scenario::EndToEnd,
        Scenario::Prefix,
        Scenario::Aimd,
        Scenario::Memory,
        Scenario::Serve,
        Scenario::Replicas,
        Scenario::Json,
        Scenario::Yield,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Enqueue => "enqueue",
            Scenario::Drain => "drain",
            Scenario::EndToEnd => "e2e",
            Scenario::Aimd => "aimd",
            Scenario::Memory => "memory",
            Scenario::Prefix => "prefix",
            Scenario::Serve => "serve",
            Scenario::Replicas => "replicas",
            Scenario::Json => "json",
            Scenario::Yield => "yield",
        }
    }
}

impl FromStr for Scenario {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Scenario::ALL
            .into_iter()
            .find(|c| c.name() == s || (s == "cancel" && *c == Scenario::Enqueue))
            .ok_or_else(|| {
                let names: Vec<_> = Scenario::ALL.iter().map(|c| c.name()).collect();
                format!("unknown scenario {s:?}; use one of {}", names.join(", "))
            })
    }
}

/// Where a scenario's progress lines go.
pub(crate) type Progress<'a> = &'a (dyn Fn(&str) + Send + Sync);

/// What a scenario runs with: the lab, the sizes, and where its progress lines go.
#[derive(Clone, Copy)]
pub(crate) struct Ctx<'a> {
    /// Redis and the scratch directory.
    pub(crate) lab: &'a Lab,
    /// Sizes and repetitions.
    pub(crate) s: &'a Settings,
    /// Hears each run's figures as they come.
    pub(crate) progress: Progress<'a>,
}

/// Runs one scenario, adding its rows to `report`.
pub(crate) async fn run(
    scenario: Scenario,
    cx: Ctx<'_>,
    report: &mut Report,
) -> Result<(), BenchError> {
    match scenario {
        Scenario::Enqueue => enqueue::run(cx, report).await,
        Scenario::Drain => drain::run(cx, report).await,
        Scenario::EndToEnd => e2e::run(cx, report).await,
        Scenario::Aimd => aimd::run(cx, report).await,
        Scenario::Memory => memory::run(cx, report).await,
        Scenario::Prefix => prefix::run(cx, report).await,
        Scenario::Serve => serve::run(cx, report).await,
        Scenario::Replicas => replicas::run(cx, report).await,
        Scenario::Json => json::run(cx, report).await,
        Scenario::Yield => yielding::run(cx, report).await,
    }
}

/// The async config `{id}.yaml`, its result list of its own (`consumer_id` `id`), loaded.
pub(crate) fn async_config(lab: &Lab, id: &str) -> Result<ProcessorConfig, BenchError> {
    load(&lab.async_config(&format!("{id}.yaml"), id, "")?)
}

/// Runs `f` with a new executor of `config`, shut down after `f` whatever it returned.
pub(crate) async fn with_executor<T>(
    config: ProcessorConfig,
    f: impl AsyncFnOnce(&Executor) -> Result<T, BenchError>,
) -> Result<T, BenchError> {
    let executor = Executor::new(config).await?;
    let out = f(&executor).await;
    executor.shutdown().await;
    out
}

/// Prepares a job that must be ready to dispatch.
pub(crate) async fn ready(executor: &Executor, spec: &JobSpec) -> Result<Arc<Job>, BenchError> {
    match executor.prepare(spec).await? {
        Prepared::Ready(job) => Ok(job),
        Prepared::Finished(batch) => Err(BenchError::Check(format!(
            "job {} was {} before it started: {:?}",
            batch.id,
            batch.status.as_str(),
            batch.errors
        ))),
    }
}

/// A spec for `input` into `out`, with a fixed id when given.
pub(crate) fn spec(input: &Path, out: &Path, id: Option<String>) -> JobSpec {
    JobSpec {
        job_id: id,
        ..JobSpec::new(input, out)
    }
}

/// Each progress change seen, with when it was seen (since `start`), until `done` holds or
/// `ended` resolves (then with one last look).
pub(crate) async fn record_until(
    mut rx: watch::Receiver<JobProgress>,
    start: Instant,
    mut done: impl FnMut(&JobProgress) -> bool,
    ended: impl Future<Output = ()>,
) -> Vec<(Duration, JobProgress)> {
    tokio::pin!(ended);
    let mut seen = Vec::new();
    loop {
        let p = rx.borrow_and_update().clone();
        let stop = done(&p);
        seen.push((start.elapsed(), p));
        if stop {
            return seen;
        }
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { return seen },
            _ = &mut ended => {
                seen.push((start.elapsed(), rx.borrow_and_update().clone()));
                return seen;
            }
        }
    }
}

/// Executes `job` of `n` lines while a task of its own records its progress (since `start`)
/// until every line has a result or the execution ends, so what it sees does not wait for the
/// job's task.
pub(crate) async fn execute_recorded(
    executor: &Executor,
    job: Arc<Job>,
    start: Instant,
    n: usize,
) -> (
    Result<batch_wire::Batch, ExecError>,
    Vec<(Duration, JobProgress)>,
) {
    let (tx, ended) = tokio::sync::oneshot::channel::<()>();
    let ended = async move {
        let _ = ended.await;
    };
    let done = move |p: &JobProgress| resolved(p) >= n as u64;
    let recorder = tokio::spawn(record_until(job.progress(), start, done, ended));
    let out = executor.execute(job, CancellationToken::new()).await;
    let _ = tx.send(());
    let seen = recorder.await.unwrap_or_default();
    (out, seen)
}

/// Plans `input` into `dir` as the processor does, without its size limits.
pub(crate) fn plan(input: &Path, dir: &Path) -> Result<batch_plan::Plan, BenchError> {
    let limits = batch_plan::Limits {
        max_requests: u64::MAX,
        max_file_bytes: u64::MAX,
        ..batch_plan::Limits::default()
    };
    Ok(batch_plan::Plan::build(input, dir, limits)?)
}

/// The member the producer writes for each line of `text`.
pub(crate) fn members(messages: &JobMessages, text: &str) -> Result<Vec<String>, BenchError> {
    let members = text
        .lines()
        .enumerate()
        .map(|(i, line)| messages.member(i as u64, line.as_bytes()));
    Ok(members.collect::<Result<_, _>>()?)
}

/// What the members of job `job_id` share: created now, due in a day, sent on `request_queue`
/// with results to `result_queue`, no extra headers.
pub(crate) fn job_messages(
    job_id: &str,
    request_queue: String,
    result_queue: String,
) -> JobMessages {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    JobMessages {
        job_id: job_id.into(),
        created: now,
        deadline: now + 24 * 3600,
        request_queue,
        result_queue,
        headers: Default::default(),
    }
}

/// Lines with a result in `p`.
pub(crate) fn resolved(p: &JobProgress) -> u64 {
    p.counts.completed + p.counts.failed
}

/// Runs a blocking call off the async workers.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, BenchError> + Send + 'static,
) -> Result<T, BenchError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| BenchError::Check(format!("a blocking task failed: {e}")))?
}

/// Fails unless the batch completed with every line a success.
pub(crate) fn expect_completed(batch: &batch_wire::Batch, lines: usize) -> Result<(), BenchError> {
    let c = batch.request_counts;
    if batch.status != batch_wire::BatchStatus::Completed || c.completed != lines as u64 {
        return Err(BenchError::Check(format!(
            "job {} ended {} with {} of {} lines completed ({} failed)",
            batch.id,
            batch.status.as_str(),
            c.completed,
            lines,
            c.failed
        )));
    }
    Ok(())
}

/// `n` lines, with thousands separators.
pub(crate) fn lines(n: usize) -> String {
    crate::report::thousands(n as f64)
}
