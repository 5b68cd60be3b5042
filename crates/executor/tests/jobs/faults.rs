//! Faults injected into the async path, in process: a Redis restart, a closed gate, Redis down
//! at a cancel or a deadline, results parked for the job. Real redis-server, the simulated
//! dispatcher and gateway.

use std::time::{Duration, Instant};

use crate::support::*;
use batch_executor::{Executor, JobSpec};
use batch_wire::BatchStatus;
use dispatcher_sim::GatewayConfig;
use tokio_util::sync::CancellationToken;

const QUEUE: &str = "llm-d-async:requests:pool-a";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_restart_in_the_middle_of_a_job_is_waited_out() {
    let mut env = Env::start(GatewayConfig::default()).await;
    // Data must survive the restart: the queue and the results are in Redis.
    env.redis = batch_testkit::RedisServer::builder().aof(true).start();
    env.redis_url_file = env.redis.write_url_file(env.dir.path());
    let lines = write_input(&env.path("in.jsonl"), 20_000, &["llama-3"]);
    // The simulator drops what it was sending when Redis went away; a short lost-request
    // timeout lets the job send those lines again instead of waiting the default 10 minutes.
    let config = env.async_config(&[("llama-3", "pool-a")], "  lost_request_timeout: 20s\n");
    let sim = env.dispatcher(&["pool-a"], |c| c.batch_size = 200).await;
    let executor = Executor::new(load(&config)).await.unwrap();
    let out = env.path("out");
    let spec = JobSpec::new(env.path("in.jsonl"), &out);
    let run = executor.run(spec, CancellationToken::new());
    tokio::pin!(run);
    let watch = async {
        eventually("5,000 lines", Duration::from_secs(120), || {
            output_lines(&out) >= 5000
        })
        .await;
    };
    tokio::select! {
        _ = watch => {}
        done = &mut run => panic!("finished before the restart: {:?}", done.map(|b| b.status)),
    }
    let at = output_lines(&out);
    assert!(at < 20_000, "the job finished before the restart");
    env.redis.restart();
    let batch = tokio::time::timeout(Duration::from_secs(600), run)
        .await
        .expect("the job finished after the restart")
        .unwrap();
    assert_eq!(batch.status, BatchStatus::Completed, "{batch:?}");
    let results = Results::read(&out);
    results.assert_each_once(&lines);
    assert_eq!(batch.request_counts.completed, 20_000);
    executor.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gate_closed_for_three_lost_timeouts_sends_each_request_once() {
    let env = Env::start(fixed_latency(Duration::from_millis(200))).await;
    let lines = write_input(&env.path("in.jsonl"), 300, &["llama-3"]);
    let config = env.async_config(&[("llama-3", "pool-a")], "  lost_request_timeout: 1s\n");
    let sim = env
        .dispatcher(&["pool-a"], |c| {
            closed_gate(c);
            c.batch_size = 50;
            c.concurrency = 8;
            for q in &mut c.queues {
                q.id = Some("pool-a".into());
            }
        })
        .await;
    env.redis
        .command(&["SET", dispatcher_sim::DEFAULT_BUDGET_KEY, "1"]);
    let executor = Executor::new(load(&config)).await.unwrap();
    let out = env.path("out");
    let run = executor.run(
        JobSpec::new(env.path("in.jsonl"), &out),
        CancellationToken::new(),
    );
    tokio::pin!(run);
    // Let the dispatcher take members into its hands, then close the gate: the ones it holds
    // go back re-serialised (other bytes than the processor wrote).
    let taken = async {
        eventually(
            "members in the dispatcher's hands",
            Duration::from_secs(30),
            || sim.stats().taken >= 40,
        )
        .await
    };
    tokio::select! { _ = taken => {}, _ = &mut run => panic!("finished too early") }
    env.redis
        .command(&["SET", dispatcher_sim::DEFAULT_BUDGET_KEY, "0"]);
    let refused = async {
        eventually(
            "members put back re-serialised",
            Duration::from_secs(30),
            || sim.stats().gate_refused > 0,
        )
        .await
    };
    tokio::select! { _ = refused => {}, _ = &mut run => panic!("finished too early") }
    // Closed for three lost-request timeouts: the processor looks and must find every one.
    let closed = tokio::time::sleep(Duration::from_millis(3500));
    tokio::select! { _ = closed => {}, _ = &mut run => panic!("finished with the gate closed") }
    let queued = env.redis.command_list(&["ZRANGE", QUEUE, "0", "-1"]);
    let mut ids: Vec<String> = queued
        .iter()
        .map(|m| batch_wire::Envelope::parse(m).unwrap().data.id)
        .collect();
    let n = ids.len();
    ids.sort();
    ids.dedup();
    eprintln!(
        "queued while closed: {n} members, {} ids; gateway so far {}; dispatcher {:?}",
        ids.len(),
        env.gateway.stats().total,
        sim.stats()
    );
    assert_eq!(n, ids.len(), "a request is queued twice");
    env.redis
        .command(&["SET", dispatcher_sim::DEFAULT_BUDGET_KEY, "1"]);
    let batch = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("finished once the gate opened")
        .unwrap();
    assert_eq!(batch.status, BatchStatus::Completed);
    Results::read(&out).assert_each_once(&lines);
    assert_eq!(
        env.gateway.stats().total,
        300,
        "the gateway got a request more than once"
    );
    executor.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_redis_down_a_cancel_and_a_deadline_still_end_the_job() {
    for cancel_it in [true, false] {
        let mut env = Env::start(GatewayConfig::default()).await;
        let (lines, config) = one_pool_job(&env, 200);
        let _sim = env.dispatcher(&["pool-a"], closed_gate).await;
        let executor = Executor::new(load(&config)).await.unwrap();
        let out = env.path("out");
        let mut spec = JobSpec::new(env.path("in.jsonl"), &out);
        spec.completion_window = Duration::from_secs(if cancel_it { 3600 } else { 4 });
        let cancel = CancellationToken::new();
        let run = executor.run(spec, cancel.clone());
        tokio::pin!(run);
        let queued = async {
            eventually("the job enqueued", Duration::from_secs(30), || {
                env.redis.command(&["ZCARD", QUEUE]) == ":200"
            })
            .await
        };
        tokio::select! { _ = queued => {}, _ = &mut run => panic!("ended early") }
        env.redis.kill();
        let asked = Instant::now();
        if cancel_it {
            cancel.cancel();
        }
        let batch = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .expect("the job ended although Redis is down")
            .unwrap();
        let (status, code) = if cancel_it {
            (BatchStatus::Cancelled, "batch_cancelled")
        } else {
            (BatchStatus::Expired, "batch_expired")
        };
        assert_eq!(batch.status, status);
        assert!(
            asked.elapsed() < Duration::from_secs(40),
            "took {:?}",
            asked.elapsed()
        );
        let results = Results::read(&out);
        results.assert_each_once(&lines);
        assert_eq!(results.error_codes().get(code), Some(&200));
        executor.shutdown().await;
    }
}

/// Results that another process parked for a job of this process's own list (it read the list
/// while this process's lease had lapsed) reach the job: the job reads its parked list whoever
/// holds the lease, fresh job or resumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn results_parked_for_a_job_on_its_own_list_reach_it() {
    let env = Env::start(GatewayConfig::default()).await;
    let lines = write_input(&env.path("in.jsonl"), 20, &["llama-3"]);
    // A long lost-request timeout: a line is never re-sent here, so only the parked list can
    // answer the lines taken off the queue below.
    let config = env.async_config(&[("llama-3", "pool-a")], "  lost_request_timeout: 10m\n");
    env.redis
        .command(&["SET", dispatcher_sim::DEFAULT_BUDGET_KEY, "0"]);
    let sim = env.dispatcher(&["pool-a"], closed_gate).await;
    let executor = Executor::new(load(&config)).await.unwrap();
    let out = env.path("out");
    let run = executor.run(
        JobSpec::new(env.path("in.jsonl"), &out),
        CancellationToken::new(),
    );
    tokio::pin!(run);
    let queued = async {
        eventually("the job enqueued", Duration::from_secs(30), || {
            env.redis.command(&["ZCARD", QUEUE]) == ":20"
        })
        .await
    };
    tokio::select! { _ = queued => {}, _ = &mut run => panic!("finished with the gate closed") }
    // What the reader of another process does with results of a job it does not run: the
    // requests are taken, answered, and their results parked beside the list for the job.
    let taken = env.redis.command_list(&["ZPOPMIN", QUEUE, "5"]);
    for member in taken.iter().step_by(2) {
        let envelope = batch_wire::Envelope::parse(member).unwrap();
        let id = envelope.data.id;
        let (job, _) = batch_wire::split_request_id(&id).unwrap();
        let list = envelope.internal.result_queue_name.unwrap();
        let parked = batch_keys::ListKeys::new(&list).parked_list(&job);
        let body = serde_json::json!({
            "id": "chatcmpl-parked", "object": "chat.completion", "model": "llama-3",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "parked"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        });
        let result = serde_json::json!({"id": id, "status_code": 200, "payload": body.to_string()});
        env.redis.command(&["LPUSH", &parked, &result.to_string()]);
    }
    env.redis
        .command(&["SET", dispatcher_sim::DEFAULT_BUDGET_KEY, "1"]);
    let batch = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the parked results reached the job")
        .unwrap();
    assert_eq!(batch.status, BatchStatus::Completed);
    let results = Results::read(&out);
    results.assert_each_once(&lines);
    assert_eq!(
        env.gateway.stats().total,
        15,
        "the parked lines were not sent again"
    );
    executor.shutdown().await;
    sim.shutdown().await;
}
