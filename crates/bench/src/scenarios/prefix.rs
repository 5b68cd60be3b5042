//! The prefix cache: one job whose system prompts are shuffled through the input, through the
//! simulator and a gateway with an LRU of prompt prefixes, its members scored in plan order
//! (as this processor does) or all at the deadline (as the original processor does).

use std::time::{Duration, Instant};

use batch_executor::Executor;
use batch_producer::{JobMessages, Producer, ProducerOptions};
use dispatcher_sim::{DispatcherHandle, GatewayConfig, GatewayHandle};
use fred::interfaces::ListInterface;
use tokio_util::sync::CancellationToken;

use super::{blocking, expect_completed, lines, ready, spec};
use crate::inputs::{write_prefix_input, POOL};
use crate::lab::{load, Lab};
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

/// A fresh gateway (empty prefix caches) and dispatcher.
async fn simulator(
    lab: &Lab,
    s: &crate::Settings,
) -> Result<(GatewayHandle, DispatcherHandle), BenchError> {
    let gateway = GatewayConfig {
        latency_fixed: BASE_LATENCY,
        prefix_cache_size: s.prefix_cache,
        prefix_miss_latency: s.prefix_miss_latency,
        ..GatewayConfig::default()
    };
    super::e2e::simulator_with(lab, gateway, 1_000, WORKERS).await
}

pub(crate) async fn run(
    lab: &Lab,
    s: &crate::Settings,
    report: &mut Report,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<(), BenchError> {
    let (n, prompts) = (s.prefix_lines, s.prefix_prompts);
    let input = lab.path("prefix.jsonl");
    write_prefix_input(&input, n, prompts, s.request_bytes)?;
    let queue =
        batch_keys::request_queue_name(POOL).map_err(|e| BenchError::Config(e.to_string()))?;
    let result_queue = format!(
        "{}:producer",
        batch_keys::result_queue_name(POOL).map_err(|e| BenchError::Config(e.to_string()))?
    );
    let messages = super::job_messages("batch_prefix", queue.clone(), result_queue);

    // The same members both ways; only the scores differ. Positions come from the real plan.
    let (members, positions) = {
        let (input, dir) = (input.clone(), lab.fresh_dir("prefix-plan")?);
        blocking(move || {
            let limits = batch_plan::Limits {
                max_requests: u64::MAX,
                max_file_bytes: u64::MAX,
                endpoint: None,
            };
            let plan = batch_plan::Plan::build(&input, &dir, limits)?;
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
    let members: Vec<String> = members
        .lines()
        .enumerate()
        .map(|(i, line)| messages.member(i as u64, line.as_bytes()))
        .collect::<Result<_, _>>()?;
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
            let m = producer_run(lab, s, &messages, scored.clone()).await?;
            progress(&format!(
                "   run {run}, {name} scores: {} lines in {:.2} s, prefix-cache hit rate {:.1} %",
                lines(n),
                m.secs,
                m.hit_rate() * 100.0
            ));
            runs.push(m);
        }
    }
    let executor_runs = executor_runs(lab, s, &input, progress).await?;

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
    lab: &Lab,
    s: &crate::Settings,
    messages: &JobMessages,
    scored: Vec<(f64, String)>,
) -> Result<Measured, BenchError> {
    let n = scored.len() as u64;
    lab.flush_redis().await?;
    let (gateway, dispatcher) = simulator(lab, s).await?;
    let producer = Producer::new(lab.client().clone(), ProducerOptions::default());
    let start = Instant::now();
    let measured = async {
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
    }
    .await;
    let stats = gateway.stats();
    dispatcher.shutdown().await;
    gateway.shutdown().await;
    Ok(Measured {
        secs: measured?,
        hits: stats.prefix_cache_hits,
        misses: stats.prefix_cache_misses,
    })
}

/// The job through the executor, a fresh simulator per run.
async fn executor_runs(
    lab: &Lab,
    s: &crate::Settings,
    input: &std::path::Path,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<Vec<Measured>, BenchError> {
    lab.flush_redis().await?;
    let executor = Executor::new(load(&lab.async_config("prefix.yaml", "prefix", "")?)?).await?;
    let mut out = Vec::new();
    let mut failed = None;
    for run in 0..s.long_runs {
        let (gateway, dispatcher) = match simulator(lab, s).await {
            Ok(sim) => sim,
            Err(e) => {
                failed = Some(e);
                break;
            }
        };
        let dir = match lab.fresh_dir(&format!("prefix-{run}")) {
            Ok(dir) => dir,
            Err(e) => {
                dispatcher.shutdown().await;
                gateway.shutdown().await;
                failed = Some(e);
                break;
            }
        };
        let start = Instant::now();
        let batch = match ready(&executor, &spec(input, &dir, None)).await {
            Ok(job) => executor
                .execute(job, CancellationToken::new())
                .await
                .map_err(BenchError::from),
            Err(e) => Err(e),
        };
        let secs = start.elapsed().as_secs_f64();
        let stats = gateway.stats();
        dispatcher.shutdown().await;
        gateway.shutdown().await;
        if let Err(e) = batch.and_then(|b| expect_completed(&b, s.prefix_lines)) {
            failed = Some(e);
            break;
        }
        let m = Measured {
            secs,
            hits: stats.prefix_cache_hits,
            misses: stats.prefix_cache_misses,
        };
        progress(&format!(
            "   run {run}, executor: {} lines in {:.2} s, prefix-cache hit rate {:.1} %",
            lines(s.prefix_lines),
            m.secs,
            m.hit_rate() * 100.0
        ));
        out.push(m);
    }
    executor.shutdown().await;
    match failed {
        Some(e) => Err(e),
        None => Ok(out),
    }
}
