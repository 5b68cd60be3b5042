//! The `processor` binary against both dispatcher releases the simulator plays, v0.9 and v0.10:
//! killed with SIGKILL and run again. The other scenarios run the executor in process:
//! `crates/executor/tests/jobs/dispatcher_versions.rs`.

mod support;

use std::time::Duration;

use batch_testkit::both_versions;
use dispatcher_sim::DispatcherVersion;
use support::*;

// ---- Resume after kill -9 ------------------------------------------------------------------------

/// Killed with SIGKILL mid-job and run again: each line, over two pools, is written once.
async fn resume_after_kill_9(version: DispatcherVersion) {
    let env = Env::start(fixed_latency(Duration::from_millis(10))).await;
    let lines = write_input(&env.path("in.jsonl"), 2000, &["llama-3", "mistral"]);
    let config = env.async_config(&[("llama-3", "pool-a"), ("mistral", "pool-b")], "");
    let sim = env
        .dispatcher_version(&["pool-a", "pool-b"], version, |c| c.batch_size = 10)
        .await;
    kill_9_and_rerun(
        &config,
        &env.path("in.jsonl"),
        &env.path("out"),
        &lines,
        200,
    )
    .await;
    sim.shutdown().await;
}
both_versions!(resume_after_kill_9);

/// kill -9 while every request is at a gateway that answers in `answer`, then a resume: the
/// resume waits for the answers the dispatcher is still sending instead of sending them again
/// (a v0.9 dispatcher holds a request it is sending in no key). Few lines, long answers.
async fn resume_while_answers_are_slow(answer: Duration) {
    const LINES: usize = 6;
    let (env, lines, config, sim) =
        one_pool_version(fixed_latency(answer), LINES, DispatcherVersion::V0_9, |c| {
            c.concurrency = 8
        })
        .await;
    let out = env.path("out");
    let mut first = Child(
        run_cmd(&config, &env.path("in.jsonl"), &out)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually(
        "every request at the gateway",
        Duration::from_secs(30),
        || env.gateway.stats().in_flight == LINES,
    )
    .await;
    first.0.kill().unwrap(); // SIGKILL
    first.0.wait().unwrap();
    assert_eq!(output_lines(&out), 0, "killed before any answer");
    let rerun = tokio::task::spawn_blocking({
        let (config, input, out) = (config.clone(), env.path("in.jsonl"), out.clone());
        move || run_ok(&config, &input, &out)
    });
    let second = tokio::time::timeout(answer + Duration::from_secs(60), rerun)
        .await
        .expect("the resume finished once the answers came")
        .unwrap();
    assert!(String::from_utf8_lossy(&second.stderr).contains("resuming job"));
    Results::read(&out).assert_each_once(&lines);
    assert_eq!(env.gateway.stats().total, LINES as u64, "sends = lines");
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resume_does_not_resend_answers_of_8_s() {
    resume_while_answers_are_slow(Duration::from_secs(8)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resume_does_not_resend_answers_of_30_s() {
    resume_while_answers_are_slow(Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resume_does_not_resend_answers_of_90_s() {
    resume_while_answers_are_slow(Duration::from_secs(90)).await;
}
