//! Peak RSS of the `processor` binary, by job size, in both modes, and its CPU time per 1,000
//! requests.

use std::ffi::OsString;
use std::time::Duration;

use dispatcher_sim::GatewayConfig;

use super::simulator::{self, Simulator};
use super::{blocking, Ctx};
use crate::inputs::write_input;
use crate::report::{Report, Row, RssPoint, Target, Unit};
use crate::stats::Summary;
use crate::BenchError;

const MEMORY: &str = "Memory";
const LIMIT_MIB: f64 = 64.0;
/// The largest job may take at most this factor of the second largest one's peak RSS.
const FLAT: f64 = 1.25;

pub(crate) async fn run(cx: Ctx<'_>, report: &mut Report) -> Result<(), BenchError> {
    let Ctx { lab, s, progress } = cx;
    s.require_processor()?;
    let helper = s.rss_helper.clone().ok_or_else(|| {
        BenchError::MissingTool("the RSS helper (the bench binary, Settings::rss_helper)".into())
    })?;
    let mut inputs = Vec::new();
    for &size in &s.memory_sizes {
        let path = lab.path(&format!("memory-{size}.jsonl"));
        write_input(&path, size, s.request_bytes)?;
        inputs.push((size, path));
    }
    let mut points = Vec::new();
    // (mode, lines, CPU seconds per 1,000 requests of each run)
    let mut cpu: Vec<(&str, usize, Vec<f64>)> = Vec::new();
    for mode in ["async", "sync"] {
        lab.flush_redis().await?;
        // The simulator runs in this process, so only the processor's own memory is measured.
        let (gateway, dispatcher, config) = if mode == "async" {
            let Simulator {
                gateway,
                dispatcher,
            } = Simulator::fast(lab).await?;
            let config = lab.async_config("memory-async.yaml", "memory", "")?;
            (gateway, Some(dispatcher), config)
        } else {
            let gateway = simulator::gateway(GatewayConfig::default()).await?;
            let config = lab.sync_config(
                "memory-sync.yaml",
                &gateway.base_url(),
                "",
                "concurrency:\n  global: 128\n  per_endpoint: 64\n",
            )?;
            (gateway, None, config)
        };
        for (size, input) in &inputs {
            let (mut runs, mut cpu_runs) = (Vec::new(), Vec::new());
            for run in 0..s.long_runs {
                let out = lab.fresh_dir(&format!("memory-{mode}-{size}-{run}"))?;
                let args: Vec<OsString> = vec![
                    "run".into(),
                    "--config".into(),
                    config.clone().into(),
                    "--input".into(),
                    input.clone().into(),
                    "--output-dir".into(),
                    out.into(),
                    "--no-progress".into(),
                ];
                let (helper, processor) = (helper.clone(), s.processor.clone());
                let (stdout, stderr) = (
                    lab.path("memory-processor.stdout"),
                    lab.path("memory-processor.stderr"),
                );
                let timeout = Duration::from_secs(120 + *size as u64 / 100);
                let used = blocking(move || {
                    crate::rss::measure(&helper, &processor, &args, &stdout, &stderr, timeout)
                })
                .await?;
                let per_1000 = used.cpu_seconds * 1000.0 / (*size).max(1) as f64;
                progress(&format!(
                    "   {mode}, {size} lines, run {run}: peak RSS {:.1} MiB, CPU {:.2} s ({:.0} ms per 1,000 requests)",
                    used.peak_mib, used.cpu_seconds, per_1000 * 1000.0
                ));
                runs.push(used.peak_mib);
                cpu_runs.push(per_1000);
            }
            cpu.push((mode, *size, cpu_runs));
            points.push(RssPoint {
                mode: mode.into(),
                lines: *size,
                mib: Summary::new(runs),
            });
        }
        if let Some(d) = dispatcher {
            d.shutdown().await;
        }
        gateway.shutdown().await;
    }

    for p in &points {
        report.rows.push(
            Row::new(
                MEMORY,
                format!("peak RSS, {} mode, {} lines", p.mode, super::lines(p.lines)),
                Unit::MiB,
                p.mib.clone(),
            )
            .target(Target::AtMost(LIMIT_MIB)),
        );
    }
    for mode in ["async", "sync"] {
        let of_mode: Vec<&RssPoint> = points.iter().filter(|p| p.mode == mode).collect();
        let growth = |a: &RssPoint, b: &RssPoint| Summary::one(b.mib.median() / a.mib.median());
        let label = |a: &RssPoint, b: &RssPoint| {
            format!(
                "RSS growth, {mode}, {} → {} lines",
                super::lines(a.lines),
                super::lines(b.lines)
            )
        };
        if let [small, .., large] = of_mode.as_slice() {
            report.rows.push(Row::new(
                MEMORY,
                label(small, large),
                Unit::Factor,
                growth(small, large),
            ));
        }
        if let [.., middle, large] = of_mode.as_slice() {
            report.rows.push(
                Row::new(
                    MEMORY,
                    label(middle, large),
                    Unit::Factor,
                    growth(middle, large),
                )
                .target(Target::AtMost(FLAT)),
            );
        }
    }
    // The largest job: start-up and finalizing weigh least in it.
    for mode in ["async", "sync"] {
        if let Some((_, size, runs)) = cpu.iter().filter(|c| c.0 == mode).max_by_key(|c| c.1) {
            report.rows.push(Row::new(
                MEMORY,
                format!(
                    "CPU time per 1,000 requests ({mode}), {} lines",
                    super::lines(*size)
                ),
                Unit::Seconds,
                Summary::new(runs.clone()),
            ));
        }
    }
    report.note(MEMORY, "CPU time is the processor's user + system time (`ru_utime` + `ru_stime` of the same `wait4`, all its threads, start-up and finalizing included) divided by the job's requests, per 1,000; the simulator and gateway run in the bench, not in it. In async mode it validates, plans, builds and ZADDs every member and writes every result; in sync mode it also sends every request over HTTP itself.");
    report.note(MEMORY, format!(
        "Peak RSS (`ru_maxrss` from `wait4`, taken by a small helper process that starts the processor, so the bench's own memory is not folded in) of `processor run` ({}) on jobs of {} B lines, the simulator (async: dispatcher and gateway; sync: gateway, per_endpoint 64) running inside the bench, so only the processor is measured. Flat is judged between the two largest jobs: the largest may need at most {FLAT}× the peak of the next one. From the smallest job up, memory first grows with buffers that are bounded by the configuration, not by the job: in async mode up to 4 chunks of 1,000 members (about 2.5 KB each) in flight to Redis, plus 1,000 results per consumer batch; a 1,000-line job does not fill them.",
        s.processor.display(), s.request_bytes
    ));
    report.rss = points;
    Ok(())
}
