//! Sync mode against a gateway of capacity C and latency L, in three behaviours: how much of
//! what the gateway can serve each limiter gets, and how many 429s it costs.

use std::time::{Duration, Instant};

use batch_executor::Executor;
use dispatcher_sim::{Gateway, GatewayConfig};
use tokio_util::sync::CancellationToken;

use super::{expect_completed, lines, ready, spec};
use crate::inputs::{write_input, MODEL};
use crate::lab::{load, Lab};
use crate::report::{AimdSample, AimdTrace, Kind, Report, Row, Target, Unit};
use crate::stats::Summary;
use crate::BenchError;

const AIMD: &str = "Sync AIMD";
const CAPACITY: usize = 64;
/// The capacity of the middle phase of the changing gateway.
const LOW_CAPACITY: usize = 16;
/// The queueing gateway's queue limit: 429 only past it.
const QUEUE_LIMIT: usize = 96;
const LATENCY: Duration = Duration::from_millis(20);
const PER_ENDPOINT: usize = 128;
const GLOBAL: usize = 256;
const SAMPLE_EVERY: Duration = Duration::from_millis(10);

/// How the simulated gateway behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Behaviour {
    /// (a) At most C at once, 429 above.
    Hard,
    /// (b) Like `Hard`, C going 64 → 16 → 64 during the run.
    Changing,
    /// (c) Latency L × max(1, n / C), 429 only past the queue limit.
    Queueing,
}

impl Behaviour {
    const ALL: [Behaviour; 3] = [Behaviour::Hard, Behaviour::Changing, Behaviour::Queueing];

    fn label(self) -> &'static str {
        match self {
            Behaviour::Hard => "hard limit",
            Behaviour::Changing => "changing limit",
            Behaviour::Queueing => "queueing",
        }
    }

    fn plot(self) -> &'static str {
        match self {
            Behaviour::Hard => "aimd-limit.svg",
            Behaviour::Changing => "aimd-limit-changing.svg",
            Behaviour::Queueing => "aimd-limit-queueing.svg",
        }
    }

    fn config(self) -> GatewayConfig {
        GatewayConfig {
            latency_fixed: LATENCY,
            capacity: Some(CAPACITY),
            queue_limit: (self == Behaviour::Queueing).then_some(QUEUE_LIMIT),
            retry_after_secs: 0,
            ..GatewayConfig::default()
        }
    }
}

/// A limiter configuration under test.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    algorithm: &'static str,
    factor: f64,
    /// Its rows carry the targets.
    targeted: bool,
}

impl Candidate {
    fn label(&self) -> String {
        match self.algorithm {
            "aimd" => format!("aimd, backoff_factor {}", self.factor),
            FIXED => format!("no limiter, per_endpoint fixed at C = {CAPACITY}"),
            other => other.to_owned(),
        }
    }

    /// The `concurrency` section of its config.
    fn concurrency(&self) -> String {
        if self.algorithm == FIXED {
            return format!(
                "concurrency:\n  global: {GLOBAL}\n  per_endpoint: {CAPACITY}\n  aimd:\n    enabled: false\n"
            );
        }
        format!(
            "concurrency:\n  global: {GLOBAL}\n  per_endpoint: {PER_ENDPOINT}\n  aimd:\n    algorithm: {}\n    backoff_factor: {}\n",
            self.algorithm, self.factor
        )
    }
}

/// The baseline: the limit set by hand to the gateway's usual capacity, what a limiter that
/// knew C would get from this processor and machine.
const FIXED: &str = "fixed";

const CANDIDATES: [Candidate; 4] = [
    Candidate {
        algorithm: FIXED,
        factor: 0.5,
        targeted: false,
    },
    Candidate {
        algorithm: "aimd",
        factor: 0.5,
        targeted: false,
    },
    Candidate {
        algorithm: "aimd",
        factor: 0.9,
        targeted: false,
    },
    Candidate {
        algorithm: "gradient",
        factor: 0.5,
        targeted: true,
    },
];

/// What one run measured.
struct Run {
    throughput: f64,
    /// What the gateway could serve over this run, req/s (time-weighted when C changes).
    ceiling: f64,
    share_429: f64,
    mean_limit: f64,
    samples: Vec<AimdSample>,
}

/// When the changing gateway switches: C goes to 16 at the first instant, back to 64 at the
/// second. Scaled to the job so the quick run changes too.
fn phases(n: usize) -> (f64, f64) {
    let full = n as f64 / (CAPACITY as f64 / LATENCY.as_secs_f64());
    (0.3 * full, 0.6 * full)
}

/// The capacity of `behaviour` at `t` seconds.
fn capacity_at(behaviour: Behaviour, n: usize, t: f64) -> usize {
    let (low, high) = phases(n);
    if behaviour == Behaviour::Changing && t >= low && t < high {
        LOW_CAPACITY
    } else {
        CAPACITY
    }
}

/// C/L averaged over `[0, elapsed]`.
fn time_weighted_ceiling(behaviour: Behaviour, n: usize, elapsed: f64) -> f64 {
    let per_second = |c: usize| c as f64 / LATENCY.as_secs_f64();
    if behaviour != Behaviour::Changing || elapsed <= 0.0 {
        return per_second(CAPACITY);
    }
    let (low, high) = phases(n);
    let low_time = (elapsed.min(high) - low).max(0.0);
    (per_second(LOW_CAPACITY) * low_time + per_second(CAPACITY) * (elapsed - low_time)) / elapsed
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
    let mut bare = Vec::new();
    for run in 0..s.long_runs {
        let rate = bare_client(&input, n).await?;
        progress(&format!(
            "   hard limit, bare HTTP client, {CAPACITY} at once, run {run}: {rate:.0} req/s"
        ));
        bare.push(rate);
    }
    let bare = Summary::new(bare);
    report.rows.push(
        Row::new(
            AIMD,
            format!(
                "hard limit, bare HTTP client, {CAPACITY} at once (no processor): throughput, {} lines",
                lines(n)
            ),
            Unit::PerSecond("req/s"),
            bare.clone(),
        )
        .limit(
            format!("C/L = {CAPACITY} / {} ms", LATENCY.as_millis()),
            CAPACITY as f64 / LATENCY.as_secs_f64(),
        )
        .kind(Kind::Limit),
    );
    for behaviour in Behaviour::ALL {
        for candidate in CANDIDATES {
            let mut runs = Vec::new();
            for run in 0..s.long_runs {
                let r = one_run(lab, &input, n, behaviour, candidate, run).await?;
                progress(&format!(
                    "   {}, {}, run {run}: {:.0} req/s ({:.0} % of {:.0}), 429 responses {:.1} % of requests, mean limit {:.1}",
                    behaviour.label(),
                    candidate.label(),
                    r.throughput,
                    r.throughput / r.ceiling * 100.0,
                    r.ceiling,
                    r.share_429 * 100.0,
                    r.mean_limit
                ));
                runs.push(r);
            }
            record(report, behaviour, candidate, n, &mut runs);
        }
    }
    report.note(AIMD, format!(
        "The simulated gateway answers each request in L = {} ms and 429 (`Retry-After: 0`) past its limit, in three behaviours: **hard limit**: at most C = {CAPACITY} at once; **changing limit**: the same, C going {CAPACITY} → {LOW_CAPACITY} → {CAPACITY} at 30 % and 60 % of the time {} lines take at C/L; **queueing**: like a model server past its knee, a request admitted with n in flight takes L × max(1, n / C), so at most C/L = {:.0} req/s whatever the concurrency, and only past Q = {QUEUE_LIMIT} in flight the answer is 429. The limit each throughput is compared with is C/L, time-weighted over the run for the changing gateway (of the run with the median throughput), and the knee's C/L for the queueing one.",
        LATENCY.as_millis(), lines(n), CAPACITY as f64 / LATENCY.as_secs_f64()
    ));
    report.note(AIMD, format!(
        "The processor runs in sync mode with `per_endpoint: {PER_ENDPOINT}` (above C, so the limiter must find C), `global: {GLOBAL}`, `aimd.min: 5`, `max_retries: 1000`, `initial_backoff: 1ms`, `max_backoff: 20ms`; requests are {} lines of 1 KiB. `aimd` is the reference processor's limiter (starts at `per_endpoint`, cuts by `backoff_factor` once per overload episode, a request keeps its permit while it retries); `gradient` is crates/aimd's `GradientLimiter` (starts at `aimd.min` and doubles; latency floor; a 429 cuts to the concurrency that was refused; hears every attempt; a request gives its permit back while it backs off). The targets apply to `gradient`.",
        lines(n)
    ));
    report.note(AIMD, format!(
        "What a client on this machine can get from the hard-limit gateway at all: the bare HTTP client row is {CAPACITY} callers in the bench process, each POSTing the job's first request body again the moment its last answer came, over keep-alive HTTP/1 (hyper, no processor, no limiter, no 429), {:.0} req/s median, {:.0} % of C/L. It loses to C/L what every request's round trip outside the gateway's {} ms takes: all {CAPACITY} answers of a wave come within microseconds of each other and wait for the CPU, client and gateway sharing the 2 cores.",
        bare.median(),
        bare.median() / (CAPACITY as f64 / LATENCY.as_secs_f64()) * 100.0,
        LATENCY.as_millis()
    ));
    report.note(AIMD, "The 429 share counts the gateway's 429 responses (retries included) against the job's requests, as counted at the gateway. The mean limit is the time average of the endpoint's limit sampled every 10 ms; the plots show the run with the median throughput.");
    report.note(AIMD, "The reference AIMD with backoff_factor 0.5 saws between about C/2 and C (about 75 % of C on average); 0.9 cuts less but, since a request that meets a 429 keeps its permit and retries at once and a cut only comes with a final answer, it meets more 429s. Against the queueing gateway the reference sits above the knee (it starts at 128 and only a 429 past Q moves it), which costs latency, not throughput.");
    Ok(())
}

/// The machine's own ceiling against the hard limit: C callers at once, each sending its next
/// request the moment its last answer came (no processor).
async fn bare_client(input: &std::path::Path, n: usize) -> Result<f64, BenchError> {
    use std::io::BufRead;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let mut line = String::new();
    std::fs::File::open(input)
        .map(std::io::BufReader::new)
        .and_then(|mut r| r.read_line(&mut line))
        .map_err(|e| BenchError::io(input, e))?;
    let first: serde_json::Value = serde_json::from_str(&line)
        .map_err(|e| BenchError::Check(format!("the bench's input: {e}")))?;
    let body = bytes::Bytes::from(first["body"].to_string());
    let gateway = Gateway::start(([127, 0, 0, 1], 0).into(), Behaviour::Hard.config()).await?;
    let api = crate::service::Api::new(&gateway.base_url(), CAPACITY);
    let next = std::sync::Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let callers = (0..CAPACITY).map(|_| {
        let (api, body, next) = (api.clone(), body.clone(), next.clone());
        async move {
            while next.fetch_add(1, Ordering::Relaxed) < n {
                let reply = api
                    .post_json_bytes("/v1/chat/completions", body.clone())
                    .await?;
                if reply.status != hyper::StatusCode::OK {
                    return Err(BenchError::Check(format!(
                        "the bare client got {} from the gateway",
                        reply.status
                    )));
                }
            }
            Ok(())
        }
    });
    let called = futures::future::try_join_all(callers).await;
    let rate = n as f64 / start.elapsed().as_secs_f64();
    gateway.shutdown().await;
    called.map(|_| rate)
}

fn record(
    report: &mut Report,
    behaviour: Behaviour,
    candidate: Candidate,
    n: usize,
    runs: &mut [Run],
) {
    let throughput = Summary::new(runs.iter().map(|r| r.throughput).collect());
    let share = Summary::new(runs.iter().map(|r| r.share_429).collect());
    let limit = Summary::new(runs.iter().map(|r| r.mean_limit).collect());
    let median = throughput.median_run();
    let ceiling = median.map_or(CAPACITY as f64 / LATENCY.as_secs_f64(), |i| runs[i].ceiling);
    let label = format!("{}, {}", behaviour.label(), candidate.label());
    let ceiling_name = match behaviour {
        Behaviour::Hard => format!("C/L = {CAPACITY} / {} ms", LATENCY.as_millis()),
        Behaviour::Changing => {
            format!("time-weighted C/L, C = {CAPACITY} → {LOW_CAPACITY} → {CAPACITY}")
        }
        Behaviour::Queueing => format!("knee C/L = {CAPACITY} / {} ms", LATENCY.as_millis()),
    };
    let mut rate_row = Row::new(
        AIMD,
        format!("{label}: throughput, {} lines", lines(n)),
        Unit::PerSecond("req/s"),
        throughput.clone(),
    )
    .limit(ceiling_name, ceiling);
    let mut share_row = Row::new(
        AIMD,
        format!("{label}: 429 responses / requests"),
        Unit::Percent,
        share,
    );
    if candidate.targeted {
        rate_row = rate_row.target(Target::RatioAtLeast(0.9));
        share_row = share_row.target(Target::AtMost(0.05));
    }
    report.rows.push(rate_row);
    report.rows.push(share_row);
    report.rows.push(Row::new(
        AIMD,
        format!("{label}: mean limit"),
        Unit::Count,
        limit,
    ));
    if let Some(i) = median {
        report.aimd.push(AimdTrace {
            label,
            plot: behaviour.plot().to_owned(),
            capacity: CAPACITY,
            samples: std::mem::take(&mut runs[i].samples),
        });
    }
}

async fn one_run(
    lab: &Lab,
    input: &std::path::Path,
    n: usize,
    behaviour: Behaviour,
    candidate: Candidate,
    run: usize,
) -> Result<Run, BenchError> {
    let gateway = Gateway::start(([127, 0, 0, 1], 0).into(), behaviour.config()).await?;
    let config = lab.sync_config(
        "aimd.yaml",
        &gateway.base_url(),
        "    max_retries: 1000\n    initial_backoff: 1ms\n    max_backoff: 20ms\n    request_timeout: 30s\n",
        &candidate.concurrency(),
    )?;
    let executor = Executor::new(load(&config)?).await?;
    let out = lab.fresh_dir(&format!(
        "aimd-{:?}-{}-{}-{run}",
        behaviour, candidate.algorithm, candidate.factor
    ))?;
    let mut samples = Vec::new();
    let mut capacity = CAPACITY;
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
                let t = start.elapsed().as_secs_f64();
                let now = capacity_at(behaviour, n, t);
                if now != capacity {
                    capacity = now;
                    gateway.set_config(GatewayConfig { capacity: Some(now), ..gateway.config() })?;
                }
                let limit = executor.endpoint_limit(MODEL).unwrap_or(0);
                let in_flight = gateway.stats().in_flight;
                samples.push(AimdSample { t, limit, in_flight, capacity });
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
        ceiling: time_weighted_ceiling(behaviour, n, elapsed),
        share_429: stats.responses(429) as f64 / n as f64,
        mean_limit,
        samples,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_changing_ceiling_is_weighted_by_time() {
        let n = 20_000; // 6.25 s at C/L: 16 from 1.875 s to 3.75 s
        let full = 3200.0;
        assert_eq!(time_weighted_ceiling(Behaviour::Hard, n, 10.0), full);
        assert_eq!(time_weighted_ceiling(Behaviour::Changing, n, 1.0), full);
        let at_5 = (full * (5.0 - 1.875) + 800.0 * 1.875) / 5.0;
        assert!((time_weighted_ceiling(Behaviour::Changing, n, 5.0) - at_5).abs() < 1e-9);
        assert_eq!(capacity_at(Behaviour::Changing, n, 2.0), LOW_CAPACITY);
        assert_eq!(capacity_at(Behaviour::Changing, n, 4.0), CAPACITY);
        assert_eq!(capacity_at(Behaviour::Queueing, n, 2.0), CAPACITY);
    }
}
