//! `bench`: measures the batch processor against the limits of this machine and writes the
//! report (`benchmarks.md` and SVG plots). See the `batch-bench` crate for what each scenario does.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use batch_bench::online::{self, OnlineLoad, Shape};
use batch_bench::{Scenario, Settings};
use clap::Parser;

/// Measures the batch processor against the physical limits of this machine.
///
/// Starts its own redis-server on a free loopback port (needs redis-server and
/// redis-benchmark installed), runs every scenario several times and writes benchmarks.md,
/// rates.svg, rss.svg and the limit plots (aimd-limit.svg, aimd-limit-lengths.svg,
/// aimd-limit-tail.svg, aimd-limit-changing.svg, aimd-limit-model-server.svg, and for the gateways of 16 whose latency the usage does not show aimd-limit-unseen-lognormal.svg, aimd-limit-unseen-two-kinds.svg, aimd-limit-unseen-tail.svg, aimd-limit-503.svg, and for prompts of mixed lengths, a fast and a slow pod, and a drifting C aimd-limit-prompts.svg, aimd-limit-pods.svg, aimd-limit-drifting.svg) into --out. Enqueue and drain run a second time on a Redis Cluster
/// of 3 primaries (needs redis-cli too), their rows labelled "(cluster, 3 primaries)" beside the
/// single-server ones. The serve group starts `processor serve` (from --processor) against the
/// same Redis and the dispatcher simulator; the replicas group starts 1 and 3 of them on one
/// Redis and storage, and kills one to time the takeover. Exit status 0 when every scenario ran
/// (targets missed are reported, not errors), 1 when one failed.
///
/// `bench online` instead sends open-loop online traffic to a server by hand and prints what it
/// met (time to first token, inter-token latency, time per output token, end to end).
#[derive(Debug, Parser)]
#[command(name = "bench", version, args_conflicts_with_subcommands = true)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// Where the report and plots go; a new temporary directory with --quick when absent,
    /// `docs` otherwise.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Every scenario once with small sizes (a smoke test of the bench itself).
    #[arg(long)]
    quick: bool,
    /// The processor binary for the memory and serve scenarios [default: next to this binary].
    #[arg(long)]
    processor: Option<PathBuf>,
    /// Run only these scenarios (enqueue, drain, e2e, prefix, aimd, memory, serve, replicas);
    /// repeatable. Enqueue
    /// and drain include their cluster rows.
    #[arg(long = "only", value_parser = parse_scenario)]
    only: Vec<Scenario>,
    /// Skip the cluster runs of enqueue and drain.
    #[arg(long)]
    no_cluster: bool,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Sends streamed chat requests at Poisson arrival times (steady, or in waves of bursts and
    /// quiet periods) to a server, whatever its answers do, and prints per phase the answers per
    /// second, the errors and p50 / p95 / p99 of the time to first token (TTFT), the
    /// inter-token latency (ITL), the time per output token (TPOT) and the end-to-end latency.
    /// For runs by hand against a real stack (a gateway or a vLLM server), beside a batch or
    /// not. Plain HTTP only.
    Online(OnlineArgs),
}

#[derive(Debug, clap::Args)]
struct OnlineArgs {
    /// The server, `http://host:port`; requests go to its `/v1/chat/completions`.
    #[arg(long)]
    url: String,
    /// The model the requests name.
    #[arg(long)]
    model: String,
    /// Requests per second on average; with --waves, the bursts' rate.
    #[arg(long)]
    rate: f64,
    /// How long requests are sent for (`90s`, `2m`); then every answer is waited for.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    duration: Duration,
    /// Waves: --rate for this long (`5s`), then --quiet-rate as long, and again; the bursts and
    /// the quiet periods are reported apart.
    #[arg(long, value_parser = parse_duration)]
    waves: Option<Duration>,
    /// The rate between bursts [default: a tenth of --rate].
    #[arg(long, requires = "waves")]
    quiet_rate: Option<f64>,
    /// Each request's `max_tokens`.
    #[arg(long, default_value_t = 24, conflicts_with = "lengths_median")]
    max_tokens: u64,
    /// Each request's `max_tokens` drawn instead from a lognormal of this median (tokens), so
    /// that with --ignore-eos answers vary in length as LLM answers do (the `yield` scenario's
    /// are median 200, σ 0.7); seeded by --seed.
    #[arg(long, requires = "lengths_sigma")]
    lengths_median: Option<f64>,
    /// The sigma of ln(tokens) of --lengths-median's lognormal.
    #[arg(long, requires = "lengths_median")]
    lengths_sigma: Option<f64>,
    /// Sends `ignore_eos: true`: a vLLM server (or llm-d-inference-sim) then answers exactly
    /// `--max-tokens` tokens, instead of lengths of its own choosing.
    #[arg(long)]
    ignore_eos: bool,
    /// Seeds the arrival times (and the lengths drawn), so a run can be repeated.
    #[arg(long, default_value_t = 40)]
    seed: u64,
    /// A request unanswered this long counts as an error.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    timeout: Duration,
    /// Prints the figures as JSON (times in seconds) instead of a table (times in ms). The exit
    /// status is 1 when no request was answered.
    #[arg(long)]
    json: bool,
}

fn parse_scenario(s: &str) -> Result<Scenario, String> {
    s.parse()
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    batch_config::parse_duration(s)
}

/// `bench online`: the traffic of `args`, its figures printed.
fn online(args: OnlineArgs) -> anyhow::Result<ExitCode> {
    if !(args.rate > 0.0 && args.rate.is_finite()) {
        anyhow::bail!("--rate must be above 0, got {}", args.rate);
    }
    let shape = match args.waves {
        None => Shape::Steady { rate: args.rate },
        Some(wave) => Shape::Waves {
            burst: args.rate,
            quiet: args.quiet_rate.unwrap_or(args.rate / 10.0),
            wave,
        },
    };
    let lengths = match (args.lengths_median, args.lengths_sigma) {
        (Some(median), Some(sigma)) => {
            if !(median >= 1.0 && median.is_finite() && sigma >= 0.0 && sigma.is_finite()) {
                anyhow::bail!(
                    "--lengths-median must be 1 or more and --lengths-sigma 0 or more, got {median} and {sigma}"
                );
            }
            Some(online::Lengths { median, sigma })
        }
        _ => None,
    };
    let load = OnlineLoad {
        base_url: args.url.clone(),
        body: online::chat_body(&args.model, args.max_tokens, args.ignore_eos),
        shape,
        duration: args.duration,
        seed: args.seed,
        timeout: args.timeout,
        lengths,
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let run = runtime.block_on(online::run(&load))?;
    let phases = run.figures();
    let overall = run.overall();
    if args.json {
        let out = serde_json::json!({
            "url": args.url,
            "model": args.model,
            "shape": shape,
            "duration_seconds": args.duration.as_secs_f64(),
            "max_tokens": args.max_tokens,
            "lengths": lengths,
            "phases": phases,
            "overall": overall,
        });
        println!("{out:#}");
    } else {
        let max_tokens = match lengths {
            Some(l) => format!("lognormal (median {}, σ {})", l.median, l.sigma),
            None => args.max_tokens.to_string(),
        };
        println!(
            "{} requests to {} over {:.0} s ({shape:?}), max_tokens {max_tokens}:",
            run.answers.len(),
            args.url,
            args.duration.as_secs_f64(),
        );
        let lines: Vec<(String, online::PhaseFigures)> = phases
            .into_iter()
            .map(|f| ("online".to_owned(), f))
            .collect();
        print!("{}", online::table(&lines, false));
        if overall.errors > 0 {
            println!("failed: {}", overall.failures_text());
        }
    }
    if overall.answered == 0 {
        eprintln!(
            "no request was answered ({}): requests go to {}/v1/chat/completions, naming --model {}",
            overall.failures_text(),
            args.url.trim_end_matches('/'),
            args.model
        );
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> anyhow::Result<ExitCode> {
    // Helper mode, used by the memory scenario to start the processor from a small process.
    let raw: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if raw.get(1).is_some_and(|a| a == batch_bench::RSS_HELPER_ARG) {
        let code = batch_bench::rss_helper(&raw[2..])?;
        return Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)));
    }
    let args = Args::parse();
    if let Some(Command::Online(online_args)) = args.command {
        return online(online_args);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .init();
    let me = std::env::current_exe().context("locating the bench binary")?;
    let processor = args
        .processor
        .unwrap_or_else(|| me.with_file_name("processor"));
    let mut settings = if args.quick {
        Settings::quick(processor)
    } else {
        Settings::full(processor)
    };
    settings.rss_helper = Some(me);
    if args.no_cluster {
        settings.cluster_primaries = 0;
    }
    if !args.only.is_empty() {
        settings.scenarios = args.only;
    }
    let (out, _keep) = match args.out {
        Some(dir) => (dir, None),
        None if args.quick => {
            let tmp = tempfile::Builder::new()
                .prefix("batch-bench-quick-")
                .tempdir()
                .context("creating a temporary output directory")?
                .keep();
            (tmp.clone(), Some(tmp))
        }
        None => (PathBuf::from("docs"), None),
    };

    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let report = runtime.block_on(batch_bench::run(&settings, &|msg: &str| eprintln!("{msg}")))?;
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));

    print!("{}", report.text_table());
    report.write(&out)?;
    println!(
        "\nreport: {}  (plots: rates.svg, rss.svg, aimd-limit*.svg), {:.0} s",
        out.join("benchmarks.md").display(),
        report.elapsed.as_secs_f64()
    );
    let missed = report.missed();
    if !missed.is_empty() {
        println!("targets not met: {}", missed.len());
        for r in missed {
            println!("  {} / {}", r.scenario, r.figure);
        }
    }
    Ok(if report.failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
