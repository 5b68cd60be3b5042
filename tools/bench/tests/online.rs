//! `bench online` against the gateway simulator in vLLM mode, on loopback: the figures it prints
//! are there and plausible.

use std::process::{Command, Output};
use std::time::Duration;

use dispatcher_sim::{Gateway, GatewayConfig};
use serde_json::Value;

const BENCH: &str = env!("CARGO_BIN_EXE_bench");

/// Runs `bench online` with `args` against `url`.
async fn bench_online(url: String, args: &'static [&'static str]) -> Output {
    tokio::task::spawn_blocking(move || {
        Command::new(BENCH)
            .args(["online", "--url", &url, "--model", "m"])
            .args(args)
            .output()
            .expect("running bench online")
    })
    .await
    .unwrap()
}

/// The stdout of a run that must have succeeded.
fn stdout(run: Output) -> String {
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(
        run.status.success(),
        "bench online failed\n{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn online_prints_plausible_figures() {
    let gateway = Gateway::start(
        ([127, 0, 0, 1], 0).into(),
        GatewayConfig {
            latency_fixed: Duration::from_millis(50),
            latency_per_token: Duration::from_millis(10),
            max_num_seqs: Some(16),
            ..GatewayConfig::default()
        },
    )
    .await
    .unwrap();

    let args = &[
        "--rate",
        "20",
        "--duration",
        "3s",
        "--max-tokens",
        "8",
        "--json",
    ];
    let out = stdout(bench_online(gateway.base_url(), args).await);
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let all = &v["overall"];
    let sent = all["sent"].as_u64().unwrap();
    // 60 expected (20/s for 3 s); Poisson arrivals stay well within this.
    assert!((35..=90).contains(&sent), "{all}");
    assert_eq!(all["answered"], sent, "{all}");
    assert_eq!(all["errors"], 0, "{all}");
    let f = |what: &str, q: &str| all[what][q].as_f64().unwrap_or(f64::NAN);
    assert!(f("ttft", "p50") >= 0.05, "{all}");
    assert!(f("ttft", "p95") < f("e2e", "p50"), "{all}");
    assert!(f("itl", "p50") >= 0.009 && f("itl", "p50") < 0.1, "{all}");
    assert!(f("tpot", "p50") >= 0.009 && f("tpot", "p50") < 0.1, "{all}");
    assert!(f("e2e", "p50") >= 0.05 + 7.0 * 0.01, "{all}");
    let throughput = all["throughput"].as_f64().unwrap();
    assert!((throughput - sent as f64 / 3.0).abs() < 1e-6, "{all}");
    assert_eq!(v["phases"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["phases"][0]["phase"], "steady");

    // In waves, the bursts and the quiet periods apart, as a table.
    let args = &["--rate", "30", "--duration", "2s", "--waves", "500ms"];
    let out = stdout(bench_online(gateway.base_url(), args).await);
    assert!(out.contains("TTFT p50 / p95 / p99 (ms)"), "{out}");
    let line = |phase: &str| {
        out.lines()
            .find(|l| l.starts_with("online") && l.contains(phase))
            .unwrap_or_else(|| panic!("no {phase} line in\n{out}"))
            .to_owned()
    };
    let burst = line("bursts");
    let quiet = line("quiet periods");
    // answers/s is the column after the phase: the bursts' well above the quiet periods'.
    let rate = |l: &str, phase: &str| -> f64 {
        l.split(phase)
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!(
        rate(&burst, "bursts") > 3.0 * rate(&quiet, "quiet periods").max(1.0),
        "{out}"
    );

    // A wrong path: nothing answered, said so, and the exit status is 1.
    let args = &["--rate", "10", "--duration", "500ms"];
    let run = bench_online(format!("{}/v1", gateway.base_url()), args).await;
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("no request was answered (HTTP 404 ×"),
        "{stderr}"
    );
    gateway.shutdown().await;
}
