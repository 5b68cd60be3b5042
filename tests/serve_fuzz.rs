//! A property-based fuzz of the running `processor serve`, generated from the OpenAPI document it
//! serves (`GET /openapi.json`) by schemathesis (from PyPI, in the test virtualenv): thousands of
//! generated requests, with and without a key, must get no 5xx, answers that match the document
//! (statuses, content types, bodies), and leave the process alive with its memory bounded.

mod support;

use std::path::PathBuf;
use std::process::Command;

use dispatcher_sim::GatewayConfig;
use support::serve::*;
use support::*;

const KEY_A: &str = "sk-fuzz-alpha-0001";
const KEY_B: &str = "sk-fuzz-beta-0002";

/// Generated examples per operation: 15 operations make more than 2,000 requests.
const EXAMPLES: u32 = 150;

/// The virtualenv's `schemathesis`, or a panic that says how to make it (never skipped).
fn schemathesis() -> PathBuf {
    let venv = std::env::var_os("BATCH_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/venv"));
    let bin = venv.join("bin/schemathesis");
    assert!(
        bin.exists(),
        "no schemathesis at {}: run `bash scripts/test.sh` (it installs it), or set BATCH_VENV",
        bin.display()
    );
    bin
}

/// The sum of `batch_service_api_requests_total` over its series.
fn requests_counted(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("batch_service_api_requests_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn generated_requests_get_documented_answers_and_never_a_5xx() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = async_service(
        &env,
        &[(KEY_A, "alpha"), (KEY_B, "beta")],
        "  max_json_body_bytes: 64KiB\n",
        "input:\n  max_file_bytes: 1MiB\n",
    );
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let service = Service::start(&config);
    let pid = service.pid();
    let a = service.client(Some(KEY_A));
    // Something to find: a file and a batch of the tenant.
    let (input, _) = input_jsonl("fuzz", 5, "llama-3");
    let file = a.upload_ok("fuzz.jsonl", input.as_bytes()).await;
    a.create_batch(&file, "24h").await.expect(200);
    let start_kb = status_kb(pid, "VmRSS");

    let report = env.path("schemathesis.xml");
    let base = service.base.clone();
    let ran = tokio::task::spawn_blocking(move || {
        Command::new(schemathesis())
            .arg("run")
            .arg(format!("{base}/openapi.json"))
            .args(["--checks", "all"])
            .args(["--hypothesis-max-examples", &EXAMPLES.to_string()])
            .args(["--hypothesis-seed", "30"])
            .args(["--hypothesis-suppress-health-check", "all"])
            .args(["--request-timeout", "20000"])
            .args(["--workers", "2"])
            .arg("--header")
            .arg(format!("Authorization: Bearer {KEY_A}"))
            .arg("--junit-xml")
            .arg(&report)
            .env("SCHEMATHESIS_TELEMETRY", "false")
            .env("NO_COLOR", "1")
            .output()
            .expect("running schemathesis")
    })
    .await
    .unwrap();
    let out = String::from_utf8_lossy(&ran.stdout);
    let tail: Vec<&str> = out.lines().rev().take(120).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    assert!(
        ran.status.success(),
        "schemathesis found failures:\n{}\nstderr:\n{}\nservice:\n{}",
        tail.join("\n"),
        String::from_utf8_lossy(&ran.stderr),
        service.stderr_tail(40)
    );

    // Alive, with its memory bounded, after all of them.
    let health = service.client(None).get("/health").await;
    assert_eq!(health.status, 200);
    let metrics = service.client(None).get("/metrics").await.text();
    let requests = requests_counted(&metrics);
    assert!(
        requests >= 2000.0,
        "only {requests} requests reached the API"
    );
    let end_kb = status_kb(pid, "VmRSS");
    let peak_kb = status_kb(pid, "VmHWM");
    eprintln!(
        "{requests} requests; RSS {} MB before, {} MB after, {} MB at most",
        start_kb / 1024,
        end_kb / 1024,
        peak_kb / 1024
    );
    assert!(peak_kb < 400 * 1024, "peak RSS {peak_kb} kB");
    assert!(
        end_kb < start_kb + 100 * 1024,
        "RSS {end_kb} kB after, {start_kb} kB before"
    );
    drop(service);
    sim.shutdown().await;
}
