//! The prefix cache: one job whose system prompts are shuffled through the input, through the
//! simulator and a gateway with an LRU of prompt prefixes, its members scored in plan order
//! (as this processor does) or all at the deadline (as the original processor does).

use std::path::Path;
use std::time::{Duration, Instant};

use batch_executor::Executor;
use batch_producer::{JobMessages, Producer, ProducerOptions};
use dispatcher_sim::GatewayConfig;
use fred::interfaces::ListInterface;
use tokio_util::sync::CancellationToken;

use super::simulator::Simulator;
use super::{
    async_config, blocking, expect_completed, lines, plan, ready, spec, with_executor, Ctx,
};
use crate::inputs::{write_prefix_input, POOL};
use crate::report::{Kind, Report, Row, Unit};
use crate::stats::Summary;
use crate::BenchError;

const PREFIX: &str = "Prefix cache";

/// Every reply's latency; a prefix miss adds [`crate::Settings::prefix_miss_latency`].
const BASE_LATENCY: Duration = Duration::from_millis(5);

/// The dispatcher's HTTP workers: a miss costs the job time only while workers wait on it.
const WORKERS: usize = 64;

/// One run: seconds and the gateway's prefix-cache counts.
struct Measured {
    secs: f64,
    hits: u64,
    misses: u64,
}

impl Measured {
    fn hit_rate(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }
}

/// Runs `f` (its seconds) against a fresh gateway (empty prefix caches) and dispatcher, and
/// reads the gateway's prefix-cache counts.
async fn measure(
    cx: Ctx<'_>,
    f: impl AsyncFnOnce() -> Result<f64, BenchError>,
) -> Result<Measured, BenchError> {
    let gateway = GatewayConfig {
        latency_fixed: BASE_LATENCY,
        prefix_cache_size: cx.s.prefix_cache,
        prefix_miss_latency: cx.s.prefix_miss_latency,
        ..GatewayConfig::default()
    };
    let sim = Simulator::with(cx.lab, gateway, 1_000, WORKERS).await?;
    let secs = f().await;
    let stats = sim.gateway.stats();
    sim.stop().await;
    Ok(Measured {
        secs: secs?,
        hits: stats.prefix_cache_hits,
        misses: stats.prefix_cache_misses,
    })
}

pub(crate) async fn run(cx: Ctx<'_>, report: &mut Report) -> Result<(), BenchError> {
    let Ctx { lab, s, progress } = cx;
    let (n, prompts) = (s.prefix_lines, s.prefix_prompts);
    let input = lab.path("prefix.jsonl");
    write_prefix_input(&input, n, prompts, s.request_bytes)?;
    let queue = batch_keys::request_queue_name(POOL)?;
    let result_queue = format!("{}:producer", batch_keys::result_queue_name(POOL)?);
    let messages = super::job_messages("batch_prefix", queue.clone(), result_queue);

    // The same members both ways; only the scores differ. Positions come from the real plan.
    let (members, positions) = {
        let (input, dir) = (input.clone(), lab.fresh_dir("prefix-plan")?);
        blocking(move || {
            let plan = plan(&input, &dir)?;
            let mut positions = vec![0u64; n];
            for (position, record) in plan.records(&plan.models()[0])?.enumerate() {
                let record = record.map_err(|e| BenchError::io(&dir, e))?;
                positions[record.line as usize] = position as u64;
            }
            let text = std::fs::read_to_string(&input).map_err(|e| BenchError::io(&input, e))?;
            Ok((text, positions))
        })
        .await?
    };
    let members = super::members(&messages, &members)?;
    let plan_ordered: Vec<(f64, String)> = members
        .iter()
        .zip(&positions)
        .map(|(m, &p)| (messages.score_at(p), m.clone()))
        .collect();
    let equal: Vec<(f64, String)> = members.into_iter().map(|m| (messages.score(), m)).collect();

    let (mut ordered_runs, mut equal_runs) = (Vec::new(), Vec::new());
    for run in 0..s.long_runs {
        for (name, scored, runs) in [
            ("plan-ordered", &plan_ordered, &mut ordered_runs),
            ("equal", &equal, &mut equal_runs),
        ] {
            let m = producer_run(cx, &messages, scored.clone()).await?;
            progress(&format!(
                "   run {run}, {name} scores: {} lines in {:.2} s, prefix-cache hit rate {:.1} %",
                lines(n),
                m.secs,
                m.hit_rate() * 100.0
            ));
            runs.push(m);
        }
    }
    lab.flush_redis().await?;
    let executor_runs = with_executor(async_config(lab, "prefix")?, async |executor| {
        executor_runs(cx, executor, &input).await
    })
    .await?;

    let col = |runs: &[Measured], f: &dyn Fn(&Measured) -> f64| {
        Summary::new(runs.iter().map(f).collect())
    };
    let miss = format!("{} ms", s.prefix_miss_latency.as_millis());
    report.rows.push(Row::new(
        PREFIX,
        "plan-ordered scores (this processor): hit rate",
        Unit::Percent,
        col(&ordered_runs, &|m| m.hit_rate()),
    ));
    report.rows.push(
        Row::new(
            PREFIX,
            "equal scores (the original processor): hit rate",
            Unit::Percent,
            col(&equal_runs, &|m| m.hit_rate()),
        )
        .kind(Kind::Baseline),
    );
    report.rows.push(Row::new(
        PREFIX,
        format!("plan-ordered scores: first ZADD → last result, miss +{miss}"),
        Unit::Seconds,
        col(&ordered_runs, &|m| m.secs),
    ));
    report.rows.push(
        Row::new(
            PREFIX,
            format!("equal scores: first ZADD → last result, miss +{miss}"),
            Unit::Seconds,
            col(&equal_runs, &|m| m.secs),
        )
        .kind(Kind::Baseline),
    );
    report.rows.push(Row::new(
        PREFIX,
        "equal-score time / plan-ordered time",
        Unit::Factor,
        Summary::new(
            equal_runs
                .iter()
                .zip(&ordered_runs)
                .map(|(e, o)| e.secs / o.secs)
                .collect(),
        ),
    ));
    report.rows.push(Row::new(
        PREFIX,
        format!("executor, {} lines: whole job", lines(n)),
        Unit::Seconds,
        col(&executor_runs, &|m| m.secs),
    ));
    report.rows.push(Row::new(
        PREFIX,
        "executor: hit rate",
        Unit::Percent,
        col(&executor_runs, &|m| m.hit_rate()),
    ));
    let ideal = 1.0 - prompts as f64 / n as f64;
    report.note(PREFIX, format!(
        "{} lines of {} B whose {} system prompts (about 300 B each) are shuffled through the input, through the dispatcher simulator ({WORKERS} HTTP workers, polls every 10 ms) and a gateway keeping an LRU of {} prompt prefixes per endpoint; every reply takes {} ms, a prefix miss {miss} more. A fresh gateway (empty caches) for every run.",
        lines(n), s.request_bytes, prompts, s.prefix_cache, BASE_LATENCY.as_millis()
    ));
    report.note(PREFIX, format!(
        "The same members are ZADDed by the producer either at `deadline + position/2^21` with the position in the job's plan (lines sorted by system-prompt hash) or all at the deadline, as the original processor scores them; the dispatcher takes equal scores in member order, which for our members (they start with a hashed token) is random. Timed from the first ZADD until the dispatcher had pushed the last result. Best possible hit rate: one miss per prompt, {:.1} %; an LRU of {} under random order of {} prompts: about {:.0} %.",
        ideal * 100.0, s.prefix_cache, prompts, s.prefix_cache as f64 / prompts as f64 * 100.0
    ));
    report.note(PREFIX, "The executor rows run the job through the processor itself (plan, enqueue, results written to its files), to show the real path gets the plan-ordered hit rate.");
    Ok(())
}

/// ZADDs `scored` into an empty Redis with a fresh simulator and waits for every result.
async fn producer_run(
    cx: Ctx<'_>,
    messages: &JobMessages,
    scored: Vec<(f64, String)>,
) -> Result<Measured, BenchError> {
    let lab = cx.lab;
    let n = scored.len() as u64;
    lab.flush_redis().await?;
    let producer = Producer::new(lab.client().clone(), ProducerOptions::default());
    measure(cx, async || {
        let start = Instant::now();
        producer
            .enqueue_scored(&messages.request_queue, scored)
            .await?;
        let limit = Duration::from_secs(600);
        loop {
            let pushed: u64 = lab.client().llen(&messages.result_queue).await?;
            if pushed >= n {
                return Ok(start.elapsed().as_secs_f64());
            }
            if start.elapsed() > limit {
                return Err(BenchError::Check(format!(
                    "prefix: {pushed} of {n} results after {limit:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
}

/// The job through `executor`, a fresh simulator per run.
async fn executor_runs(
    cx: Ctx<'_>,
    executor: &Executor,
    input: &Path,
) -> Result<Vec<Measured>, BenchError> {
    let Ctx { lab, s, progress } = cx;
    let mut out = Vec::new();
    for run in 0..s.long_runs {
        let m = measure(cx, async || {
            let dir = lab.fresh_dir(&format!("prefix-{run}"))?;
            let start = Instant::now();
            let job = ready(executor, &spec(input, &dir, None)).await?;
            let batch = executor.execute(job, CancellationToken::new()).await;
            let secs = start.elapsed().as_secs_f64();
            expect_completed(&batch?, s.prefix_lines)?;
            Ok(secs)
        })
        .await?;
        progress(&format!(
            "   run {run}, executor: {} lines in {:.2} s, prefix-cache hit rate {:.1} %",
            lines(s.prefix_lines),
            m.secs,
            m.hit_rate() * 100.0
        ));
        out.push(m);
    }
    Ok(out)
}
