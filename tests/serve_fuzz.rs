//! A property-based fuzz of the running `processor serve`, generated from the OpenAPI document it
//! serves (`GET /openapi.json`) by schemathesis (from PyPI, in the test virtualenv): thousands of
//! generated requests, with and without a key, must get no 5xx, answers that match the document
//! (statuses, content types, bodies), and leave the process alive with its memory bounded.

mod support;

use std::collections::BTreeMap;
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

/// Runs schemathesis against the service's own document, with tenant A's key. `extra` adds
/// arguments (for example checks to leave out).
async fn fuzz(
    service: &Service,
    report: &std::path::Path,
    examples: u32,
    extra: &[&str],
) -> std::process::Output {
    let base = service.base.clone();
    let report = report.to_owned();
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        Command::new(schemathesis())
            .arg("run")
            .arg(format!("{base}/openapi.json"))
            .args(["--checks", "all"])
            .args(&extra)
            .args(["--hypothesis-max-examples", &examples.to_string()])
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
    .unwrap()
}

/// The last `n` lines of schemathesis's output and its stderr, for a failure's message.
fn tail_of(ran: &std::process::Output, n: usize) -> String {
    let out = String::from_utf8_lossy(&ran.stdout);
    let lines: Vec<&str> = out.lines().collect();
    format!(
        "{}\nstderr:\n{}",
        lines[lines.len().saturating_sub(n)..].join("\n"),
        String::from_utf8_lossy(&ran.stderr)
    )
}

/// `batch_service_api_requests_total` summed by status.
fn requests_by_status(metrics: &str) -> BTreeMap<u16, f64> {
    let mut by = BTreeMap::new();
    for line in metrics
        .lines()
        .filter(|l| l.starts_with("batch_service_api_requests_total{"))
    {
        let status = line
            .split("status=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .and_then(|s| s.parse::<u16>().ok());
        let count = line.rsplit(' ').next().and_then(|c| c.parse::<f64>().ok());
        if let (Some(status), Some(count)) = (status, count) {
            *by.entry(status).or_insert(0.0) += count;
        }
    }
    by
}

/// The fuzzed service: two tenants, small bodies and files so that limits are met often.
fn fuzz_config(env: &Env) -> PathBuf {
    async_service(
        env,
        &[(KEY_A, "alpha"), (KEY_B, "beta")],
        "  max_json_body_bytes: 64KiB\n",
        "input:\n  max_file_bytes: 1MiB\n",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn generated_requests_get_documented_answers_and_never_a_5xx() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = fuzz_config(&env);
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let service = Service::start(&config);
    let pid = service.pid();
    let a = service.client(Some(KEY_A));
    // Something to find: a file and a batch of the tenant.
    let (input, _) = input_jsonl("fuzz", 5, "llama-3");
    let file = a.upload_ok("fuzz.jsonl", input.as_bytes()).await;
    a.create_batch(&file, "24h").await.expect(200);
    let start_kb = status_kb(pid, "VmRSS");

    let ran = fuzz(&service, &env.path("schemathesis.xml"), EXAMPLES, &[]).await;
    assert!(
        ran.status.success(),
        "schemathesis found failures:\n{}\nservice:\n{}",
        tail_of(&ran, 120),
        service.stderr_tail(40)
    );

    // Alive, with its memory bounded, after all of them.
    let health = service.client(None).get("/health").await;
    assert_eq!(health.status, 200);
    let metrics = service.client(None).get("/metrics").await.text();
    let requests = requests_by_status(&metrics).values().sum::<f64>();
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

/// With Redis gone, generated requests get documented answers, and a server error is only ever a
/// 503 (the part that does not answer is named, and the SDKs retry it); when Redis is back the
/// service answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_a_redis_outage_the_only_server_error_is_503() {
    let mut env = Env::start(GatewayConfig::default()).await;
    let config = fuzz_config(&env);
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let service = Service::start(&config);
    let a = service.client(Some(KEY_A));
    let (input, _) = input_jsonl("outage", 5, "llama-3");
    let file = a.upload_ok("outage.jsonl", input.as_bytes()).await;
    let batch = a.create_batch(&file, "24h").await.expect(200);
    let before = requests_by_status(&service.client(None).get("/metrics").await.text());

    env.redis.kill();
    // The client sees the connection drop a moment later; from then on no request waits out
    // the reconnection: a 503 at once, `/ready` and `/metrics` too.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    for (path, status) in [("/v1/batches", 503), ("/ready", 503), ("/metrics", 200)] {
        let client = if path.starts_with("/v1/") {
            &a
        } else {
            &service.client(None)
        };
        let started = std::time::Instant::now();
        let got = client.get(path).await;
        let took = started.elapsed();
        assert_eq!(
            got.status,
            status,
            "{path} during the outage: {}",
            got.text()
        );
        assert!(
            took < std::time::Duration::from_secs(5),
            "{path} took {took:?} to answer during the outage"
        );
    }
    // Every 5xx is checked below from the service's own count, by status.
    let ran = fuzz(
        &service,
        &env.path("schemathesis-outage.xml"),
        EXAMPLES / 5,
        &["--exclude-checks", "not_a_server_error"],
    )
    .await;
    assert!(
        ran.status.success(),
        "schemathesis found failures during the outage:\n{}\nservice:\n{}",
        tail_of(&ran, 120),
        service.stderr_tail(40)
    );
    let after = requests_by_status(&service.client(None).get("/metrics").await.text());
    let during =
        |status: u16| after.get(&status).unwrap_or(&0.0) - before.get(&status).unwrap_or(&0.0);
    let unavailable = during(503);
    assert!(
        unavailable >= 100.0,
        "only {unavailable} answers were 503 while Redis was down: {after:?}"
    );
    for (&status, _) in after.iter().filter(|(s, _)| **s >= 500 && **s != 503) {
        assert_eq!(
            during(status),
            0.0,
            "{} answers were {status} while Redis was down:\n{}",
            during(status),
            service.stderr_tail(40)
        );
    }

    env.redis.restart();
    let id = batch["id"].as_str().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let got = a.get(&format!("/v1/batches/{id}")).await;
        if got.status == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the batch still answers {} a minute after Redis came back: {}",
            got.status,
            service.stderr_tail(40)
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert_eq!(service.client(None).get("/health").await.status, 200);
    drop(service);
    sim.shutdown().await;
}
