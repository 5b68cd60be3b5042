//! `processor run`: runs batch jobs to their end.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use batch_executor::{Executor, JobSpec, Prepared};
use batch_wire::{Batch, BatchStatus};
use tokio_util::sync::CancellationToken;

use super::{load_config, EXIT_INVALID};

/// Exit codes of `run`, shown in its `--help`.
pub const RUN_EXIT_CODES: &str = "\
Exit codes:
  0  every job completed (some lines may still have failed: see request_counts)
  1  unexpected failure (Redis unreachable until the jobs' deadline or after
     --redis-attempts, I/O error, bug)
  2  invalid configuration or usage
  3  a job failed (invalid input file: see errors.data in batch.json; or a system error)
  4  a job expired (its completion window passed; partial results kept)
  5  a job was cancelled (SIGINT, `processor cancel`; partial results kept)
  6  stopped by SIGTERM before the end: the jobs are resumable (run the same command again)
With several jobs the first that applies of 3, 4, 5, 6 wins.
SIGTERM stops the jobs within seconds and leaves them resumable: their requests stay queued,
their results wait, batch.json says in_progress. The first SIGINT (Ctrl-C) cancels the jobs
cleanly. A second signal exits at once (130) and leaves the jobs to be resumed.";

/// Arguments of `processor run`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The processor config file (YAML).
    #[arg(long)]
    config: PathBuf,
    /// A batch input file (JSONL). Repeat for several jobs, run side by side.
    #[arg(long, required = true)]
    input: Vec<PathBuf>,
    /// Where the job writes output.jsonl, error.jsonl and batch.json: one per --input, or one
    /// for all (each job then gets a subdirectory named after its input file). Running again
    /// on the same directory resumes the job.
    #[arg(long, required = true)]
    output_dir: Vec<PathBuf>,
    /// The completion window: the SLO deadline is the job's creation time plus this.
    #[arg(long, default_value = "24h", value_parser = parse_window)]
    completion_window: Duration,
    /// The job id (only with a single --input); generated otherwise.
    #[arg(long)]
    job_id: Option<String>,
    /// A header added to every request, as NAME=VALUE. Repeatable.
    #[arg(long = "header", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// Never draw a progress bar, even on a terminal.
    #[arg(long)]
    no_progress: bool,
    /// Give up after this many attempts to reach Redis at start (async mode), and exit 1.
    /// Without it, a Redis that is down at start is waited out until the jobs' deadline, as
    /// an outage while they run is (a pod restarted during a Redis failover resumes by itself).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    redis_attempts: Option<u32>,
}

impl Args {
    /// Whether progress bars are drawn: stderr is a terminal and `--no-progress` is not given.
    pub fn shows_progress(&self) -> bool {
        !self.no_progress && std::io::stderr().is_terminal()
    }
}

fn parse_window(text: &str) -> Result<Duration, String> {
    match batch_config::parse_duration(text)? {
        d if d.as_secs() == 0 => Err("the window must be at least 1s".into()),
        d if d > batch_wire::MAX_COMPLETION_WINDOW => Err(format!(
            "the window may be at most {} days",
            batch_wire::MAX_COMPLETION_WINDOW.as_secs() / 86_400
        )),
        d => Ok(d),
    }
}

fn parse_header(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.to_owned())),
        _ => Err(format!("expected NAME=VALUE, got {text:?}")),
    }
}

fn specs(args: &Args) -> Result<Vec<JobSpec>, String> {
    if args.job_id.is_some() && args.input.len() > 1 {
        return Err("--job-id needs a single --input".into());
    }
    let dirs: Vec<PathBuf> = match (args.input.len(), args.output_dir.len()) {
        (n, m) if n == m => args.output_dir.clone(),
        (_, 1) => args
            .input
            .iter()
            .map(|i| {
                let stem = i
                    .file_stem()
                    .map_or("job".into(), |s| s.to_string_lossy().into_owned());
                args.output_dir[0].join(stem)
            })
            .collect(),
        (n, m) => {
            return Err(format!(
                "{n} --input but {m} --output-dir: give one, or one per input"
            ))
        }
    };
    let mut seen: BTreeMap<&PathBuf, &PathBuf> = BTreeMap::new();
    for (input, dir) in args.input.iter().zip(&dirs) {
        if let Some(first) = seen.insert(dir, input) {
            return Err(format!(
                "{} and {} would both write to {}: give each input its own --output-dir",
                first.display(),
                input.display(),
                dir.display()
            ));
        }
    }
    let headers: BTreeMap<String, String> = args.headers.iter().cloned().collect();
    Ok(args
        .input
        .iter()
        .zip(dirs)
        .map(|(input, dir)| JobSpec {
            job_id: args.job_id.clone(),
            completion_window: args.completion_window,
            headers: headers.clone(),
            ..JobSpec::new(input.clone(), dir)
        })
        .collect())
}

/// Runs `processor run`.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let specs = match specs(&args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("processor run: {e}");
            return Ok(ExitCode::from(EXIT_INVALID));
        }
    };
    let config = match load_config(&args.config) {
        Ok(c) => c,
        Err(code) => return Ok(code),
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let show_bars = args.shows_progress();
    let mut connect = config.redis_connect_options();
    match args.redis_attempts {
        Some(n) => connect.attempts = n,
        None => connect.until = Some(latest_deadline(&specs)),
    }
    runtime.block_on(run_jobs(config, connect, specs, show_bars))
}

/// When the last of the jobs expires ([`JobSpec::time_left`]): until then, a Redis that is
/// down at start is waited for.
fn latest_deadline(specs: &[JobSpec]) -> std::time::Instant {
    let left = specs.iter().filter_map(JobSpec::time_left).max();
    std::time::Instant::now() + left.unwrap_or_default()
}

async fn run_jobs(
    config: batch_config::ProcessorConfig,
    connect: batch_redis::ConnectOptions,
    specs: Vec<JobSpec>,
    show_bars: bool,
) -> anyhow::Result<ExitCode> {
    let observability = super::observe::start(&config).await?;
    // Signals are heard from the start: a SIGTERM while Redis is waited for stops the wait.
    let cancel = CancellationToken::new();
    let pause = CancellationToken::new();
    tokio::spawn(super::observe::handle_signals(
        cancel.clone(),
        pause.clone(),
    ));
    let built = tokio::select! {
        built = Executor::with_redis_options(config, connect) => Some(built),
        _ = pause.cancelled() => None,
        _ = cancel.cancelled() => None,
    };
    let Some(built) = built else {
        eprintln!("processor: stopped while waiting for Redis; the jobs are untouched (run the same command again)");
        observability.stop().await;
        return Ok(ExitCode::from(6));
    };
    let executor = match built {
        Ok(e) => e,
        Err(e @ batch_executor::ExecError::Async(batch_executor::AsyncError::UnsafeRedis(_))) => {
            eprintln!("processor: {e}");
            observability.stop().await;
            return Ok(ExitCode::from(EXIT_INVALID));
        }
        Err(e) => return Err(e.into()),
    };
    {
        // From here the executor's own token carries a SIGTERM to the jobs.
        let (pause, jobs) = (pause.clone(), executor.pause_token());
        tokio::spawn(async move {
            pause.cancelled().await;
            jobs.cancel();
        });
    }

    let mut prepared = Vec::with_capacity(specs.len());
    for spec in &specs {
        prepared.push(
            executor
                .prepare(spec)
                .await
                // The errors name the file that failed: the path would only repeat.
                .context("preparing the job")?,
        );
    }
    observability.set_ready(true);
    let progress = super::progress::Display::new(show_bars);
    let runs = prepared.into_iter().map(|p| {
        let cancel = cancel.clone();
        let executor = &executor;
        let progress = &progress;
        async move {
            match p {
                Prepared::Finished(batch) => Ok(*batch),
                Prepared::Ready(job) => {
                    let id = job.id().to_owned();
                    let watcher = progress.watch(job.progress());
                    let result = executor.execute(job, cancel).await;
                    watcher.finish().await;
                    result.with_context(|| format!("running job {id}"))
                }
            }
        }
    });
    let results: Vec<anyhow::Result<Batch>> = futures::future::join_all(runs).await;
    progress.close();
    observability.set_ready(false);
    executor.shutdown().await;
    observability.stop().await;

    let mut batches = Vec::new();
    for r in results {
        batches.push(r?);
    }
    // A person at a terminal reads the summary; the Batch objects are for programs (and in
    // each job's batch.json).
    let print_batches = !std::io::stdout().is_terminal();
    for (spec, batch) in specs.iter().zip(&batches) {
        summarize(spec, batch);
        if print_batches {
            println!(
                "{}",
                serde_json::to_string(batch).expect("batch serialises")
            );
        }
    }
    Ok(exit_code(&batches))
}

fn summarize(spec: &JobSpec, batch: &Batch) {
    let c = batch.request_counts;
    // Short lines, so that an 80-column terminal does not wrap them.
    eprintln!("job {}: {}", batch.id, batch.status.as_str());
    eprintln!(
        "  {} requests: {} completed, {} failed",
        c.total, c.completed, c.failed
    );
    eprintln!("  results in {}", spec.output_dir.display());
    if let Some(errors) = &batch.errors {
        for e in errors.data.iter().take(20) {
            match e.line {
                Some(line) => eprintln!("  line {line}: {} ({})", e.message, e.code),
                None => eprintln!("  {} ({})", e.message, e.code),
            }
        }
        if errors.data.len() > 20 {
            eprintln!("  ... and {} more in batch.json", errors.data.len() - 20);
        }
    }
}

fn exit_code(batches: &[Batch]) -> ExitCode {
    let has = |s: BatchStatus| batches.iter().any(|b| b.status == s);
    let code = if has(BatchStatus::Failed) {
        3
    } else if has(BatchStatus::Expired) {
        4
    } else if has(BatchStatus::Cancelled) {
        5
    } else if batches.iter().any(|b| !b.status.is_terminal()) {
        6
    } else {
        0
    };
    ExitCode::from(code)
}
