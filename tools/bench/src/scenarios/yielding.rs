//! A batch beside online traffic on one model server that schedules as vLLM does (the gateway
//! simulator's vLLM mode): what the online requests' latency becomes while the batch runs, and
//! how much of the capacity the online traffic leaves the batch gets, for sync mode without
//! `load`, with it at several headrooms, with a server that schedules by priority, and for async
//! mode through the dispatcher simulator configured as `processor queues` prints it; with short
//! answers of one length at several online loads and in waves, and (full run) with answers of
//! seconds whose lengths vary as LLM answers' do.
//! `BENCH_YIELD_ONLY=TEXT` runs only the cases whose label, after their traffic's (`answers of
//! seconds (…), online at 50 % of capacity: sync, default limiter`), contains TEXT (and online
//! alone beside them).

use std::sync::Arc;
use std::time::{Duration, Instant};

use batch_executor::Executor;
use bytes::Bytes;
use dispatcher_sim::{Dispatcher, DispatcherConfig, GatewayConfig, GatewayHandle, TransportConfig};
use tokio_util::sync::CancellationToken;

use super::{ready, resolved, simulator, spec, Ctx, Progress};
use crate::inputs::{request_line, write_input};
use crate::lab::{load, Lab};
use crate::online::{self, OnlineLoad, OnlineRun};
use crate::report::{Kind, Report, Row, Target, Timeline, Unit};
use crate::service::Api;
use crate::stats::Summary;
use crate::BenchError;

const YIELD: &str = "Yield";
/// The server: the first token after `TTFT`, each next one `PER_TOKEN` later, `ITL_GROWTH`
/// slower with the batch full; how many run at once and how long answers are is its
/// [`Server`].
const TTFT: Duration = Duration::from_millis(100);
const PER_TOKEN: Duration = Duration::from_millis(20);
const ITL_GROWTH: f64 = 0.25;
/// Every answer has the input's 16 tokens (0.4 s), 16 run at once.
const SHORT: Server = Server {
    seqs: 16,
    lengths: None,
};
/// Answers of seconds, as LLM answers are, their length not known before: lognormal, median
/// 200 tokens (4.1 s), σ 0.7 (one in twenty past 630 tokens, 13 s), 64 run at once.
const LONG: Server = Server {
    seqs: 64,
    lengths: Some((200, 0.7)),
};
/// With [`LONG`] answers: online requests are sent this long, after the batch ran this long.
/// A batch that has just filled its slots answers its short requests first while its long ones
/// run on; after 20 s (past the longest answers' 13 s) its slots hold answers of every length,
/// as they will from then on. Its rate is counted from [`Server::settle`] after the online
/// traffic starts until the last online send.
const LONG_SPAN: Duration = Duration::from_secs(40);
const LONG_LEAD: Duration = Duration::from_secs(20);
/// Waves: this long at the server's capacity, then as long at a tenth of it (shorter with
/// `--quick`, so its short run still has bursts and quiet periods).
const WAVE: Duration = Duration::from_secs(5);
const QUICK_WAVE: Duration = Duration::from_secs(1);
/// The batch's priority when the server schedules by it (online requests have 0).
const BATCH_PRIORITY: i64 = 10;
/// Batch jobs run side by side in each case.
const JOBS: usize = 3;
/// The batch runs this long before the online traffic starts (shorter with `--quick`).
const BATCH_LEAD: Duration = Duration::from_secs(3);
const QUICK_BATCH_LEAD: Duration = Duration::from_secs(1);
/// How often each job's progress and the online latency are sampled for the plots.
const SAMPLE: Duration = Duration::from_millis(500);

/// How the online traffic arrives.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Shape {
    /// Poisson arrivals at this share of the capacity.
    Steady(f64),
    /// Poisson arrivals at the capacity for this long, then as long at a tenth of it, and
    /// again.
    Waves(Duration),
}

impl Shape {
    fn label(self) -> String {
        match self {
            Shape::Steady(share) => format!("online at {:.0} % of capacity", share * 100.0),
            Shape::Waves(wave) => format!(
                "online in waves ({} s at capacity, {} s at 10 %)",
                wave.as_secs(),
                wave.as_secs()
            ),
        }
    }

    /// The load generator's shape, with the server's capacity `c` in answers per second.
    fn online(self, c: f64) -> online::Shape {
        match self {
            Shape::Steady(share) => online::Shape::Steady { rate: c * share },
            Shape::Waves(wave) => online::Shape::Waves {
                burst: c,
                quiet: c * 0.1,
                wave,
            },
        }
    }

    /// The file of its plot over time.
    fn plot(self) -> String {
        match self {
            Shape::Steady(share) => format!("steady-{:.0}.svg", share * 100.0),
            Shape::Waves(_) => "waves.svg".into(),
        }
    }
}

/// The model server of a group of cases: how many requests run at once, and how long answers
/// are.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Server {
    /// `max_num_seqs`.
    seqs: usize,
    /// Answer lengths drawn per request from a lognormal: (median tokens, sigma); `None`:
    /// every answer has the input's 16 tokens.
    lengths: Option<(u64, f64)>,
}

impl Server {
    /// What leads its cases' labels: nothing for [`SHORT`] answers.
    fn label(self) -> String {
        match self.lengths {
            None => String::new(),
            Some((median, sigma)) => format!(
                "answers of seconds (median {median} tokens, σ {sigma}, {} at once), ",
                self.seqs
            ),
        }
    }

    /// How long after the online traffic starts the batch's rate is counted from: the batch
    /// holds more of the server than its share when online requests begin, and those of its
    /// answers ending in the first seconds, not replaced, would count as a rate it cannot keep.
    /// A short answer's time is negligible; with answers of seconds, about the longest ones
    /// (one in twenty past 13 s): counted from the start, the share read 111-121 %.
    fn settle(self) -> Duration {
        if self.lengths.is_some() {
            Duration::from_secs(10)
        } else {
            Duration::ZERO
        }
    }

    /// What leads its plots' file names.
    fn plot_prefix(self) -> &'static str {
        if self.lengths.is_some() {
            "yield-long-"
        } else {
            "yield-"
        }
    }

    /// The simulator's configuration, scheduling by priority or in arrival order.
    fn config(self, priority_scheduling: bool) -> GatewayConfig {
        GatewayConfig {
            latency_fixed: TTFT,
            latency_per_token: PER_TOKEN,
            max_num_seqs: Some(self.seqs),
            itl_growth: ITL_GROWTH,
            priority_scheduling,
            length_median: self.lengths.map(|(median, _)| median),
            length_sigma: self.lengths.map_or(0.0, |(_, sigma)| sigma),
            seed: Some(40),
            ..GatewayConfig::default()
        }
    }
}

/// A processor configuration beside the online traffic.
#[derive(Debug, Clone, Copy)]
struct Case {
    /// Async mode: the dispatcher (simulator) runs with what `processor queues` prints for
    /// `async_dispatch.dispatcher` with `max_num_seqs` the server's and `headroom` this one.
    dispatcher_headroom: Option<f64>,
    /// Async mode: the config names the server's metrics page (`metrics_urls`), so the printed
    /// gate reads it itself (`endpoint-scrape`) instead of through Prometheus.
    dispatcher_pages: bool,
    /// With `dispatcher_pages`: `waiting_gate: false` (the gate reads running requests only).
    no_waiting_gate: bool,
    /// `load.headroom`, or no `load` section.
    headroom: Option<f64>,
    /// The server schedules by priority and the batch sends [`BATCH_PRIORITY`].
    priority: bool,
    /// Its rows carry the targets.
    targeted: bool,
    /// `load.interval` in milliseconds, when not the default.
    interval_ms: Option<u64>,
}

impl Case {
    fn label(self) -> String {
        let interval = self
            .interval_ms
            .map_or(String::new(), |ms| format!(", every {ms} ms"));
        if let Some(h) = self.dispatcher_headroom {
            return match (self.dispatcher_pages, self.no_waiting_gate) {
                (false, _) => format!("async, printed config, Prometheus gate (headroom {h})"),
                (true, false) => {
                    format!("async, printed config, gate reading the pod (headroom {h})")
                }
                (true, true) => format!(
                    "async, printed config, gate reading the pod, running only (headroom {h})"
                ),
            };
        }
        match (self.headroom, self.priority) {
            (None, _) => "sync, no load (work limiter)".to_owned(),
            (Some(h), false) => format!("sync, load (headroom {h}{interval})"),
            (Some(h), true) => format!("sync, load (headroom {h}{interval}) + priority"),
        }
    }
}

impl Case {
    /// `load` with `headroom`, read every `interval_ms` (the default when `None`).
    const fn load(headroom: f64, interval_ms: Option<u64>) -> Self {
        Case {
            dispatcher_headroom: None,
            dispatcher_pages: false,
            no_waiting_gate: false,
            headroom: Some(headroom),
            priority: false,
            targeted: false,
            interval_ms,
        }
    }

    /// Async mode, the dispatcher configured as printed with `headroom`.
    const fn dispatcher(headroom: f64) -> Self {
        Case {
            dispatcher_headroom: Some(headroom),
            headroom: None,
            ..Case::load(0.0, None)
        }
    }
}

const CASES: [Case; 14] = [
    Case {
        headroom: None,
        ..Case::load(0.0, None)
    },
    Case {
        targeted: true,
        ..Case::load(0.15, None)
    },
    Case::load(0.3, None),
    Case::load(0.0, None),
    Case::load(0.15, Some(250)),
    Case {
        priority: true,
        ..Case::load(0.15, None)
    },
    Case {
        targeted: true,
        ..Case::dispatcher(0.25)
    },
    Case::dispatcher(0.4),
    Case {
        targeted: true,
        dispatcher_pages: true,
        ..Case::dispatcher(0.25)
    },
    Case {
        dispatcher_pages: true,
        ..Case::dispatcher(0.15)
    },
    Case {
        dispatcher_pages: true,
        ..Case::dispatcher(0.4)
    },
    Case {
        dispatcher_pages: true,
        no_waiting_gate: true,
        ..Case::dispatcher(0.25)
    },
    // Between the defaults and the next settings up, where the frontier crosses the targets'
    // corner on the short answers (issue 40): last, so that the indices above stay.
    Case::load(0.2, None),
    Case {
        dispatcher_pages: true,
        ..Case::dispatcher(0.2)
    },
];

/// Cases run beside one shape of online traffic on one server.
struct Group {
    server: Server,
    shape: Shape,
    cases: Vec<Case>,
    /// How long online requests are sent, after the batch ran `lead`.
    span: Duration,
    lead: Duration,
}

pub(crate) async fn run(cx: Ctx<'_>, report: &mut Report) -> Result<(), BenchError> {
    let Ctx { lab, s, progress } = cx;
    let (span, lead) = if s.quick {
        (Duration::from_secs(4), QUICK_BATCH_LEAD)
    } else {
        (Duration::from_secs(20), BATCH_LEAD)
    };
    let make = |server, shape, cases: Vec<Case>| Group {
        server,
        shape,
        cases,
        span,
        lead,
    };
    let mut plan: Vec<Group> = if s.quick {
        vec![
            make(
                SHORT,
                Shape::Steady(0.5),
                vec![CASES[0], CASES[1], CASES[6], CASES[8]],
            ),
            make(SHORT, Shape::Waves(QUICK_WAVE), vec![CASES[1]]),
        ]
    } else {
        let mut plan: Vec<Group> = [
            Shape::Steady(0.25),
            Shape::Steady(0.5),
            Shape::Steady(0.75),
            Shape::Waves(WAVE),
        ]
        .map(|shape| make(SHORT, shape, CASES.to_vec()))
        .into();
        plan.push(Group {
            span: LONG_SPAN,
            lead: LONG_LEAD,
            ..make(
                LONG,
                Shape::Steady(0.5),
                vec![
                    CASES[0], CASES[1], CASES[12], CASES[5], CASES[6], CASES[8], CASES[13],
                ],
            )
        });
        plan
    };
    if let Ok(only) = std::env::var("BENCH_YIELD_ONLY") {
        for group in &mut plan {
            let traffic = traffic_label(group.server, group.shape);
            group
                .cases
                .retain(|c| format!("{traffic}: {}", c.label()).contains(&only));
        }
        plan.retain(|group| !group.cases.is_empty());
    }
    let body = online_body();
    let streamed = online::stream_body(
        serde_json::from_slice(&body).map_err(|e| BenchError::Check(e.to_string()))?,
    );
    // Each server's capacity and an input long enough for its cases, measured once.
    let mut measured: Vec<(Server, f64, std::path::PathBuf)> = Vec::new();
    for group in &plan {
        let known = measured.iter().find(|m| m.0 == group.server);
        let (capacity, input) = match known {
            Some((_, capacity, input)) => (*capacity, input.clone()),
            None => {
                let (capacity, input) = prepare(lab, group, &body, report, progress).await?;
                measured.push((group.server, capacity, input.clone()));
                (capacity, input)
            }
        };
        let traffic = Traffic {
            server: group.server,
            shape: group.shape,
            capacity,
            span: group.span,
            lead: group.lead,
            body: &streamed,
        };
        run_group(lab, &input, &group.cases, &traffic, report, progress).await?;
    }
    report.note(YIELD, format!(
        "One simulated model server in vLLM mode (tools/gateway-sim): 16 requests run at once (`max_num_seqs`), the rest wait in its queue in arrival order; an answer takes {} ms to its first token, then {} ms per token for its 16 tokens, up to {:.0} % slower per token with all running. Its capacity is measured first, in the same run, with as many callers as run at once keeping it exactly full (answers not streamed), counting the answers that came within the measure once the server was full (after 1 s; with answers of seconds 30 s after 20 s). With answers of seconds, the server runs 64 at once and each answer's length is drawn from a lognormal (median 200 tokens, σ 0.7: 4.1 s, one in twenty past 13 s), as LLM answers' lengths are neither alike nor known before; its online requests are sent for {} s after the batch ran {} s, its rows also give the online TTFT p95 against alone, and it carries the targets too. Online traffic is open-loop (Poisson arrivals; in waves, bursts at the capacity alternating with quiet periods at a tenth of it) and streamed (`stream: true` with the usage event; the server sends one event per token at its time): each request is timed from its send to its first token (TTFT), between its tokens (ITL, every gap pooled), per output token after the first (TPOT, (e2e − TTFT) / (tokens − 1)) and to its last event (e2e), {} s per phase after the batch has run {} s. The rows' online latency is the end-to-end one; the table of online figures gives p50 / p95 / p99 of each, the answers per second and the errors per phase (the whole run when steady; the bursts and the quiet periods apart in waves). The batch is {JOBS} jobs of the same 256-byte lines run side by side by one executor in sync mode with the default limits (`per_endpoint` 10, the `work` limiter) and, with `load`, `metrics_urls` on the server's `/metrics` and the headroom named; the batch's rate is the three jobs' lines resolved per second while the online requests are sent (not over their answers' tail after the last send, when the online load ebbs), from 10 s after the first with answers of seconds (the batch's answers started before, ending unreplaced, are not a rate it keeps), and the plots over time show each job's completed lines, sampled every {} ms, beside the online latency (p95 of the requests sent in each {} ms). The spare capacity is the measured capacity less the online rate; `+ priority` is a server scheduling by priority (`--scheduling-policy priority`) and the batch sending `load.priority: {BATCH_PRIORITY}`. In async mode the dispatcher simulator runs in the bench's process with exactly what `processor queues` prints for `async_dispatch.dispatcher` with the server's `max_num_seqs` and the headroom named (poll interval, batch size, workers, cache of the load readings, the gate and its parameters): the Prometheus gate reads the server's `vllm:num_requests_running` through the printed 1 s cache (standing in for Prometheus's scrape and the dispatcher's cache); the gate reading the pod is the printed `endpoint-scrape` gate on the server's page (running requests, and waiting ones unless `running only`), read at every poll. Targets (issue 40): at 50 % online load, online p95 within 1.2× of online alone while the batch gets at least 70 % of the spare capacity.",
        TTFT.as_millis(), PER_TOKEN.as_millis(), ITL_GROWTH * 100.0, LONG_SPAN.as_secs(), LONG_LEAD.as_secs(), span.as_secs(), lead.as_secs(), SAMPLE.as_millis(), SAMPLE.as_millis()
    ));
    Ok(())
}

/// Measures the capacity of `group`'s server (a row) and writes an input that outlasts its
/// cases: the capacity and the input's path.
async fn prepare(
    lab: &Lab,
    group: &Group,
    body: &Bytes,
    report: &mut Report,
    progress: Progress<'_>,
) -> Result<(f64, std::path::PathBuf), BenchError> {
    let server = group.server;
    let capacity = measure_capacity(server, group.span, body).await?;
    progress(&format!(
        "   {}the server alone, {} callers: {capacity:.1} answers/s",
        server.label(),
        server.seqs
    ));
    report.rows.push(
        Row::new(
            YIELD,
            format!(
                "{}the server's capacity: {} callers at once, answers/s",
                server.label(),
                server.seqs
            ),
            Unit::PerSecond("req/s"),
            Summary::one(capacity),
        )
        .kind(Kind::Limit),
    );
    let seconds = (group.lead + group.span).as_secs_f64() + 10.0;
    let n = (capacity * seconds * 2.0) as usize;
    let input = lab.path(&format!("{}input.jsonl", server.plot_prefix()));
    write_input(&input, n, 256)?;
    Ok((capacity, input))
}

/// One group's online traffic alone, then beside each of its cases' batch: their rows.
async fn run_group(
    lab: &Lab,
    input: &std::path::Path,
    cases: &[Case],
    traffic: &Traffic<'_>,
    report: &mut Report,
    progress: Progress<'_>,
) -> Result<(), BenchError> {
    let gateway = simulator::gateway(traffic.server.config(false)).await?;
    let alone = online(&gateway, traffic).await?;
    gateway.shutdown().await;
    let label = traffic.label();
    let alone_all = alone.overall();
    progress(&format!(
        "   {label}, alone: e2e p50 {:.0} ms, p95 {:.0} ms, p99 {:.0} ms, TTFT p95 {:.0} ms, {:.1} req/s",
        alone_all.e2e.p50 * 1e3,
        alone_all.e2e.p95 * 1e3,
        alone_all.e2e.p99 * 1e3,
        alone_all.ttft.p95 * 1e3,
        offered(&alone)
    ));
    for (q, name) in [
        (alone_all.e2e.p50, "p50"),
        (alone_all.e2e.p95, "p95"),
        (alone_all.e2e.p99, "p99"),
    ] {
        report.rows.push(
            Row::new(
                YIELD,
                format!("{label}, online alone: {name} latency"),
                Unit::Seconds,
                Summary::one(q),
            )
            .kind(Kind::Limit),
        );
    }
    report.online_lines(&format!("{label}, online alone"), &alone);
    for case in cases {
        let b = beside(lab, input, *case, traffic).await?;
        case_rows(report, progress, traffic, *case, &alone, b);
    }
    Ok(())
}

/// The rows, notes and plot of `case`'s batch `b` beside the online traffic, against the
/// traffic `alone`.
fn case_rows(
    report: &mut Report,
    progress: Progress<'_>,
    traffic: &Traffic<'_>,
    case: Case,
    alone: &OnlineRun,
    b: Beside,
) {
    let label = format!("{}, {}", traffic.label(), case.label());
    let (alone_all, with) = (alone.overall(), b.online.overall());
    let spare = (traffic.capacity - offered(alone)).max(1e-9);
    let share = b.batch_rate / spare;
    progress(&format!(
        "   {label}: online e2e p50 {:.0} ms, p95 {:.0} ms ({:.2}× alone), p99 {:.0} ms, TTFT p95 {:.0} ms ({:.2}× alone), ITL p95 {:.0} ms, {} errors; batch {:.1} req/s = {:.0} % of the spare {:.1}, lines completed by job: {}",
        with.e2e.p50 * 1e3,
        with.e2e.p95 * 1e3,
        with.e2e.p95 / alone_all.e2e.p95,
        with.e2e.p99 * 1e3,
        with.ttft.p95 * 1e3,
        with.ttft.p95 / alone_all.ttft.p95,
        with.itl.p95 * 1e3,
        with.errors,
        b.batch_rate,
        share * 100.0,
        spare,
        b.jobs
            .iter()
            .map(|j| j.last().map_or(0.0, |p| p.1).to_string())
            .collect::<Vec<_>>()
            .join(" / ")
    ));
    let figure = |what: &str| format!("{label}: {what}");
    let mut p95 = Row::new(
        YIELD,
        figure("online p95 / alone"),
        Unit::Factor,
        Summary::one(with.e2e.p95 / alone_all.e2e.p95),
    );
    let p99 = Row::new(
        YIELD,
        figure("online p99 / alone"),
        Unit::Factor,
        Summary::one(with.e2e.p99 / alone_all.e2e.p99),
    );
    let mut batch = Row::new(
        YIELD,
        figure("batch rate / spare capacity"),
        Unit::Percent,
        Summary::one(share),
    );
    if case.targeted && traffic.shape == Shape::Steady(0.5) {
        p95 = p95.target(Target::AtMost(1.2));
        batch = batch.target(Target::AtLeast(0.7));
    }
    report.rows.push(p95);
    report.rows.push(p99);
    if traffic.server.lengths.is_some() {
        // Answers of many lengths: the wait for the first token shows what end-to-end
        // latency, mostly the answer's own length, hides.
        report.rows.push(Row::new(
            YIELD,
            figure("online TTFT p95 / alone"),
            Unit::Factor,
            Summary::one(with.ttft.p95 / alone_all.ttft.p95),
        ));
    }
    report.rows.push(batch);
    report.online_lines(&label, &b.online);
    if with.errors > 0 {
        report.note(
            YIELD,
            format!(
                "{}: {} online requests failed ({}).",
                figure("errors"),
                with.errors,
                with.failures_text()
            ),
        );
    }
    if case.targeted {
        report.timelines.push(Timeline {
            label,
            plot: format!("{}{}", traffic.server.plot_prefix(), traffic.shape.plot()),
            online_from: traffic.lead.as_secs_f64(),
            jobs: b.jobs,
            latency: b.online.over_time(SAMPLE),
        });
    }
}

/// Requests per second the online traffic offered (sent, answered or not).
fn offered(run: &OnlineRun) -> f64 {
    run.answers.len() as f64 / run.duration.as_secs_f64()
}

/// An online request: the bench's own chat line, sent as is.
fn online_body() -> Bytes {
    let line: serde_json::Value =
        serde_json::from_str(&request_line(0, 256)).unwrap_or(serde_json::Value::Null);
    Bytes::from(line["body"].to_string())
}

/// Answers per second of `server` with exactly as many callers as it runs at once, each
/// sending again as its answer comes: those answered within the measure (8 s at most, within
/// `span`, after 1 s; 30 s after [`LONG_LEAD`] with answers of seconds, so that it holds many
/// of them and starts once the callers hold answers of every length),
/// over its length.
async fn measure_capacity(server: Server, span: Duration, body: &Bytes) -> Result<f64, BenchError> {
    let gateway = simulator::gateway(server.config(false)).await?;
    let api = Api::new(&gateway.base_url(), server.seqs);
    // Answers are counted once the callers have filled the server and its answers end at a
    // steady pace (all callers start at once, so the first answers come bunched), up to the
    // window's end: counting from the start and dropping the answers still coming at the end
    // read answers of seconds' capacity 18 % low.
    let (warm, window) = if server.lengths.is_some() {
        (LONG_LEAD, Duration::from_secs(30))
    } else {
        (Duration::from_secs(1), span.min(Duration::from_secs(8)))
    };
    let from = tokio::time::Instant::now() + warm;
    let until = from + window;
    let callers = (0..server.seqs).map(|_| {
        let (api, body) = (api.clone(), body.clone());
        async move {
            let mut n = 0usize;
            loop {
                let call = api.post_json_bytes("/v1/chat/completions", body.clone());
                let Ok(reply) = tokio::time::timeout_at(until, call).await else {
                    return Ok::<_, BenchError>(n);
                };
                if reply?.status == hyper::StatusCode::OK && tokio::time::Instant::now() >= from {
                    n += 1;
                }
            }
        }
    });
    let answered: usize = futures::future::try_join_all(callers)
        .await?
        .into_iter()
        .sum();
    gateway.shutdown().await;
    Ok(answered as f64 / window.as_secs_f64())
}

/// The online traffic of one phase, and how long the batch runs before it.
struct Traffic<'a> {
    /// The server it is sent to.
    server: Server,
    shape: Shape,
    /// The server's capacity, answers per second.
    capacity: f64,
    /// How long requests are sent for.
    span: Duration,
    /// How long the batch runs before the online traffic starts.
    lead: Duration,
    /// Each request's body, streamed.
    body: &'a Bytes,
}

impl Traffic<'_> {
    /// What leads its rows' figures: the server's answers, then the shape.
    fn label(&self) -> String {
        traffic_label(self.server, self.shape)
    }
}

/// What leads a traffic's rows' figures: the server's answers, then the shape.
fn traffic_label(server: Server, shape: Shape) -> String {
    format!("{}{}", server.label(), shape.label())
}

/// Sends the online `traffic` to `gateway`, waits for every answer.
async fn online(gateway: &GatewayHandle, traffic: &Traffic<'_>) -> Result<OnlineRun, BenchError> {
    online::run(&OnlineLoad {
        base_url: gateway.base_url(),
        body: traffic.body.clone(),
        shape: traffic.shape.online(traffic.capacity),
        duration: traffic.span,
        seed: 40,
        timeout: Duration::from_secs(60),
        // The simulated server draws the lengths itself.
        lengths: None,
    })
    .await
}

/// What a batch beside online traffic did.
struct Beside {
    /// The online traffic's figures.
    online: OnlineRun,
    /// The batch's lines resolved per second while online requests were sent, from
    /// [`Server::settle`] on.
    batch_rate: f64,
    /// Each job's completed lines over time: (seconds since the batch started, lines).
    jobs: Vec<Vec<(f64, f64)>>,
}

/// Runs the batch of `case` beside the online `traffic`.
async fn beside(
    lab: &Lab,
    input: &std::path::Path,
    case: Case,
    traffic: &Traffic<'_>,
) -> Result<Beside, BenchError> {
    if let Some(headroom) = case.dispatcher_headroom {
        return beside_dispatcher(lab, input, case, headroom, traffic).await;
    }
    let gateway = simulator::gateway(traffic.server.config(case.priority)).await?;
    let load_section = match case.headroom {
        None => String::new(),
        Some(headroom) => {
            let priority = if case.priority {
                format!("      priority: {BATCH_PRIORITY}\n")
            } else {
                String::new()
            };
            let interval = case
                .interval_ms
                .map_or(String::new(), |ms| format!("      interval: {ms}ms\n"));
            format!(
                "    load:\n      metrics_urls: [{}/metrics]\n      headroom: {headroom}\n{priority}{interval}",
                gateway.base_url()
            )
        }
    };
    let config = lab.sync_config("yield.yaml", &gateway.base_url(), &load_section, "")?;
    let executor = Executor::new(load(&config)?).await?;
    let measured = run_beside(lab, executor, input, &gateway, traffic).await;
    gateway.shutdown().await;
    measured
}

/// Async mode: the dispatcher simulator in front of the server, configured with exactly what
/// `processor queues` prints for a pool of the traffic's one server and `headroom` (its
/// gate reads the server's `vllm:num_requests_running` through its cache, as the real one reads
/// it through Prometheus), and the executor enqueueing the whole job at once.
async fn beside_dispatcher(
    lab: &Lab,
    input: &std::path::Path,
    case: Case,
    headroom: f64,
    traffic: &Traffic<'_>,
) -> Result<Beside, BenchError> {
    lab.flush_redis().await?;
    let gateway = simulator::gateway(traffic.server.config(false)).await?;
    let pages = if case.dispatcher_pages {
        format!(
            "    metrics_urls:\n      {}: [{}/metrics]\n    waiting_gate: {}\n",
            crate::inputs::POOL,
            gateway.base_url(),
            !case.no_waiting_gate
        )
    } else {
        String::new()
    };
    let path = lab.async_config_with(
        "yield-async.yaml",
        "yield",
        &format!(
            "  dispatcher:\n    max_num_seqs: {}\n    headroom: {headroom}\n{pages}",
            traffic.server.seqs
        ),
        "",
    )?;
    let config = load(&path)?;
    let queues = config.dispatcher_queues()?;
    let mut dispatcher = DispatcherConfig::new(lab.redis_url(), vec![]);
    TransportConfig::parse(&queues.transport_config().to_json())?.apply(&mut dispatcher);
    for queue in &mut dispatcher.queues {
        queue.igw_base_url = Some(gateway.base_url());
    }
    dispatcher.concurrency = queues.sizing.concurrency;
    dispatcher.prometheus_cache_ttl =
        batch_config::parse_duration(&queues.sizing.prometheus_cache_ttl)
            .map_err(BenchError::Check)?;
    let dispatcher = Dispatcher::start(dispatcher, None).await?;
    let executor = Executor::new(config).await?;
    let measured = run_beside(lab, executor, input, &gateway, traffic).await;
    dispatcher.shutdown().await;
    gateway.shutdown().await;
    lab.flush_redis().await?;
    measured
}

/// Runs [`JOBS`] jobs of `input` side by side with `executor` for the traffic's lead, then the
/// online `traffic` beside them; each job's progress is sampled every [`SAMPLE`].
async fn run_beside(
    lab: &Lab,
    executor: Executor,
    input: &std::path::Path,
    gateway: &GatewayHandle,
    traffic: &Traffic<'_>,
) -> Result<Beside, BenchError> {
    let executor = Arc::new(executor);
    let stop = CancellationToken::new();
    let mut progress = Vec::new();
    let mut executions = Vec::new();
    for k in 0..JOBS {
        let out = lab.fresh_dir(&format!("yield-out-{k}"))?;
        let job = ready(&executor, &spec(input, &out, None)).await?;
        progress.push(job.progress());
        let (executor, stop) = (executor.clone(), stop.clone());
        executions.push(tokio::spawn(
            async move { executor.execute(job, stop).await },
        ));
    }
    let batch_started = Instant::now();
    let sampler = {
        let (progress, stop) = (progress.clone(), stop.clone());
        tokio::spawn(async move {
            let mut jobs = vec![Vec::new(); progress.len()];
            let mut tick = tokio::time::interval(SAMPLE);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return jobs,
                    _ = tick.tick() => {}
                }
                let t = batch_started.elapsed().as_secs_f64();
                for (samples, p) in jobs.iter_mut().zip(&progress) {
                    samples.push((t, p.borrow().counts.completed as f64));
                }
            }
        })
    };
    let resolved_now = || progress.iter().map(|p| resolved(&p.borrow())).sum::<u64>();
    tokio::time::sleep(traffic.lead).await;
    let online_started = tokio::time::Instant::now();
    // The batch's rate while online requests are sent, once settled: not over the online
    // answers' tail after the last send, when the online load ebbs and the batch takes the
    // room it leaves (the spare capacity is counted at the offered online rate).
    let batch_rate = async {
        tokio::time::sleep(traffic.server.settle()).await;
        let (before, from) = (resolved_now(), Instant::now());
        tokio::time::sleep_until(online_started + traffic.span).await;
        (resolved_now() - before) as f64 / from.elapsed().as_secs_f64().max(1e-9)
    };
    let (online, batch_rate) = tokio::join!(online(gateway, traffic), batch_rate);
    stop.cancel();
    let jobs = sampler.await.unwrap_or_default();
    for execution in executions {
        let _ = execution.await;
    }
    if let Ok(executor) = Arc::try_unwrap(executor) {
        executor.shutdown().await;
    }
    Ok(Beside {
        online: online?,
        batch_rate,
        jobs,
    })
}
