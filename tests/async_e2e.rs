//! Async mode end to end: the executor (and the `processor` binary) against a real Redis and the
//! simulated llm-d-async dispatcher with its fake gateway.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use batch_executor::{AsyncMode, Executor};
use batch_wire::{parse_request_id, BatchStatus, Envelope};
use dispatcher_sim::{FailureKind, FailureRule, GatewayConfig};
use support::*;
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_lines_over_two_pools_complete_and_answer_their_own_lines() {
    let env = Env::start(GatewayConfig::default()).await;
    let lines = write_input(&env.path("in.jsonl"), 1000, &["llama-3", "mistral"]);
    let config = env.async_config(&[("llama-3", "pool-a"), ("mistral", "pool-b")], "");
    let sim = env.dispatcher(&["pool-a", "pool-b"], |_| {}).await;
    let (executor, batch) = run_job(&env, &config).await;

    assert_eq!(batch.status, BatchStatus::Completed);
    assert_eq!(
        (
            batch.request_counts.total,
            batch.request_counts.completed,
            batch.request_counts.failed
        ),
        (1000, 1000, 0)
    );
    let results = Results::read(&env.path("out"));
    results.assert_answered(&lines);
    assert_eq!(batch_json(&env.path("out"))["status"], "completed");
    // Both pools were used, and their request sets are empty again.
    assert_eq!(
        env.redis.command(&["ZCARD", "llm-d-async:requests:pool-a"]),
        ":0"
    );
    assert_eq!(
        env.redis.command(&["ZCARD", "llm-d-async:requests:pool-b"]),
        ":0"
    );
    let by_pool = executor.mode::<AsyncMode>().unwrap().consumer_stats().await;
    assert_eq!(by_pool["pool-a"].written_total(), 500);
    assert_eq!(by_pool["pool-b"].written_total(), 500);
    // The gateway saw our headers, forwarded by the dispatcher.
    let seen = env.gateway.recent_requests();
    let any = seen.last().unwrap();
    let id = any.header("x-request-id").unwrap();
    assert_eq!(parse_request_id(id).unwrap().0, batch.id);
    assert!(any.header("x-slo-ttft-ms").unwrap().parse::<u64>().unwrap() > 0);
    executor.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_errors_go_to_output_and_failures_to_error() {
    let env = Env::start(GatewayConfig {
        failures: vec![FailureRule::new(FailureKind::Status400, 0.3)],
        ..GatewayConfig::default()
    })
    .await;
    let lines = write_input(&env.path("in.jsonl"), 300, &["llama-3", "broken", "ghost"]);
    // `broken`'s pool is served by a dispatcher entry whose gateway port is closed; `ghost` is
    // not configured at all.
    let config = env.async_config(&[("llama-3", "pool-a"), ("broken", "pool-x")], "");
    let closed = format!("http://127.0.0.1:{}", batch_testkit::free_port());
    let sim = env
        .dispatcher(&["pool-a", "pool-x"], |c| {
            c.queues[1].igw_base_url = Some(closed.clone());
            c.request_timeout = Duration::from_secs(2);
        })
        .await;
    let (executor, batch) = run_job(&env, &config).await;

    assert_eq!(batch.status, BatchStatus::Completed);
    let results = Results::read(&env.path("out"));
    results.assert_each_once(&lines);
    let statuses = results.statuses();
    assert!(statuses[&400] > 0 && statuses[&200] > 0, "{statuses:?}");
    assert_eq!(statuses[&400] + statuses[&200], 100);
    for l in results
        .output
        .iter()
        .filter(|l| l["response"]["status_code"] == 400)
    {
        assert_eq!(
            l["response"]["body"]["error"]["type"], "invalid_request_error",
            "{l}"
        );
    }
    let codes = results.error_codes();
    assert_eq!(codes.get("INFERENCE_ERROR"), Some(&100), "{codes:?}");
    assert_eq!(codes.get("model_not_found"), Some(&100), "{codes:?}");
    assert_eq!(batch.request_counts.completed, statuses[&200] as u64);
    assert_eq!(batch.request_counts.failed, 300 - statuses[&200] as u64);
    executor.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicated_results_never_double_a_line() {
    let (env, lines, config, sim) = one_pool(GatewayConfig::default(), 3000, |c| {
        c.sim.duplicate_rate = 0.1
    })
    .await;
    let (executor, batch) = run_job(&env, &config).await;
    assert_eq!(batch.status, BatchStatus::Completed);
    Results::read(&env.path("out")).assert_each_once(&lines);
    // The doubles did arrive, and were recognised as such (some may come after the job ended).
    let stats = &executor.mode::<AsyncMode>().unwrap().consumer_stats().await["pool-a"];
    assert!(sim.stats().duplicated > 150, "{:?}", sim.stats());
    assert!(stats.duplicates_total() + stats.unknown_job_total() > 0);
    Results::read(&env.path("out")).assert_answers_match(&lines);
    assert_eq!(env.gateway.stats().total, 3000, "a line was sent twice");
    executor.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_whose_requests_never_run_expires_at_its_slo() {
    // The gate stays closed: the dispatcher takes nothing, as under full online load.
    let (env, lines, config, sim) = one_pool(GatewayConfig::default(), 50, closed_gate).await;
    let executor = Executor::new(load(&config)).await.unwrap();
    let mut job = spec(&env, "in.jsonl", "out");
    job.completion_window = Duration::from_secs(3);
    let started = Instant::now();
    let batch = executor.run(job, CancellationToken::new()).await.unwrap();
    let took = started.elapsed();

    assert_eq!(batch.status, BatchStatus::Expired);
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(6),
        "{took:?}"
    );
    assert!(batch.expired_at.is_some());
    let results = Results::read(&env.path("out"));
    results.assert_each_once(&lines);
    assert_eq!(results.error_codes().get("batch_expired"), Some(&50));
    assert_eq!(
        results.error[0]["error"]["message"],
        batch_wire::error_codes::BATCH_EXPIRED_MESSAGE
    );
    assert_eq!(
        env.redis.command(&["ZCARD", "llm-d-async:requests:pool-a"]),
        ":0"
    );
    assert_eq!(sim.stats().taken, 0);
    executor.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_removes_only_that_jobs_pending_members() {
    let env = Env::start(GatewayConfig::default()).await;
    let lines_a = write_input(&env.path("a.jsonl"), 300, &["llama-3"]);
    write_input(&env.path("b.jsonl"), 200, &["llama-3"]);
    let config = env.async_config(&[("llama-3", "pool-a")], "");
    let sim = env.dispatcher(&["pool-a"], closed_gate).await;
    let executor = Executor::new(load(&config)).await.unwrap();
    let (cancel_a, cancel_b) = (CancellationToken::new(), CancellationToken::new());
    let run_a = executor.run(spec(&env, "a.jsonl", "out-a"), cancel_a.clone());
    let run_b = executor.run(spec(&env, "b.jsonl", "out-b"), cancel_b.clone());
    let queue = "llm-d-async:requests:pool-a";
    let checks = async {
        eventually("both jobs enqueued", Duration::from_secs(20), || {
            env.redis.command(&["ZCARD", queue]) == ":500"
        })
        .await;
        cancel_a.cancel();
        // Only job B's members are left.
        eventually("job A withdrawn", Duration::from_secs(20), || {
            env.redis.command(&["ZCARD", queue]) == ":200"
        })
        .await;
        let left = env.redis.command_list(&["ZRANGE", queue, "0", "-1"]);
        let job_a = batch_json(&env.path("out-a"))["id"]
            .as_str()
            .unwrap()
            .to_owned();
        for member in &left {
            let envelope = Envelope::parse(member).unwrap();
            assert_ne!(parse_request_id(&envelope.data.id).unwrap().0, job_a);
        }
        cancel_b.cancel();
    };
    let (a, b, ()) = tokio::join!(run_a, run_b, checks);
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.status, BatchStatus::Cancelled);
    assert_eq!(b.status, BatchStatus::Cancelled);
    assert!(a.cancelling_at.is_some() && a.cancelled_at.is_some());
    let results = Results::read(&env.path("out-a"));
    results.assert_each_once(&lines_a);
    assert_eq!(results.error_codes().get("batch_cancelled"), Some(&300));
    assert_eq!(env.redis.command(&["ZCARD", queue]), ":0");
    executor.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn garbage_and_unknown_results_do_not_stop_the_job() {
    let env = Env::start(fixed_latency(Duration::from_millis(5))).await;
    let (lines, config) = one_pool_job(&env, 200);
    let results_list = "llm-d-async:results:pool-a:$batch";
    for bad in [
        "not json at all",
        r#"{"no_id":true}"#,
        r#"{"id":"batch_req_some-other-job_3","status_code":200,"payload":"{}"}"#,
        r#"{"id":"random","status_code":200,"payload":"{}"}"#,
    ] {
        env.redis.command(&["LPUSH", results_list, bad]);
    }
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let executor = Executor::new(load(&config)).await.unwrap();
    let pushing = async {
        for i in 0..20 {
            env.redis
                .command(&["LPUSH", results_list, &format!("garbage {i}")]);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let (batch, ()) = tokio::join!(
        executor.run(spec(&env, "in.jsonl", "out"), CancellationToken::new()),
        pushing
    );
    let batch = batch.unwrap();
    assert_eq!(batch.status, BatchStatus::Completed);
    Results::read(&env.path("out")).assert_each_once(&lines);
    let stats = &executor.mode::<AsyncMode>().unwrap().consumer_stats().await["pool-a"];
    assert!(
        stats.malformed_total() >= 3,
        "malformed {}",
        stats.malformed_total()
    );
    assert!(stats.unknown_job_total() >= 1);
    executor.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_lost_by_a_crashed_dispatcher_are_enqueued_again() {
    let env = Env::start(fixed_latency(Duration::from_millis(50))).await;
    let lines = write_input(&env.path("in.jsonl"), 300, &["llama-3"]);
    let config = env.async_config(&[("llama-3", "pool-a")], "  lost_request_timeout: 1s\n");
    let crashing = env
        .dispatcher(&["pool-a"], |c| {
            c.sim.crash_after = Some(100);
            c.batch_size = 40;
        })
        .await;
    let executor = Executor::new(load(&config)).await.unwrap();
    let job = executor.run(spec(&env, "in.jsonl", "out"), CancellationToken::new());
    let recover = async {
        crashing.crashed().await;
        // A new dispatcher replaces the crashed one; the requests it had in hand are gone.
        env.dispatcher(&["pool-a"], |_| {}).await
    };
    let (batch, replacement) = tokio::join!(job, recover);
    let batch = batch.unwrap();
    assert_eq!(batch.status, BatchStatus::Completed);
    let results = Results::read(&env.path("out"));
    results.assert_answered(&lines);
    assert_eq!(batch.request_counts.completed, 300);
    executor.shutdown().await;
    replacement.shutdown().await;
    crashing.shutdown().await;
}

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

/// Two jobs resumed one after the other whose result list another live process reads: each
/// writes at once what that reader parked for it, while its setup waits for the list; the
/// second does not wait for the first's setup.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn resumed_jobs_on_a_list_read_elsewhere_write_their_parked_results_at_once() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = env.async_config(&[("llama-3", "pool-a")], "");
    let names = ["a", "b"];
    let inputs: Vec<Vec<String>> = names
        .iter()
        .map(|n| write_input(&env.path(&format!("{n}.jsonl")), 20, &["llama-3"]))
        .collect();
    let run = |executor: &std::sync::Arc<Executor>, n: &str| {
        let mut spec = spec(&env, &format!("{n}.jsonl"), n);
        spec.job_id = Some(format!("job-{n}"));
        let executor = executor.clone();
        tokio::spawn(async move { executor.run(spec, CancellationToken::new()).await })
    };
    let written = |n: &str| Results::read(&env.path(n)).output.len() == 20;
    // No dispatcher: the first run enqueues both jobs and is paused with them in progress.
    let first = std::sync::Arc::new(Executor::new(load(&config)).await.unwrap());
    let runs = [run(&first, "a"), run(&first, "b")];
    eventually("both jobs enqueued", Duration::from_secs(30), || {
        env.redis
            .command(&["ZCARD", "llm-d-async:requests:pool-a"])
            .ends_with("40")
    })
    .await;
    first.pause();
    for run in runs {
        assert_eq!(run.await.unwrap().unwrap().status, BatchStatus::InProgress);
    }
    first.shutdown().await;
    // Another process now reads the jobs' list, and parked every result of both for them.
    let list = "llm-d-async:results:pool-a:$batch";
    env.redis.command(&[
        "SET",
        &format!("{{{list}}}:lease"),
        "elsewhere 1 space instance 0",
        "PX",
        "120000",
    ]);
    for n in names {
        let job = format!("job-{n}");
        for i in 0..20 {
            let result = batch_wire::ResultMessage::http(
                batch_wire::request_id(&job, i),
                200,
                r#"{"id":"chatcmpl-1","choices":[]}"#,
            );
            let parked = format!("{{{list}}}:parked:{job}");
            env.redis.command(&["LPUSH", &parked, &result.to_json()]);
        }
    }
    // A resumed job waits up to 20 s for the list's reader to drain it; its parked results
    // are written meanwhile. The second job starts while the first waits.
    let second = std::sync::Arc::new(Executor::new(load(&config)).await.unwrap());
    let a = run(&second, "a");
    eventually("a's parked results written", Duration::from_secs(8), || {
        written("a")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let b = run(&second, "b");
    eventually("b's parked results written", Duration::from_secs(8), || {
        written("b")
    })
    .await;
    second.pause();
    for run in [a, b] {
        assert_eq!(run.await.unwrap().unwrap().status, BatchStatus::InProgress);
    }
    for (n, lines) in names.iter().zip(&inputs) {
        Results::read(&env.path(n)).assert_each_once(lines);
    }
    second.shutdown().await;
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
