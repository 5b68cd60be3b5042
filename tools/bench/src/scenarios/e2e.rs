//! A job through the dispatcher simulator: gate wide open, instant gateway.

use std::path::Path;
use std::time::Instant;

use batch_executor::{Executor, JobProgress};

use super::simulator::Simulator;
use super::{
    async_config, execute_recorded, expect_completed, lines, ready, resolved, spec, with_executor,
    Ctx,
};
use crate::inputs::write_input;
use crate::report::{Report, Row, Unit};
use crate::stats::Summary;
use crate::BenchError;

const E2E: &str = "End to end async";

/// Where one run's time went, in seconds since it started.
struct Phases {
    enqueued: f64,
    first: f64,
    last: f64,
    end: f64,
}

pub(crate) async fn run(cx: Ctx<'_>, report: &mut Report) -> Result<(), BenchError> {
    let Ctx { lab, s, .. } = cx;
    let n = s.e2e_lines;
    let input = lab.path("e2e.jsonl");
    write_input(&input, n, s.request_bytes)?;
    lab.flush_redis().await?;
    let sim = Simulator::fast(lab).await?;
    let measured = match async_config(lab, "e2e") {
        Ok(config) => {
            with_executor(config, async |executor| runs(cx, executor, &input).await).await
        }
        Err(e) => Err(e),
    };
    let stats = sim.dispatcher.stats();
    sim.stop().await;
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

async fn runs(cx: Ctx<'_>, executor: &Executor, input: &Path) -> Result<Vec<Phases>, BenchError> {
    let Ctx { lab, s, progress } = cx;
    let n = s.e2e_lines;
    let mut phases = Vec::new();
    for run in 0..s.long_runs {
        let out = lab.fresh_dir(&format!("e2e-{run}"))?;
        let start = Instant::now();
        let job = ready(executor, &spec(input, &out, None)).await?;
        let (batch, seen) = execute_recorded(executor, job, start, n).await;
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
