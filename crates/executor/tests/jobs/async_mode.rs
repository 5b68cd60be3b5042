//! Async mode end to end, in process: the executor against a real Redis and the simulated
//! llm-d-async dispatcher with its fake gateway.

use std::time::{Duration, Instant};

use crate::support::*;
use batch_executor::{AsyncMode, Executor};
use batch_wire::{parse_request_id, BatchStatus, Envelope};
use dispatcher_sim::{FailureKind, FailureRule, GatewayConfig};
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
