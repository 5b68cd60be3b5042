//! Measures the batch processor against the physical limits of the machine it runs on.
//!
//! Each scenario runs the real parts (the executor, producer, result consumer, sink, the
//! `processor` binary, a real `redis-server`, the dispatcher simulator and its gateway) several
//! times and compares the median with a limit measured in the same run (`redis-benchmark`, the
//! simulated gateway's capacity):
//!
//! 1. **Enqueue**: a job's requests into the dispatcher's sorted set, against `redis-benchmark
//!    ZADD` of members of the same size and a naive one-transaction-per-request baseline;
//! 2. **Drain**: results already waiting in the result list written to the job's files, against
//!    `redis-benchmark RPOP`;
//! 3. **End to end async** through the simulator, with where the time went;
//! 4. **Cancel**: time to take 50,000 pending members out of the set;
//! 5. **Prefix cache**: a job with its system prompts shuffled through the input, scored in plan
//!    order against all at one score (the original processor), through a gateway with an LRU of
//!    prompt prefixes: hit rate and time when a miss costs latency;
//! 6. **Sync AIMD**: each limiter (the reference AIMD, the gradient limiter, the default work
//!    limiter) against a gateway of capacity C in five shapes (a hard limit at a fixed latency;
//!    with lognormal answer lengths; with a heavy tail; a limit changing mid-run; a model
//!    server whose time per output token grows past C): throughput as a share of what the
//!    gateway can serve, 429s, and the model server's time per token;
//! 7. **Memory**: peak RSS of the `processor` binary by job size, in both modes;
//! 8. **Serve**: `processor serve` through its HTTP API: a 200 MB upload against writing the
//!    same bytes to the same disk, with the service's peak RSS; `GET /v1/batches/{id}` from 32
//!    clients with 1,000 batches stored; 1,000 batches of 50 lines submitted at once: time to
//!    the last completed and the service's Redis connections;
//! 9. **Replicas**: the same batches run by 1 and by 3 `processor serve` replicas sharing one
//!    Redis, storage and simulator (jobs per minute, requests per second, in async and sync
//!    mode), and the time from a replica's SIGKILL to each of its jobs' leases held by another
//!    replica and to their counts growing again;
//! 10. **Yield**: three batch jobs beside open-loop online traffic ([`online`]) on a simulated
//!     vLLM server, steady at 25, 50 and 75 % of its capacity and in waves, in sync mode with
//!     and without `load` and in async mode as `processor queues` prints it: the online
//!     requests' time to first token, inter-token latency, time per output token and
//!     end-to-end latency per phase, the batch's share of the spare capacity, each job's
//!     progress and the online latency over time.
//!
//! Enqueue and drain run a second time on a Redis Cluster of 3 primaries
//! ([`Settings::cluster_primaries`]), with the cluster's limits measured the same way.
//!
//! [`run`] returns a [`Report`]; [`Report::write`] writes `benchmarks.md` and the plots.
//!
//! ```no_run
//! use batch_bench::{Settings, run};
//!
//! # async fn demo() -> Result<(), batch_bench::BenchError> {
//! let settings = Settings::quick("target/release/processor".into());
//! let report = run(&settings, &|msg: &str| eprintln!("{msg}")).await?;
//! print!("{}", report.text_table());
//! report.write("docs".as_ref())?;
//! # Ok(()) }
//! ```

mod child;
mod inputs;
mod lab;
mod machine;
pub mod online;
mod plots;
mod redis_benchmark;
mod report;
mod rss;
mod scenarios;
mod service;
mod stats;

use std::path::{Path, PathBuf};
use std::time::Instant;

pub use inputs::{
    completion_body, request_line, result_element, shuffled_prompts, write_input,
    write_prefix_input, MODEL, POOL,
};
pub use lab::Lab;
pub use machine::{utc_date, Machine};
pub use redis_benchmark::{parse_csv_rps, RedisBenchmark};
pub use report::{
    thousands, AimdSample, AimdTrace, Kind, Limit, Report, Row, RssPoint, Target, Timeline, Unit,
    AIMD_PLOTS,
};
pub use rss::{rss_helper, RSS_HELPER_ARG};
pub use scenarios::Scenario;
pub use stats::Summary;

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A program the bench needs is not installed.
    #[error("{0} is not installed or does not run (scripts/bench.sh installs redis-server and redis-benchmark; build the processor with `cargo build --release --bins`)")]
    MissingTool(String),
    /// A file could not be read or written.
    ///
    /// The I/O error is part of the message, not a `source()`, so a printed chain shows it once.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        error: std::io::Error,
    },
    /// A Redis command failed (the client's error is in the message, not a `source()`).
    #[error("redis: {0}")]
    Redis(fred::error::Error),
    /// Redis could not be reached.
    #[error(transparent)]
    Connect(#[from] batch_redis::ConnectError),
    /// A processor config written by the bench, or a queue name it gives, was refused.
    #[error("config: {0}")]
    Config(String),
    /// The executor failed.
    #[error(transparent)]
    Exec(#[from] batch_executor::ExecError),
    /// Planning failed.
    #[error(transparent)]
    Plan(#[from] batch_plan::PlanError),
    /// The producer failed.
    #[error(transparent)]
    Producer(#[from] batch_producer::ProducerError),
    /// The simulator failed to start.
    #[error(transparent)]
    Sim(#[from] dispatcher_sim::SimError),
    /// An external tool (`redis-benchmark`, the `processor` binary) failed.
    #[error("{0}")]
    Tool(String),
    /// A run did not end the way it must for its figure to mean anything.
    #[error("{0}")]
    Check(String),
    /// A plot could not be drawn.
    #[error("plot: {0}")]
    Plot(String),
}

impl BenchError {
    pub(crate) fn io(path: &Path, error: std::io::Error) -> Self {
        Self::Io {
            path: path.to_owned(),
            error,
        }
    }
}

impl From<fred::error::Error> for BenchError {
    fn from(error: fred::error::Error) -> Self {
        Self::Redis(error)
    }
}

impl From<batch_keys::NameError> for BenchError {
    fn from(error: batch_keys::NameError) -> Self {
        Self::Config(error.to_string())
    }
}

/// Sizes and repetitions of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// The small smoke-test run.
    pub quick: bool,
    /// Which scenarios run (all by default).
    pub scenarios: Vec<Scenario>,
    /// The `processor` binary, for the scenarios that run it as a child process (memory,
    /// serve, replicas).
    pub processor: PathBuf,
    /// A program that runs [`rss_helper`] when its first argument is [`RSS_HELPER_ARG`] (the
    /// bench binary); the memory scenario needs it.
    pub rss_helper: Option<PathBuf>,
    /// Lines of the enqueue (and cancel) job.
    pub enqueue_lines: usize,
    /// Results waiting in the list for the drain scenario.
    pub drain_results: usize,
    /// Lines of the end-to-end job.
    pub e2e_lines: usize,
    /// Lines of the sync AIMD job.
    pub aimd_lines: usize,
    /// Job sizes of the memory scenario.
    pub memory_sizes: Vec<usize>,
    /// Lines of the prefix-cache job.
    pub prefix_lines: usize,
    /// Distinct system prompts in the prefix-cache job.
    pub prefix_prompts: usize,
    /// Prompt prefixes the gateway caches per endpoint.
    pub prefix_cache: usize,
    /// Extra latency of a prefix-cache miss.
    pub prefix_miss_latency: std::time::Duration,
    /// Bytes of one input line.
    pub request_bytes: usize,
    /// Bytes of one result body.
    pub result_bytes: usize,
    /// Runs of the short scenarios.
    pub short_runs: usize,
    /// Runs of the long scenarios.
    pub long_runs: usize,
    /// Requests of each `redis-benchmark` run.
    pub redis_benchmark_requests: usize,
    /// Primaries of the Redis Cluster that enqueue and drain run on a second time; none when 0.
    pub cluster_primaries: usize,
    /// Bytes of the file the serve scenario uploads.
    pub serve_upload_bytes: u64,
    /// Batches the serve scenario submits at once (and then reads under load).
    pub serve_batches: usize,
    /// Lines of each of those batches.
    pub serve_batch_lines: usize,
    /// Concurrent clients of the `GET /v1/batches/{id}` load.
    pub serve_clients: usize,
    /// How long the `GET /v1/batches/{id}` load runs.
    pub serve_load: std::time::Duration,
    /// Batches of the replicas throughput runs (the same for 1 and for 3 replicas).
    pub replicas_batches: usize,
    /// Lines of each of those batches.
    pub replicas_batch_lines: usize,
    /// Lines of each batch of the takeover runs.
    pub takeover_lines: usize,
    /// Also measure the takeover with the default `serve.lease_ttl` (30 s), once.
    pub takeover_default_lease: bool,
}

impl Settings {
    /// The `processor` binary, or why a scenario that runs it cannot.
    pub(crate) fn require_processor(&self) -> Result<&std::path::Path, BenchError> {
        if self.processor.is_file() {
            Ok(&self.processor)
        } else {
            Err(BenchError::MissingTool(
                self.processor.display().to_string(),
            ))
        }
    }

    /// The full run: 50,000-line jobs, 5 runs of short scenarios, 3 of long ones.
    pub fn full(processor: PathBuf) -> Self {
        Self {
            quick: false,
            scenarios: Scenario::ALL.to_vec(),
            processor,
            rss_helper: None,
            enqueue_lines: 50_000,
            drain_results: 50_000,
            e2e_lines: 50_000,
            aimd_lines: 20_000,
            memory_sizes: vec![1_000, 10_000, 50_000],
            prefix_lines: 20_000,
            prefix_prompts: 200,
            prefix_cache: 32,
            prefix_miss_latency: std::time::Duration::from_millis(50),
            request_bytes: 2048,
            result_bytes: 1024,
            short_runs: 5,
            long_runs: 3,
            redis_benchmark_requests: 50_000,
            cluster_primaries: 3,
            serve_upload_bytes: 200_000_000,
            serve_batches: 1_000,
            serve_batch_lines: 50,
            serve_clients: 32,
            serve_load: std::time::Duration::from_secs(5),
            replicas_batches: 24,
            replicas_batch_lines: 1_000,
            takeover_lines: 3_000,
            takeover_default_lease: true,
        }
    }

    /// The smoke test: every scenario once, with small sizes.
    pub fn quick(processor: PathBuf) -> Self {
        Self {
            quick: true,
            enqueue_lines: 2_000,
            drain_results: 2_000,
            e2e_lines: 2_000,
            aimd_lines: 1_000,
            memory_sizes: vec![100, 300, 1_000],
            prefix_lines: 1_000,
            short_runs: 1,
            long_runs: 1,
            redis_benchmark_requests: 5_000,
            serve_upload_bytes: 20_000_000,
            serve_batches: 100,
            serve_load: std::time::Duration::from_secs(1),
            replicas_batches: 6,
            replicas_batch_lines: 200,
            takeover_lines: 1_000,
            takeover_default_lease: false,
            ..Self::full(processor)
        }
    }
}

/// Runs the selected scenarios in order and returns their figures. A scenario that fails is
/// recorded in [`Report::failures`] and the next one runs; `progress` hears what is going on.
pub async fn run(
    settings: &Settings,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<Report, BenchError> {
    let started = Instant::now();
    let mut report = Report::new(Machine::probe(), settings.quick);
    let lab = Lab::start().await?;
    progress(&format!(
        "redis-server on 127.0.0.1:{}, scratch files in {}",
        lab.redis_port(),
        lab.path("").display()
    ));
    let mut cluster = scenarios::cluster::ClusterRuns::default();
    for &scenario in &settings.scenarios {
        progress(&format!("== {}", scenario.name()));
        let began = Instant::now();
        let cx = scenarios::Ctx {
            lab: &lab,
            s: settings,
            progress,
        };
        if let Err(e) = scenarios::run(scenario, cx, &mut report).await {
            progress(&format!("{} failed: {e}", scenario.name()));
            report
                .failures
                .push((scenario.name().to_owned(), e.to_string()));
        }
        progress(&format!(
            "   {} took {:.1} s",
            scenario.name(),
            began.elapsed().as_secs_f64()
        ));
        let _ = lab.flush_redis().await;
        if settings.cluster_primaries > 0 && scenarios::cluster::covers(scenario) {
            let name = format!("{} (cluster)", scenario.name());
            progress(&format!("== {name}"));
            let began = Instant::now();
            if let Err(e) = cluster.run(scenario, settings, &mut report, progress).await {
                progress(&format!("{name} failed: {e}"));
                report.failures.push((name.clone(), e.to_string()));
            }
            progress(&format!(
                "   {name} took {:.1} s",
                began.elapsed().as_secs_f64()
            ));
        }
    }
    cluster.stop().await;
    lab.stop().await;
    report.elapsed = started.elapsed();
    Ok(report)
}
