//! Sync mode against a gateway of capacity C and latency L: how much of C/L AIMD gets.

use std::time::{Duration, Instant};

use batch_executor::Executor;
use dispatcher_sim::{Gateway, GatewayConfig};
use tokio_util::sync::CancellationToken;

use super::{expect_completed, lines, ready, spec};
use crate::inputs::{write_input, MODEL};
use crate::lab::{load, Lab};
use crate::report::{AimdSample, AimdTrace, Report, Row, Target, Unit};
use crate::stats::Summary;
use crate::BenchError;

const AIMD: &str = "Sync AIMD";
const CAPACITY: usize = 64;
const LATENCY: Duration = Duration::from_millis(20);
const PER_ENDPOINT: usize = 128;
const GLOBAL: usize = 256;
const SAMPLE_EVERY: Duration = Duration::from_millis(10);

/// What one run measured.
struct Run {
    throughput: f64,
    share_429: f64,
    mean_limit: f64,
    samples: Vec<AimdSample>,
}

pub(crate) async fn run(
    lab: &Lab,
    s: &crate::Settings,
    report: &mut Report,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<(), BenchError> {
    let n = s.aimd_lines;
    let input = lab.path("aimd.jsonl");
    write_input(&input, n, 1024)?;
    let ceiling = CAPACITY as f64 / LATENCY.as_secs_f64();
    for (factor, default) in [(0.5, true), (0.9, false)] {
        let mut runs = Vec::new();
        for run in 0..s.long_runs {
            let r = one_run(lab, &input, n, factor, run).await?;
            progress(&format!(
                "   backoff_factor {factor}, run {run}: {:.0} req/s ({:.0} % of C/L), 429 responses {:.1} % of requests, mean limit {:.1}",
                r.throughput,
                r.throughput / ceiling * 100.0,
                r.share_429 * 100.0,
                r.mean_limit
            ));
            runs.push(r);
        }
        let throughput = Summary::new(runs.iter().map(|r| r.throughput).collect());
        let share = Summary::new(runs.iter().map(|r| r.share_429).collect());
        let limit = Summary::new(runs.iter().map(|r| r.mean_limit).collect());
        let label = format!(
            "backoff_factor {factor}{}",
            if default { " (default)" } else { "" }
        );
        let mut rate_row = Row::new(
            AIMD,
            format!("{label}: throughput, {} lines", lines(n)),
            Unit::PerSecond("req/s"),
            throughput.clone(),
        )
        .limit(
            format!("C/L = {CAPACITY} / {} ms", LATENCY.as_millis()),
            ceiling,
        );
        let mut share_row = Row::new(
            AIMD,
            format!("{label}: 429 responses / requests"),
            Unit::Percent,
            share,
        );
        if default {
            rate_row = rate_row.target(Target::RatioAtLeast(0.9));
            share_row = share_row.target(Target::AtMost(0.05));
        }
        report.rows.push(rate_row);
        report.rows.push(share_row);
        report.rows.push(Row::new(
            AIMD,
            format!("{label}: mean AIMD limit"),
            Unit::Count,
            limit,
        ));
        if let Some(i) = throughput.median_run() {
            report.aimd.push(AimdTrace {
                label,
                capacity: CAPACITY,
                samples: std::mem::take(&mut runs[i].samples),
            });
        }
    }
    report.note(AIMD, format!(
        "The simulated gateway serves at most C = {CAPACITY} requests at once, each taking L = {} ms, and answers 429 with `Retry-After: 0` beyond that: at most C/L = {ceiling:.0} requests per second. The processor runs in sync mode with `per_endpoint: {PER_ENDPOINT}` (above C, so AIMD must find C), `global: {GLOBAL}`, `max_retries: 1000`, `initial_backoff: 1ms`, `max_backoff: 20ms`; requests are {} lines of 1 KiB.",
        LATENCY.as_millis(), lines(n)
    ));
    report.note(AIMD, "The 429 share counts the gateway's 429 responses (retries included) against the job's requests, as sampled at the gateway. The mean limit is the time average of the endpoint's limit sampled every 10 ms; the plot shows the run with the median throughput.");
    report.note(AIMD, "AIMD cuts once per overload episode (see crates/aimd): with backoff_factor 0.5 the limit saws between about C/2 and C, which averages about 75 % of C in theory; the 0.9 row shows what a gentler cut gives. A request that meets a 429 keeps its permits while it retries (at once, `Retry-After: 0`), so the gateway's in-flight count stays below the limit by the number of requests retrying, and a cut only comes when such a request finally gets its answer (at least L later): the higher the limit sits above C, the more 429s until then.");
    Ok(())
}

async fn one_run(
    lab: &Lab,
    input: &std::path::Path,
    n: usize,
    factor: f64,
    run: usize,
) -> Result<Run, BenchError> {
    let gateway = Gateway::start(
        ([127, 0, 0, 1], 0).into(),
        GatewayConfig {
            latency_fixed: LATENCY,
            capacity: Some(CAPACITY),
            retry_after_secs: 0,
            ..GatewayConfig::default()
        },
    )
    .await?;
    let config = lab.sync_config(
        "aimd.yaml",
        &gateway.base_url(),
        "    max_retries: 1000\n    initial_backoff: 1ms\n    max_backoff: 20ms\n    request_timeout: 30s\n",
        &format!("concurrency:\n  global: {GLOBAL}\n  per_endpoint: {PER_ENDPOINT}\n  aimd:\n    backoff_factor: {factor}\n"),
    )?;
    let executor = Executor::new(load(&config)?).await?;
    let out = lab.fresh_dir(&format!("aimd-{factor}-{run}"))?;
    let mut samples = Vec::new();
    let start = Instant::now();
    let job = ready(&executor, &spec(input, &out, None)).await?;
    let execute = executor.execute(job, CancellationToken::new());
    tokio::pin!(execute);
    let mut ticks = tokio::time::interval(SAMPLE_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let batch = loop {
        tokio::select! {
            batch = &mut execute => break batch?,
            _ = ticks.tick() => {
                let limit = executor.endpoint_limit(MODEL).unwrap_or(0);
                let in_flight = gateway.stats().in_flight;
                samples.push(AimdSample { t: start.elapsed().as_secs_f64(), limit, in_flight });
            }
        }
    };
    let elapsed = start.elapsed().as_secs_f64();
    expect_completed(&batch, n)?;
    let stats = gateway.stats();
    gateway.shutdown().await;
    let mean_limit =
        samples.iter().map(|s| s.limit as f64).sum::<f64>() / samples.len().max(1) as f64;
    Ok(Run {
        throughput: n as f64 / elapsed,
        share_429: stats.responses(429) as f64 / n as f64,
        mean_limit,
        samples,
    })
}
