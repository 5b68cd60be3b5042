//! Sync mode against a gateway of capacity C in five shapes: how much of what the gateway can
//! serve each limiter gets, and how many 429s it costs. `BENCH_AIMD_ONLY=TEXT` runs only the
//! pairs whose label (`(b) hard limit, lognormal lengths, work (default)`) contains TEXT, to
//! look at one limiter closely.

use std::time::{Duration, Instant};

use batch_executor::Executor;
use dispatcher_sim::{GatewayConfig, GatewayStats, Unseen};
use tokio_util::sync::CancellationToken;

use super::{lines, ready, simulator, spec, Ctx};
use crate::inputs::{write_input, write_mixed_input, MODEL};
use crate::lab::{load, Lab};
use crate::report::{AimdSample, AimdTrace, Kind, Report, Row, Target, Unit};
use crate::stats::Summary;
use crate::BenchError;

const AIMD: &str = "Sync AIMD";
const CAPACITY: usize = 64;
/// The capacity of the middle phase of the changing gateway.
const LOW_CAPACITY: usize = 16;
/// The model server's queue limit: 429 only past it.
const QUEUE_LIMIT: usize = 128;
/// The fixed-latency gateway's latency.
const LATENCY: Duration = Duration::from_millis(20);
/// The other gateways: prompt processing, and time per output token.
const PROMPT: Duration = Duration::from_millis(10);
const PER_TOKEN: Duration = Duration::from_millis(1);
/// Answer lengths: lognormal, median and sigma of ln(tokens).
const LENGTH_MEDIAN: u64 = 40;
const LENGTH_SIGMA: f64 = 0.8;
/// The heavy tail: this share of answers is this many times longer.
const TAIL_SHARE: f64 = 0.01;
const TAIL_FACTOR: f64 = 20.0;
/// The mean unloaded latency with lognormal lengths (10 ms + 1 ms × 40 × e^(σ²/2)), to size
/// the runs and time the changing gateway's phases.
const LENGTHS_LATENCY: Duration = Duration::from_micros(65_100);
/// The gateways whose latency varies for reasons the usage does not show: this many at once,
/// each answer this long before its own factor, every answer reporting the same usage.
const SMALL_CAPACITY: usize = 16;
const SMALL_LATENCY: Duration = Duration::from_millis(50);
/// (j): prompt processing per prompt word, on `MIXED_FIXED`, the prompts' sizes lognormal.
const MIXED_FIXED: Duration = Duration::from_millis(20);
const PROMPT_WORD: Duration = Duration::from_micros(250);
const MIXED_MEDIAN_BYTES: usize = 1024;
const MIXED_SIGMA: f64 = 0.8;
/// (k): the slow pod's latency over the fast one's.
const SLOW_POD: f64 = 3.0;
/// (l): the least C of the drift.
const DRIFT_LOW: usize = 8;
/// Their runs last this many times as long as the others': a noisy latency takes more
/// answers to measure.
const SMALL_RUN_FACTOR: f64 = 4.0;
const PER_ENDPOINT: usize = 128;
const GLOBAL: usize = 256;
const SAMPLE_EVERY: Duration = Duration::from_millis(10);
/// Throughput is measured until this share of the lines is answered: the job's last answers
/// drain at a falling concurrency whatever the limiter, for as long as its longest answer.
const MEASURED_SHARE: f64 = 0.95;

/// How the simulated gateway behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Behaviour {
    /// (a) At most C at once, 429 above, every answer L.
    Hard,
    /// (b) Like `Hard`, answers of lognormal length at 10 ms + 1 ms per token.
    Lengths,
    /// (c) Like `Lengths`, 1 % of the answers 20 × longer.
    Tail,
    /// (d) Like `Lengths`, C going 64 → 16 → 64 during the run.
    Changing,
    /// (e) A model server with `Lengths`' answers: past C the time per output token grows
    /// with the requests running, 429 only past the queue limit.
    ModelServer,
    /// (f) 16 at once, 50 ms × a lognormal factor (sigma 0.8) that the usage does not show.
    UnseenLognormal,
    /// (g) 16 at once, two kinds of request, 20 ms and 400 ms, half each, the same usage.
    UnseenTwoKinds,
    /// (h) 16 at once, 50 ms, 10 % of the requests 10 × longer, the same usage.
    UnseenTail,
    /// (i) 16 at once, fixed 50 ms, 503 (not 429) when full.
    Full503,
    /// (j) 16 at once, 20 ms + 0.25 ms per prompt word, prompts of lognormal sizes: the
    /// answers' `prompt_tokens` say why, `completion_tokens` is the same for all.
    MixedPrompts,
    /// (k) 16 at once, behind one URL a fast pod (50 ms) and a slow one (150 ms), the least busy
    /// one taking each request.
    FastSlowPods,
    /// (l) 16 at once, fixed 50 ms, C drifting slowly down to 8 and back (a cosine over the run).
    Drifting,
}

impl Behaviour {
    const ALL: [Behaviour; 12] = [
        Behaviour::Hard,
        Behaviour::Lengths,
        Behaviour::Tail,
        Behaviour::Changing,
        Behaviour::ModelServer,
        Behaviour::UnseenLognormal,
        Behaviour::UnseenTwoKinds,
        Behaviour::UnseenTail,
        Behaviour::Full503,
        Behaviour::MixedPrompts,
        Behaviour::FastSlowPods,
        Behaviour::Drifting,
    ];

    /// The gateway's usual capacity C.
    fn capacity(self) -> usize {
        if self.small() {
            SMALL_CAPACITY
        } else {
            CAPACITY
        }
    }

    /// One of the gateways of 16 whose latency the usage does not explain.
    fn small(self) -> bool {
        matches!(
            self,
            Behaviour::UnseenLognormal
                | Behaviour::UnseenTwoKinds
                | Behaviour::UnseenTail
                | Behaviour::Full503
                | Behaviour::MixedPrompts
                | Behaviour::FastSlowPods
                | Behaviour::Drifting
        )
    }

    /// Whether a processor configuration is run against this gateway: the fixed limit and
    /// the plain gradient only at the first five; the others compare the default with the
    /// reference.
    fn runs(self, candidate: Candidate) -> bool {
        !self.small() || matches!(candidate.algorithm, "aimd" | "work")
    }

    fn label(self) -> &'static str {
        match self {
            Behaviour::Hard => "(a) hard limit, fixed 20 ms",
            Behaviour::Lengths => "(b) hard limit, lognormal lengths",
            Behaviour::Tail => "(c) hard limit, lognormal lengths, 1 % 20× longer",
            Behaviour::Changing => "(d) changing limit, lognormal lengths",
            Behaviour::ModelServer => "(e) model server, lognormal lengths",
            Behaviour::UnseenLognormal => {
                "(f) 16 at once, 50 ms × lognormal the usage does not show"
            }
            Behaviour::UnseenTwoKinds => "(g) 16 at once, 20 or 400 ms, the same usage",
            Behaviour::UnseenTail => "(h) 16 at once, 50 ms, 10 % 10× longer, the same usage",
            Behaviour::Full503 => "(i) 16 at once, fixed 50 ms, 503 when full",
            Behaviour::MixedPrompts => "(j) 16 at once, prompts of mixed lengths",
            Behaviour::FastSlowPods => "(k) 16 at once, a fast and a slow pod behind one URL",
            Behaviour::Drifting => "(l) 50 ms, C drifting 16 → 8 → 16",
        }
    }

    fn plot(self) -> &'static str {
        match self {
            Behaviour::Hard => "aimd-limit.svg",
            Behaviour::Lengths => "aimd-limit-lengths.svg",
            Behaviour::Tail => "aimd-limit-tail.svg",
            Behaviour::Changing => "aimd-limit-changing.svg",
            Behaviour::ModelServer => "aimd-limit-model-server.svg",
            Behaviour::UnseenLognormal => "aimd-limit-unseen-lognormal.svg",
            Behaviour::UnseenTwoKinds => "aimd-limit-unseen-two-kinds.svg",
            Behaviour::UnseenTail => "aimd-limit-unseen-tail.svg",
            Behaviour::Full503 => "aimd-limit-503.svg",
            Behaviour::MixedPrompts => "aimd-limit-prompts.svg",
            Behaviour::FastSlowPods => "aimd-limit-pods.svg",
            Behaviour::Drifting => "aimd-limit-drifting.svg",
        }
    }

    /// The mean unloaded latency, to size the run.
    fn unloaded(self) -> Duration {
        match self {
            Behaviour::Hard => LATENCY,
            // 50 ms × e^(σ²/2)
            Behaviour::UnseenLognormal => SMALL_LATENCY.mul_f64((0.8f64 * 0.8 / 2.0).exp()),
            Behaviour::UnseenTwoKinds => Duration::from_millis(210),
            Behaviour::UnseenTail => SMALL_LATENCY.mul_f64(1.9),
            Behaviour::Full503 | Behaviour::Drifting => SMALL_LATENCY,
            // 20 ms + 0.25 ms × about 190 words, the prompts' mean (a median of 140 × e^(σ²/2)).
            Behaviour::MixedPrompts => Duration::from_micros(67_500),
            // Half on each pod when they fill evenly.
            Behaviour::FastSlowPods => SMALL_LATENCY.mul_f64((1.0 + SLOW_POD) / 2.0),
            _ => LENGTHS_LATENCY,
        }
    }

    /// Lines of the run: about as long as `aimd_lines` at the fixed-latency gateway (the
    /// gateways of 16, [`SMALL_RUN_FACTOR`] times as long).
    fn lines(self, aimd_lines: usize) -> usize {
        let longer = if self.small() { SMALL_RUN_FACTOR } else { 1.0 };
        let n = aimd_lines as f64 * LATENCY.as_secs_f64() / self.unloaded().as_secs_f64()
            * self.capacity() as f64
            / CAPACITY as f64
            * longer;
        // A multiple of 20, so 95 % of it is a whole number.
        ((n / 20.0).round() as usize).max(1) * 20
    }

    fn config(self, seed: u64) -> GatewayConfig {
        let hard = GatewayConfig {
            latency_fixed: LATENCY,
            capacity: Some(CAPACITY),
            retry_after_secs: 0,
            seed: Some(seed),
            ..GatewayConfig::default()
        };
        let lengths = GatewayConfig {
            latency_fixed: PROMPT,
            latency_per_token: PER_TOKEN,
            length_median: Some(LENGTH_MEDIAN),
            length_sigma: LENGTH_SIGMA,
            ..hard.clone()
        };
        match self {
            Behaviour::Hard => hard,
            Behaviour::Lengths | Behaviour::Changing => lengths,
            Behaviour::Tail => GatewayConfig {
                tail_share: TAIL_SHARE,
                tail_factor: TAIL_FACTOR,
                ..lengths
            },
            Behaviour::ModelServer => GatewayConfig {
                queue_limit: Some(QUEUE_LIMIT),
                batching: true,
                ..lengths
            },
            small => {
                let small_hard = GatewayConfig {
                    latency_fixed: SMALL_LATENCY,
                    capacity: Some(SMALL_CAPACITY),
                    ..hard
                };
                match small {
                    Behaviour::UnseenLognormal => GatewayConfig {
                        unseen: Unseen::Lognormal { sigma: 0.8 },
                        ..small_hard
                    },
                    Behaviour::UnseenTwoKinds => GatewayConfig {
                        latency_fixed: Duration::from_millis(20),
                        unseen: Unseen::TwoKinds { a: 1.0, b: 20.0 },
                        ..small_hard
                    },
                    Behaviour::UnseenTail => GatewayConfig {
                        unseen: Unseen::Tail {
                            share: 0.1,
                            factor: 10.0,
                        },
                        ..small_hard
                    },
                    Behaviour::MixedPrompts => GatewayConfig {
                        latency_fixed: MIXED_FIXED,
                        latency_per_prompt_token: PROMPT_WORD,
                        ..small_hard
                    },
                    Behaviour::FastSlowPods => GatewayConfig {
                        pod_factors: vec![1.0, SLOW_POD],
                        ..small_hard
                    },
                    Behaviour::Drifting => small_hard,
                    _ => GatewayConfig {
                        full_status: 503,
                        ..small_hard
                    },
                }
            }
        }
    }
}

/// A limiter configuration under test.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    algorithm: &'static str,
    /// Its rows carry the targets.
    targeted: bool,
}

impl Candidate {
    fn label(&self) -> String {
        match self.algorithm {
            "aimd" => "aimd, backoff_factor 0.5".to_owned(),
            FIXED => format!("no limiter, per_endpoint fixed at C = {CAPACITY}"),
            "work" => "work (default)".to_owned(),
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
            "concurrency:\n  global: {GLOBAL}\n  per_endpoint: {PER_ENDPOINT}\n  aimd:\n    algorithm: {}\n",
            self.algorithm
        )
    }
}

/// The baseline: the limit set by hand to the gateway's usual capacity, what a limiter that
/// knew C would get from this processor and machine.
const FIXED: &str = "fixed";

const CANDIDATES: [Candidate; 4] = [
    Candidate {
        algorithm: FIXED,
        targeted: false,
    },
    Candidate {
        algorithm: "aimd",
        targeted: false,
    },
    Candidate {
        algorithm: "gradient",
        targeted: false,
    },
    Candidate {
        algorithm: "work",
        targeted: true,
    },
];

/// What one run measured.
struct Run {
    /// Lines answered per second until [`MEASURED_SHARE`] of them were.
    throughput: f64,
    /// What the gateway could serve over that time, req/s: time-weighted C over the mean
    /// latency it served, or for the model server C over its mean unloaded latency (the knee).
    ceiling: f64,
    share_429: f64,
    /// Lines that ended failed (their retries spent on refusals) over all lines: a figure,
    /// not a fault of the run, as a limiter that keeps the gateway refusing may leave some.
    failed: f64,
    /// The model server's mean time per output token over its unloaded one.
    token_stretch: f64,
    mean_limit: f64,
    samples: Vec<AimdSample>,
}

/// When the changing gateway switches: C goes to 16 at the first instant, back to 64 at the
/// second. Scaled to the job so the quick run changes too.
fn phases(n: usize, latency: Duration) -> (f64, f64) {
    let full = n as f64 / (CAPACITY as f64 / latency.as_secs_f64());
    (0.3 * full, 0.6 * full)
}

/// The capacity of `behaviour` at `t` seconds.
fn capacity_at(behaviour: Behaviour, n: usize, t: f64) -> usize {
    match behaviour {
        Behaviour::Changing => {
            let (low, high) = phases(n, behaviour.unloaded());
            if t >= low && t < high {
                LOW_CAPACITY
            } else {
                CAPACITY
            }
        }
        Behaviour::Drifting => {
            // One period over the time the job takes at the drift's mean C.
            let (high, low) = (SMALL_CAPACITY as f64, DRIFT_LOW as f64);
            let period = n as f64 / ((high + low) / 2.0 / behaviour.unloaded().as_secs_f64());
            let middle = (high + low) / 2.0;
            let c = middle + (high - middle) * (std::f64::consts::TAU * t / period).cos();
            c.round() as usize
        }
        _ => behaviour.capacity(),
    }
}

/// C averaged over `[0, elapsed]` (in steps of a millisecond).
fn time_weighted_capacity(behaviour: Behaviour, n: usize, elapsed: f64) -> f64 {
    if !matches!(behaviour, Behaviour::Changing | Behaviour::Drifting) || elapsed <= 0.0 {
        return behaviour.capacity() as f64;
    }
    let steps = (elapsed * 1000.0).ceil().max(1.0) as usize;
    let dt = elapsed / steps as f64;
    let sum: f64 = (0..steps)
        .map(|i| capacity_at(behaviour, n, (i as f64 + 0.5) * dt) as f64)
        .sum();
    sum / steps as f64
}

pub(crate) async fn run(cx: Ctx<'_>, report: &mut Report) -> Result<(), BenchError> {
    let Ctx { lab, s, progress } = cx;
    let n = s.aimd_lines;
    let only = std::env::var("BENCH_AIMD_ONLY").ok();
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
        let lines_here = behaviour.lines(n);
        let input = if behaviour == Behaviour::MixedPrompts {
            let input = lab.path(&format!("aimd-mixed-{lines_here}.jsonl"));
            write_mixed_input(&input, lines_here, MIXED_MEDIAN_BYTES, MIXED_SIGMA)?;
            input
        } else {
            let input = lab.path(&format!("aimd-{lines_here}.jsonl"));
            write_input(&input, lines_here, 1024)?;
            input
        };
        for candidate in CANDIDATES {
            if !behaviour.runs(candidate) {
                continue;
            }
            let label = format!("{}, {}", behaviour.label(), candidate.label());
            if only
                .as_ref()
                .is_some_and(|text| !label.contains(text.as_str()))
            {
                continue;
            }
            let mut runs = Vec::new();
            for run in 0..s.long_runs {
                let r = one_run(lab, &input, lines_here, behaviour, candidate, run).await?;
                progress(&format!(
                    "   {}, {}, run {run}: {:.0} req/s ({:.0} % of {:.0}), refusals {:.1} % of requests, time per token × {:.2}, mean limit {:.1}",
                    behaviour.label(),
                    candidate.label(),
                    r.throughput,
                    r.throughput / r.ceiling * 100.0,
                    r.ceiling,
                    r.share_429 * 100.0,
                    r.token_stretch,
                    r.mean_limit
                ));
                runs.push(r);
            }
            record(report, behaviour, candidate, lines_here, &mut runs);
        }
    }
    report.note(AIMD, format!(
        "The simulated gateway (tools/gateway-sim) in five shapes, each answering 429 (`Retry-After: 0`) past its limit: **(a)** at most C = {CAPACITY} at once, every answer L = {} ms; **(b)** the same C, an answer taking {} ms + {} ms per output token, its length drawn per request from a lognormal of median {LENGTH_MEDIAN} tokens and sigma {LENGTH_SIGMA} (seeded, whatever the request's `max_tokens`, reported in `usage.completion_tokens`); **(c)** as (b), {:.0} % of the answers {TAIL_FACTOR:.0} × longer; **(d)** as (b), C going {CAPACITY} → {LOW_CAPACITY} → {CAPACITY} at 30 % and 60 % of the time the job takes at C; **(e)** a model server with (b)'s answers: past C = {CAPACITY} running, the time per output token grows by running / C (re-read every 16 tokens: continuous batching), and only past Q = {QUEUE_LIMIT} the answer is 429.",
        LATENCY.as_millis(), PROMPT.as_millis(), PER_TOKEN.as_millis(), TAIL_SHARE * 100.0
    ));
    report.note(AIMD, format!(
        "Four more gateways admit {SMALL_CAPACITY} at once (429 above, `Retry-After: 0`) and vary each request's latency for a reason its `usage` does not show (every answer reports the same `completion_tokens`, as with prompts of different lengths, prefix-cache misses or pods of different speeds): **(f)** {} ms × a lognormal factor of sigma 0.8; **(g)** two kinds of request, 20 ms and 400 ms, half each; **(h)** {} ms, 10 % of the requests 10 × longer; **(i)** a fixed {} ms, and 503 instead of 429 when full. Their runs last {SMALL_RUN_FACTOR:.0} times as long as the others' (a noisy latency takes more answers to measure), and they compare the default `work` with the reference `aimd`.",
        SMALL_LATENCY.as_millis(), SMALL_LATENCY.as_millis(), SMALL_LATENCY.as_millis()
    ));
    report.note(AIMD, format!(
        "Three more, of 16 at once too, vary latency in the ways a pool does: **(j)** prompts of mixed lengths, {} ms + {} µs per prompt word, the lines' sizes lognormal (median {MIXED_MEDIAN_BYTES} bytes, sigma {MIXED_SIGMA}): each answer's `usage.prompt_tokens` says why, its `completion_tokens` is the same for all; **(k)** a fast pod ({} ms) and a slow one ({} ms) behind one URL, each request on the least busy; **(l)** {} ms, C drifting slowly from {SMALL_CAPACITY} down to {DRIFT_LOW} and back, a cosine over the time the job takes at C = {}.",
        MIXED_FIXED.as_millis(), PROMPT_WORD.as_micros(), SMALL_LATENCY.as_millis(),
        SMALL_LATENCY.mul_f64(SLOW_POD).as_millis(), SMALL_LATENCY.as_millis(),
        (SMALL_CAPACITY + DRIFT_LOW) / 2
    ));
    report.note(AIMD, format!(
        "Each throughput is the job's lines answered per second until {:.0} % of them were (the last answers of a job drain at a falling concurrency whatever the limiter, for as long as its longest answer takes: with (c)'s tail, seconds). The limit it is compared with is C / the mean latency the gateway itself served in that run (time-weighted C for (d)), of the run with the median throughput; for (e), C / the mean unloaded latency of its answers: the throughput at the knee. (e) also reports the gateway's mean time per output token over its unloaded value ({} ms), target ≤ 1.25.",
        MEASURED_SHARE * 100.0, PER_TOKEN.as_millis()
    ));
    report.note(AIMD, format!(
        "The processor runs in sync mode with `per_endpoint: {PER_ENDPOINT}` (above C, so the limiter must find C), `global: {GLOBAL}`, `aimd.min: 5`, `max_retries: 1000`, `initial_backoff: 1ms`, `max_backoff: 20ms`; requests are 1 KiB lines ({} for (a), {} for the others, about the same time at C). `aimd` is the reference processor's limiter (starts at `per_endpoint`, halves once per overload episode, a request keeps its permit while it retries); `gradient` is crates/limiter's `GradientLimiter` on raw latency (starts at `aimd.min` and doubles; latency floor; a 429 cuts to the concurrency that was refused; hears every attempt; a request gives its permit back while it backs off); `work`, the default, is the same rules on latency per unit of work (each answer's `completion_tokens` plus the fixed cost of an answer, learnt by a running fit; tolerance 1.15, two queued windows in a row before a cut on latency). The targets apply to `work`.",
        lines(n), lines(Behaviour::Lengths.lines(n))
    ));
    report.note(AIMD, format!(
        "What a client on this machine can get from the hard-limit gateway at all: the bare HTTP client row is {CAPACITY} callers in the bench process, each POSTing the job's first request body again the moment its last answer came, over keep-alive HTTP/1 (hyper, no processor, no limiter, no 429), {:.0} req/s median, {:.0} % of C/L. It loses to C/L what every request's round trip outside the gateway's {} ms takes: all {CAPACITY} answers of a wave come within microseconds of each other and wait for the CPU, client and gateway sharing the 2 cores.",
        bare.median(),
        bare.median() / (CAPACITY as f64 / LATENCY.as_secs_f64()) * 100.0,
        LATENCY.as_millis()
    ));
    report.note(AIMD, "The 429 share counts the gateway's 429 responses (retries included) against the job's requests, as counted at the gateway. The mean limit is the time average of the endpoint's limit sampled every 10 ms; the plots show the run with the median throughput.");
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
    let gateway = simulator::gateway(Behaviour::Hard.config(0)).await?;
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
    let failed = Summary::new(runs.iter().map(|r| r.failed).collect());
    let limit = Summary::new(runs.iter().map(|r| r.mean_limit).collect());
    let stretch = Summary::new(runs.iter().map(|r| r.token_stretch).collect());
    let median = throughput.median_run();
    let c = behaviour.capacity();
    let ceiling = median.map_or(c as f64 / behaviour.unloaded().as_secs_f64(), |i| {
        runs[i].ceiling
    });
    let label = format!("{}, {}", behaviour.label(), candidate.label());
    let ceiling_name = match behaviour {
        Behaviour::Changing => {
            format!("time-weighted C / mean latency, C = {CAPACITY} → {LOW_CAPACITY} → {CAPACITY}")
        }
        Behaviour::Drifting => format!(
            "time-weighted C / mean latency, C = {SMALL_CAPACITY} → {DRIFT_LOW} → {SMALL_CAPACITY}"
        ),
        Behaviour::ModelServer => format!("knee: C / mean unloaded latency, C = {CAPACITY}"),
        _ => format!("C / mean latency, C = {c}"),
    };
    let row = |figure: &str, unit, value| Row::new(AIMD, format!("{label}: {figure}"), unit, value);
    let rate = format!("throughput, {} lines", lines(n));
    let mut rate_row =
        row(&rate, Unit::PerSecond("req/s"), throughput.clone()).limit(ceiling_name, ceiling);
    let refusals = if behaviour == Behaviour::Full503 {
        "503 responses / requests"
    } else {
        "429 responses / requests"
    };
    let mut share_row = row(refusals, Unit::Percent, share);
    let mut failed_row = row(
        "lines failed, retries spent on refusals / lines",
        Unit::Percent,
        failed,
    );
    if candidate.targeted {
        rate_row = rate_row.target(Target::RatioAtLeast(0.9));
        if behaviour != Behaviour::ModelServer {
            share_row = share_row.target(Target::AtMost(0.05));
        }
        failed_row = failed_row.target(Target::AtMost(0.0));
    }
    report.rows.push(rate_row);
    report.rows.push(share_row);
    report.rows.push(failed_row);
    if behaviour == Behaviour::ModelServer {
        let mut stretch_row = row(
            "mean time per output token / unloaded",
            Unit::Factor,
            stretch,
        );
        if candidate.targeted {
            stretch_row = stretch_row.target(Target::AtMost(1.25));
        }
        report.rows.push(stretch_row);
    }
    report.rows.push(row("mean limit", Unit::Count, limit));
    if let Some(i) = median {
        report.aimd.push(AimdTrace {
            label,
            plot: behaviour.plot().to_owned(),
            capacity: c,
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
    let gateway = simulator::gateway(behaviour.config(run as u64 + 1)).await?;
    let config = lab.sync_config(
        "aimd.yaml",
        &gateway.base_url(),
        "    max_retries: 1000\n    initial_backoff: 1ms\n    max_backoff: 20ms\n    request_timeout: 30s\n",
        &candidate.concurrency(),
    )?;
    let executor = Executor::new(load(&config)?).await?;
    let out = lab.fresh_dir(&format!(
        "aimd-{:?}-{}-{run}",
        behaviour, candidate.algorithm
    ))?;
    let mut samples = Vec::new();
    let mut capacity = behaviour.capacity();
    // The gateway's counters when MEASURED_SHARE of the lines had been answered, and when.
    let mut measured: Option<(f64, GatewayStats)> = None;
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
                let limit = executor.mode::<batch_executor::SyncMode>().and_then(|m| m.endpoint_limit(MODEL)).unwrap_or(0);
                let stats = gateway.stats();
                if measured.is_none() && stats.answered as f64 >= n as f64 * MEASURED_SHARE {
                    measured = Some((t, stats.clone()));
                }
                samples.push(AimdSample { t, limit, in_flight: stats.in_flight, capacity });
            }
        }
    };
    let elapsed = start.elapsed().as_secs_f64();
    // Every line ends answered or failed; failed ones are reported beside the refusals (a
    // baseline limiter that lost 3 of 1,900 lines to 1,000 refusals each used to abort the
    // whole scenario, leaving the shapes after it without rows).
    let counts = batch.request_counts;
    if batch.status != batch_wire::BatchStatus::Completed
        || counts.completed + counts.failed != n as u64
    {
        return Err(BenchError::Check(format!(
            "job {} ended {} with {} answered and {} failed of {n} lines",
            batch.id,
            batch.status.as_str(),
            counts.completed,
            counts.failed
        )));
    }
    let stats = gateway.stats();
    gateway.shutdown().await;
    let (until, at) = measured.unwrap_or((elapsed, stats.clone()));
    let mean_limit =
        samples.iter().map(|s| s.limit as f64).sum::<f64>() / samples.len().max(1) as f64;
    let secs = |d: Option<Duration>| d.map_or(f64::NAN, |d| d.as_secs_f64());
    let mean_capacity = time_weighted_capacity(behaviour, n, until);
    let ceiling = if behaviour == Behaviour::ModelServer {
        CAPACITY as f64 / secs(at.mean_unloaded_latency())
    } else {
        mean_capacity / secs(at.mean_latency())
    };
    let token_stretch = if behaviour == Behaviour::Hard || behaviour.small() {
        1.0
    } else {
        secs(stats.mean_token_time()) / PER_TOKEN.as_secs_f64()
    };
    Ok(Run {
        throughput: at.answered as f64 / until,
        ceiling,
        // A gateway that says it is full with 503 is refused as with 429.
        share_429: (stats.responses(429) + stats.responses(503)) as f64 / n as f64,
        failed: counts.failed as f64 / n as f64,
        token_stretch,
        mean_limit,
        samples,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_changing_capacity_is_weighted_by_time() {
        let n = 20_000; // 6.25 s at C/L: 16 from 1.875 s to 3.75 s
        let b = Behaviour::Changing;
        let (low, high) = phases(n, b.unloaded());
        assert!((high - 2.0 * low).abs() < 1e-9);
        assert_eq!(time_weighted_capacity(Behaviour::Hard, n, 10.0), 64.0);
        assert_eq!(time_weighted_capacity(b, n, low), 64.0);
        let at = high + 1.0;
        let expected = (64.0 * (at - (high - low)) + 16.0 * (high - low)) / at;
        // Summed in steps of a millisecond: the switches fall within one.
        assert!((time_weighted_capacity(b, n, at) - expected).abs() < 0.05);
        assert_eq!(capacity_at(b, n, (low + high) / 2.0), LOW_CAPACITY);
        assert_eq!(capacity_at(b, n, high), CAPACITY);
        assert_eq!(capacity_at(Behaviour::ModelServer, n, low), CAPACITY);
    }

    #[test]
    fn the_drift_goes_to_8_and_back_over_the_run() {
        let b = Behaviour::Drifting;
        let n = 2_400; // 10 s at C = 12 of 50 ms
        assert_eq!(capacity_at(b, n, 0.0), 16);
        assert_eq!(capacity_at(b, n, 5.0), 8);
        assert_eq!(capacity_at(b, n, 2.5), 12);
        assert_eq!(capacity_at(b, n, 10.0), 16);
        // A cosine's mean over its period is its middle.
        assert!((time_weighted_capacity(b, n, 10.0) - 12.0).abs() < 0.05);
    }

    #[test]
    fn runs_take_about_as_long_at_each_gateway() {
        assert_eq!(Behaviour::Hard.lines(20_000), 20_000);
        assert_eq!(Behaviour::Lengths.lines(20_000), 6_140);
        assert_eq!(Behaviour::Tail.lines(1_000) % 20, 0);
        // 16 at once: four times as long as the others, at its own rate (210 ms; 50 ms).
        assert_eq!(Behaviour::UnseenTwoKinds.lines(20_000), 1_900);
        assert_eq!(Behaviour::Full503.lines(20_000), 8_000);
    }
}
