//! A job through the dispatcher simulator: gate wide open, instant gateway.

use std::time::{Duration, Instant};

use batch_executor::{Executor, JobProgress};
use dispatcher_sim::{
    Dispatcher, DispatcherConfig, DispatcherHandle, Gateway, GatewayConfig, GatewayHandle,
    QueueEntry,
};
use tokio_util::sync::CancellationToken;

use super::{drive, expect_completed, lines, ready, resolved, spec};
use crate::inputs::{write_input, POOL};
use crate::lab::{load, Lab};
use crate::report::{Report, Row, Unit};
use crate::stats::Summary;
use crate::BenchError;

const E2E: &str = "End to end async";

/// An instant gateway and a simulated dispatcher polling every 10 ms, up to 5,000 messages per
/// poll, with 256 HTTP workers: as fast as the simulator goes.
pub(crate) async fn fast_simulator(
    lab: &Lab,
) -> Result<(GatewayHandle, DispatcherHandle), BenchError> {
    simulator(lab, Duration::ZERO, 256).await
}

/// A gateway answering after `latency` and a simulated dispatcher polling every 10 ms, up to
/// 5,000 messages per poll, with `concurrency` HTTP workers.
pub(crate) async fn simulator(
    lab: &Lab,
    latency: Duration,
    concurrency: usize,
) -> Result<(GatewayHandle, DispatcherHandle), BenchError> {
    let gateway = GatewayConfig {
        latency_fixed: latency,
        ..GatewayConfig::default()
    };
    simulator_with(lab, gateway, 5_000, concurrency).await
}

/// A gateway of `gateway_config` and a simulated dispatcher for the pool's queue, polling every
/// 10 ms for up to `batch_size` messages, with `concurrency` HTTP workers, at time scale 0.01.
pub(crate) async fn simulator_with(
    lab: &Lab,
    gateway_config: GatewayConfig,
    batch_size: usize,
    concurrency: usize,
) -> Result<(GatewayHandle, DispatcherHandle), BenchError> {
    let gateway = Gateway::start(([127, 0, 0, 1], 0).into(), gateway_config).await?;
    let name =
        batch_keys::request_queue_name(POOL).map_err(|e| BenchError::Config(e.to_string()))?;
    let mut queue = QueueEntry::new(name);
    queue.igw_base_url = Some(gateway.base_url());
    queue.request_path_url = Some("/v1/chat/completions".into());
    let mut config = DispatcherConfig::new(lab.redis_url(), vec![queue]);
    config.poll_interval = Duration::from_millis(10);
    config.batch_size = batch_size;
    config.concurrency = concurrency;
    config.sim.time_scale = 0.01;
    let dispatcher = match Dispatcher::start(config, None).await {
        Ok(d) => d,
        Err(e) => {
            gateway.shutdown().await;
            return Err(e.into());
        }
    };
    Ok((gateway, dispatcher))
}

/// Where one run's time went, in seconds since it started.
struct Phases {
    enqueued: f64,
    first: f64,
    last: f64,
    end: f64,
}

pub(crate) async fn run(
    lab: &Lab,
    s: &crate::Settings,
    report: &mut Report,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<(), BenchError> {
    let n = s.e2e_lines;
    let input = lab.path("e2e.jsonl");
    write_input(&input, n, s.request_bytes)?;
    lab.flush_redis().await?;
    let (gateway, dispatcher) = fast_simulator(lab).await?;
    let executor = match load(&lab.async_config("e2e.yaml", "e2e", "")?) {
        Ok(config) => Executor::new(config).await,
        Err(e) => {
            dispatcher.shutdown().await;
            return Err(e);
        }
    };
    let measured = match &executor {
        Ok(executor) => runs(executor, lab, s, &input, progress).await,
        Err(_) => Ok(Vec::new()),
    };
    if let Ok(executor) = &executor {
        executor.shutdown().await;
    }
    let stats = dispatcher.stats();
    dispatcher.shutdown().await;
    gateway.shutdown().await;
    executor?;
    let phases = measured?;

    let col = |f: &dyn Fn(&Phases) -> f64| Summary::new(phases.iter().map(f).collect());
    report.rows.push(Row::new(
        E2E,
        format!("{} lines through the simulator: whole job", lines(n)),
        Unit::PerSecond("req/s"),
        col(&|p| n as f64 / p.end),
    ));
    report.rows.push(Row::new(
        E2E,
        "enqueue: start → every line queued",
        Unit::Seconds,
        col(&|p| p.enqueued),
    ));
    report.rows.push(Row::new(
        E2E,
        "wait: start → first result written",
        Unit::Seconds,
        col(&|p| p.first),
    ));
    report.rows.push(Row::new(
        E2E,
        "drain: first → last result written",
        Unit::Seconds,
        col(&|p| p.last - p.first),
    ));
    report.rows.push(Row::new(
        E2E,
        "finalize: last result → job completed",
        Unit::Seconds,
        col(&|p| p.end - p.last),
    ));
    report.note(E2E, format!(
        "{} lines of {} B through the dispatcher simulator (no gate, polls every 10 ms taking up to 5,000 messages, 256 HTTP workers) and its instant gateway, all in this process, against the same redis-server. The phases overlap: the dispatcher takes requests while the job is still being enqueued.",
        lines(n), s.request_bytes
    ));
    report.note(E2E, format!(
        "The simulator, like the real dispatcher, takes one member per ZPOPMIN and reads its cancel marker before each POST, so it, not the processor, sets the pace here (over all runs it took {} messages and pushed {} results, {} Redis errors).",
        stats.taken, stats.results_total(), stats.redis_errors
    ));
    Ok(())
}

async fn runs(
    executor: &Executor,
    lab: &Lab,
    s: &crate::Settings,
    input: &std::path::Path,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<Vec<Phases>, BenchError> {
    let n = s.e2e_lines;
    let mut phases = Vec::new();
    for run in 0..s.long_runs {
        let out = lab.fresh_dir(&format!("e2e-{run}"))?;
        let start = Instant::now();
        let job = ready(executor, &spec(input, &out, None)).await?;
        let rx = job.progress();
        let (batch, seen) = drive(
            executor.execute(job, CancellationToken::new()),
            rx,
            start,
            move |p| resolved(p) >= n as u64,
        )
        .await;
        let end = start.elapsed().as_secs_f64();
        expect_completed(&batch?, n)?;
        let at = |pred: &dyn Fn(&JobProgress) -> bool| {
            seen.iter()
                .find(|(_, p)| pred(p))
                .map_or(f64::NAN, |(t, _)| t.as_secs_f64())
        };
        let p = Phases {
            enqueued: at(&|p| p.dispatched >= n as u64),
            first: at(&|p| resolved(p) > 0),
            last: at(&|p| resolved(p) >= n as u64),
            end,
        };
        progress(&format!(
            "   run {run}: {} lines in {:.2} s (all queued at {:.2} s, first result at {:.3} s, last at {:.2} s)",
            lines(n), p.end, p.enqueued, p.first, p.last
        ));
        phases.push(p);
    }
    Ok(phases)
}
