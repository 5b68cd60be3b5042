//! Async mode end to end through the `processor` binary, against a real Redis and the simulated
//! llm-d-async dispatcher with its fake gateway: a resume, SIGINT, an invalid input, Redis down
//! at start, health and metrics while a job runs, several jobs in one process, bodies refused.
//! The executor's own async tests run in process: `crates/executor/tests/jobs/async_mode.rs`.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dispatcher_sim::GatewayConfig;
use support::*;

// ---- The binary ------------------------------------------------------------------------------

/// A v0.9 dispatcher keeps the requests it is sending in no Redis key. A processor killed with
/// every request enqueued and run again must not take those for lost: no line is put back
/// before `lost_request_timeout` has passed since the job last handed requests over, and the
/// gateway gets each line once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resume_does_not_send_again_what_the_dispatcher_is_sending() {
    let (env, lines, config, sim) =
        one_pool(fixed_latency(Duration::from_millis(1500)), 200, |c| {
            c.batch_size = 20
        })
        .await;
    let out = env.path("out");
    let mut first = Child(
        run_cmd(&config, &env.path("in.jsonl"), &env.path("out"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let manifest = || std::fs::read_to_string(out.join("job-state.json")).unwrap_or_default();
    let output_lines = || {
        std::fs::read_to_string(out.join("output.jsonl"))
            .map(|t| t.lines().count())
            .unwrap_or(0)
    };
    eventually(
        "every request enqueued and some answered",
        Duration::from_secs(60),
        || manifest().contains("\"enqueued\": true") && output_lines() >= 20,
    )
    .await;
    first.0.kill().unwrap(); // SIGKILL, with requests at the gateway
    first.0.wait().unwrap();
    assert!(output_lines() < 200, "killed too late to prove anything");
    run_ok(&config, &env.path("in.jsonl"), &env.path("out"));
    let results = Results::read(&out);
    results.assert_answered(&lines);
    assert_eq!(env.gateway.stats().total, 200, "lines were sent twice");
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigint_cancels_the_job_and_empties_its_queue() {
    let (env, lines, config, sim) = one_pool(GatewayConfig::default(), 100, closed_gate).await;
    let mut child = run_until_queued(&env, &config, &env.path("out"), 100, Stdio::piped).await;
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGINT) };
    let status = child.0.wait().unwrap();
    assert_eq!(status.code(), Some(5), "exit code for cancelled");
    let results = Results::read(&env.path("out"));
    results.assert_each_once(&lines);
    assert_eq!(results.error_codes().get("batch_cancelled"), Some(&100));
    assert_eq!(batch_json(&env.path("out"))["status"], "cancelled");
    assert_eq!(
        env.redis.command(&["ZCARD", "llm-d-async:requests:pool-a"]),
        ":0"
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_input_fails_the_job_with_its_line_numbers() {
    let env = Env::start(GatewayConfig::default()).await;
    let mut lines = write_input(&env.path("in.jsonl"), 5, &["llama-3"]);
    lines[1] = "{not json".into();
    lines[3] = lines[3].replace("POST", "GET");
    std::fs::write(env.path("in.jsonl"), lines.join("\n")).unwrap();
    let config = env.async_config(&[("llama-3", "pool-a")], "");
    let run = run_cmd(&config, &env.path("in.jsonl"), &env.path("out"))
        .output()
        .unwrap();
    assert_eq!(
        run.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let batch = batch_json(&env.path("out"));
    assert_eq!(batch["status"], "failed");
    let data = batch["errors"]["data"].as_array().unwrap();
    let bad: Vec<_> = data
        .iter()
        .map(|e| (e["line"].as_u64().unwrap(), e["code"].as_str().unwrap()))
        .collect();
    assert_eq!(bad, [(2, "invalid_json_line"), (4, "invalid_method")]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains("line 2:") && stderr.contains("line 4:"),
        "{stderr}"
    );
    assert_eq!(
        env.redis
            .command(&["EXISTS", "llm-d-async:requests:pool-a"]),
        ":0",
        "nothing sent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_at_start_is_a_clear_error_after_bounded_retries() {
    // With --redis-attempts (without it, a run waits until the job's deadline: net_faults.rs).
    let env = Env::start(GatewayConfig::default()).await;
    write_input(&env.path("in.jsonl"), 5, &["llama-3"]);
    let config = env.async_config(&[("llama-3", "pool-a")], "");
    let port = batch_testkit::free_port();
    std::fs::write(
        &env.redis_url_file,
        format!("redis://:sekret@127.0.0.1:{port}\n"),
    )
    .unwrap();
    let started = Instant::now();
    let run = run_cmd(&config, &env.path("in.jsonl"), &env.path("out"))
        .args(["--redis-attempts", "6"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "cannot reach Redis at redis://***@127.0.0.1:{port} after 6 attempts"
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("sekret"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// A plain HTTP/1.0 GET on loopback: (status, body).
fn http_get(port: u16, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response[9..12].parse().unwrap();
    let body = response
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_ready_and_metrics_are_served_while_a_job_runs() {
    let env = Env::start(GatewayConfig::default()).await;
    write_input(&env.path("in.jsonl"), 30, &["llama-3"]);
    let port = batch_testkit::free_port();
    let config = env.async_config(&[("llama-3", "pool-a")], "");
    let yaml = std::fs::read_to_string(&config).unwrap()
        + &format!("observability:\n  addr: 127.0.0.1:{port}\n");
    std::fs::write(&config, yaml).unwrap();
    let sim = env.dispatcher(&["pool-a"], closed_gate).await;
    let mut child = run_until_queued(&env, &config, &env.path("out"), 30, Stdio::null).await;
    assert_eq!(http_get(port, "/health"), (200, "ok".into()));
    assert_eq!(http_get(port, "/ready").0, 200);
    // The counters move right after the ZADDs return.
    eventually("the enqueue counted", Duration::from_secs(10), || {
        let (status, metrics) = http_get(port, "/metrics");
        status == 200
            && metrics.contains("batch_requests_enqueued_total{pool=\"pool-a\"} 30")
            && metrics.contains("model_inflight_requests{model=\"llama-3\"} 30")
    })
    .await;
    // Open the gate: the job finishes and the counters follow.
    env.redis.command(&["SET", "dispatch-gate-budget", "1"]);
    let status = child.0.wait().unwrap();
    assert!(status.success());
    assert_eq!(
        batch_json(&env.path("out"))["request_counts"]["completed"],
        30
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_process_runs_several_jobs_sharing_the_consumers() {
    let env = Env::start(GatewayConfig::default()).await;
    let first = write_input(&env.path("first.jsonl"), 120, &["llama-3", "mistral"]);
    let second = write_input(&env.path("second.jsonl"), 80, &["mistral"]);
    let config = env.async_config(&[("llama-3", "pool-a"), ("mistral", "pool-b")], "");
    let sim = env.dispatcher(&["pool-a", "pool-b"], |_| {}).await;
    let run = Command::new(PROCESSOR)
        .args(["run", "--config"])
        .arg(&config)
        .arg("--input")
        .arg(env.path("first.jsonl"))
        .arg("--input")
        .arg(env.path("second.jsonl"))
        .arg("--output-dir")
        .arg(env.path("out"))
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    // One Batch object per job on stdout.
    let stdout = String::from_utf8(run.stdout).unwrap();
    let batches: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(batches.len(), 2);
    assert_ne!(batches[0]["id"], batches[1]["id"]);
    for (name, lines) in [("first", &first), ("second", &second)] {
        let dir = env.path("out").join(name);
        let results = Results::read(&dir);
        results.assert_each_once(lines);
        results.assert_answers_match(lines);
        assert_eq!(batch_json(&dir)["status"], "completed");
    }
    sim.shutdown().await;
}

/// Bodies the dispatcher would change or drop (a number beyond float64's range, an integer
/// beyond ±2^53, an escaped lone surrogate): refused per line in async mode, naming the field,
/// before anything is enqueued; the same file in sync mode is sent byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_the_dispatcher_would_change_are_refused_in_async_mode_only() {
    let env = Env::start(GatewayConfig::default()).await;
    let mut lines = write_input(&env.path("in.jsonl"), 6, &["llama-3"]);
    let with = |line: &str, field: &str| {
        line.replacen(
            r#""max_tokens":8"#,
            &format!(r#""max_tokens":8,{field}"#),
            1,
        )
    };
    lines[1] = with(&lines[1], r#""temperature":1e400"#);
    lines[2] = with(&lines[2], r#""seed":9007199254740993"#);
    lines[4] = lines[4].replacen("question number", r"question \ud800 number", 1);
    assert!(
        lines[1].contains("1e400") && lines[2].contains("seed") && lines[4].contains(r"\ud800")
    );
    std::fs::write(env.path("in.jsonl"), lines.join("\n") + "\n").unwrap();

    let config = env.async_config(&[("llama-3", "pool-a")], "");
    let run = run_cmd(&config, &env.path("in.jsonl"), &env.path("async"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(3), "{stderr}");
    let batch = batch_json(&env.path("async"));
    assert_eq!(batch["status"], "failed");
    let bad: Vec<(u64, String, String)> = batch["errors"]["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            assert!(
                e["message"]
                    .as_str()
                    .unwrap()
                    .contains("the dispatcher would"),
                "{e}"
            );
            (
                e["line"].as_u64().unwrap(),
                e["code"].as_str().unwrap().to_owned(),
                e["param"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let expected = [
        (2, "body.temperature"),
        (3, "body.seed"),
        (5, "body.messages[1].content"),
    ];
    assert_eq!(
        bad,
        expected.map(|(l, p)| (l, "invalid_request".to_owned(), p.to_owned())),
        "{stderr}"
    );
    assert_eq!(
        env.redis
            .command(&["EXISTS", "llm-d-async:requests:pool-a"]),
        ":0",
        "nothing enqueued"
    );

    let config = env.sync_config(&["llama-3"], "", "");
    run_ok(&config, &env.path("in.jsonl"), &env.path("sync"));
    let mut ids: Vec<String> = std::fs::read_to_string(env.path("sync/output.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["custom_id"].to_string())
        .collect();
    ids.sort();
    assert_eq!(
        ids,
        (0..6).map(|i| format!("\"req-{i}\"")).collect::<Vec<_>>()
    );
    let sent: Vec<String> = env
        .gateway
        .recent_requests()
        .into_iter()
        .map(|r| r.body_digest)
        .collect();
    for line in &lines {
        // The body is the line's first field (the keys are written in order).
        let raw =
            &line[line.find(r#""body":"#).unwrap() + 7..line.find(r#","custom_id""#).unwrap()];
        assert!(
            sent.contains(&batch_wire::hash::body_digest(raw.as_bytes())),
            "sync mode sent the body as it is: {raw}"
        );
    }
}
