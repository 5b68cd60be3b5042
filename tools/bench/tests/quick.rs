//! The CI smoke test of the bench: `bench --quick` runs every scenario (enqueue and drain on a
//! Redis Cluster too, the replicas group with a replica killed) and writes a report with each
//! scenario's rows, the yield scenario's online figures, and the plots.

use std::path::{Path, PathBuf};
use std::process::Command;

const BENCH: &str = env!("CARGO_BIN_EXE_bench");

/// The processor binary next to the bench one, built first if it is missing (cargo builds
/// only this package's binaries for its tests).
fn processor() -> PathBuf {
    let path = Path::new(BENCH).with_file_name("processor");
    if !path.is_file() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "--quiet", "-p", "processor", "--bin", "processor"]);
        if Path::new(BENCH).parent().and_then(|d| d.file_name()) == Some("release".as_ref()) {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("running cargo build");
        assert!(status.success(), "building the processor failed");
    }
    assert!(path.is_file(), "{} is missing", path.display());
    path
}

#[test]
fn quick_run_reports_every_scenario() {
    let processor = processor();
    let out = tempfile::tempdir().unwrap();
    let run = Command::new(BENCH)
        .arg("--quick")
        .arg("--out")
        .arg(out.path())
        .arg("--processor")
        .arg(&processor)
        .output()
        .expect("running bench");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "bench --quick failed\n{stdout}\n{stderr}"
    );

    let md = std::fs::read_to_string(out.path().join("benchmarks.md")).unwrap();
    for row in [
        "| Enqueue | executor: validate + plan + ZADD",
        "| Enqueue | executor: enqueue (read, build and ZADD every member",
        "| Enqueue | redis-benchmark ZADD, -P 32 |",
        "| Enqueue | baseline: one MULTI",
        "| Cancel | cancel with",
        "| Drain | consumer + sink:",
        "| Drain | redis-benchmark RPOP, -P 32 |",
        "| Enqueue (cluster, 3 primaries) | executor: validate + plan + ZADD",
        "| Enqueue (cluster, 3 primaries) | executor: enqueue (read, build and ZADD",
        "| Enqueue (cluster, 3 primaries) | redis-benchmark ZADD, -P 32 |",
        "| Enqueue (cluster, 3 primaries) | redis-benchmark --cluster ZADD, -P 32,",
        "| Cancel (cluster, 3 primaries) | cancel with",
        "| Drain (cluster, 3 primaries) | consumer + sink:",
        "| Drain (cluster, 3 primaries) | redis-benchmark RPOP, -P 32 |",
        "| Drain (cluster, 3 primaries) | redis-benchmark --cluster RPOP, -P 32,",
        "| End to end async | 2,000 lines through the simulator",
        "| End to end async | drain: first → last result written |",
        "| Prefix cache | plan-ordered scores (this processor): hit rate |",
        "| Prefix cache | equal scores (the original processor): hit rate |",
        "| Prefix cache | plan-ordered scores: first ZADD → last result, miss +50 ms |",
        "| Prefix cache | equal scores: first ZADD → last result, miss +50 ms |",
        "| Prefix cache | executor, 1,000 lines: whole job |",
        "| Sync AIMD | (a) hard limit, fixed 20 ms, aimd, backoff_factor 0.5: throughput",
        "| Sync AIMD | (a) hard limit, fixed 20 ms, work (default): throughput",
        "| Sync AIMD | (b) hard limit, lognormal lengths, gradient: throughput",
        "| Sync AIMD | (c) hard limit, lognormal lengths, 1 % 20× longer, work (default): 429 responses",
        "| Sync AIMD | (d) changing limit, lognormal lengths, work (default): throughput",
        "| Sync AIMD | (e) model server, lognormal lengths, work (default): mean time per output token / unloaded",
        "| Sync AIMD | (e) model server, lognormal lengths, aimd, backoff_factor 0.5: mean limit",
        "| Memory | peak RSS, async mode, 1,000 lines |",
        "| Memory | peak RSS, sync mode, 1,000 lines |",
        "| Serve | upload of 20 MB: POST /v1/files, multipart streamed from disk |",
        "| Serve | write + fsync of the same 20 MB to the same disk |",
        "| Serve | peak RSS of the service, start + upload (VmHWM) |",
        "| Serve | GET /v1/batches/{id}, 32 clients, 100 batches stored |",
        "| Serve | GET /v1/batches/{id}, 32 clients, 100 batches stored: p99 latency |",
        "| Serve | 100 batches of 50 lines at once: first POST → last batch completed |",
        "| Serve | 100 batches of 50 lines at once: Redis connections of the service, max |",
        "| Replicas | async, 6 batches × 200 lines, 1 replica: jobs per minute |",
        "| Replicas | async, 6 batches × 200 lines, 3 replicas: requests per second |",
        "| Replicas | async, 6 batches × 200 lines: 3 replicas / 1 replica, throughput |",
        "| Replicas | sync, 6 batches × 200 lines, 3 replicas: jobs per minute |",
        "| Replicas | sync, 6 batches × 200 lines: 3 replicas / 1 replica, throughput |",
        "| Replicas | lease_ttl 5 s: SIGKILL of a replica → each of its jobs' leases held by another |",
        "| Replicas | lease_ttl 5 s: SIGKILL of a replica → each of its jobs' completed count growing again |",
        "| Yield | the server's capacity: 16 callers at once, answers/s |",
        "| Yield | online at 50 % of capacity, online alone: p95 latency |",
        "| Yield | online at 50 % of capacity, sync, no load (work limiter): online p95 / alone |",
        "| Yield | online at 50 % of capacity, sync, load (headroom 0.15): batch rate / spare capacity |",
        "| Yield | online in waves (1 s at capacity, 1 s at 10 %), sync, load (headroom 0.15): online p95 / alone |",
        // The online traffic's table: per run and phase.
        "| run | phase | answers/s | errors | TTFT p50 / p95 / p99 (ms) |",
        "| online at 50 % of capacity, online alone | steady |",
        "| online at 50 % of capacity, sync, load (headroom 0.15) | steady |",
        "| online in waves (1 s at capacity, 1 s at 10 %), sync, load (headroom 0.15) | bursts |",
        "| online in waves (1 s at capacity, 1 s at 10 %), sync, load (headroom 0.15) | quiet periods |",
        "![yield](yield-steady-50.svg)",
        "![yield](yield-waves.svg)",
    ] {
        assert!(md.contains(row), "no row {row:?} in\n{md}");
    }
    assert!(!md.contains("**Failed**"), "{md}");
    assert!(
        !md.contains("| Enqueue (cluster, 3 primaries) | baseline"),
        "no MULTI baseline on a cluster: {md}"
    );
    // Every figure was measured: no empty medians.
    for line in md
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| Scenario"))
    {
        if let Some(median) = line.split(" | ").nth(2) {
            assert!(median != "–" && !median.contains("NaN"), "{line}");
        }
    }
    assert!(
        md.contains("| CPU |") && md.contains("| redis-server |"),
        "{md}"
    );
    let limit_plots = batch_bench::AIMD_PLOTS.map(|(_, file)| file);
    let yield_plots = ["yield-steady-50.svg", "yield-waves.svg"];
    for plot in ["rates.svg", "rss.svg"]
        .into_iter()
        .chain(limit_plots)
        .chain(yield_plots)
    {
        let svg = std::fs::read_to_string(out.path().join(plot)).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("</svg>"), "{plot}");
        assert!(
            svg.contains("<polyline") || svg.contains("<rect"),
            "{plot} draws nothing"
        );
    }
    // The terminal table has the same rows.
    assert!(
        stdout.contains("Sync AIMD") && stdout.contains("Memory"),
        "{stdout}"
    );
}

#[test]
fn the_rss_helper_measures_the_child_not_its_large_parent() {
    // Make this process large: the kernel folds the parent's high-water mark into a child
    // spawned from it directly, so only a helper in between gives the child's own peak.
    let ballast = vec![1u8; 300 << 20];
    let dir = tempfile::tempdir().unwrap();
    let result = dir.path().join("rss");
    let status = Command::new(BENCH)
        .arg("__measure-rss")
        .arg(&result)
        .args(["sh", "-c", "exit 7"])
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(7), "the helper passes the exit code on");
    // `<peak KiB> <exit code> <CPU µs>`
    let text = std::fs::read_to_string(&result).unwrap();
    let fields: Vec<u64> = text
        .split_whitespace()
        .map(|f| f.parse().unwrap_or_else(|_| panic!("{text}")))
        .collect();
    let [kib, code, cpu_us] = fields[..] else {
        panic!("three fields expected: {text}")
    };
    assert!(
        kib > 0 && kib < 64 << 10,
        "{kib} KiB reported for `sh -c exit`"
    );
    assert_eq!(code, 7, "{text}");
    assert!(cpu_us < 10_000_000, "{cpu_us} µs of CPU for `sh -c exit`");
    assert_eq!(
        ballast.iter().map(|&b| b as usize).sum::<usize>(),
        300 << 20
    );
}
