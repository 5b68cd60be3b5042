//! A dispatcher whose queue entry names one result list for the pool (the seed's
//! `llm-d-async:results:<pool>:$batch`) sends every process's results there, whatever list each
//! process's requests ask for. Every job must still get each of its results once, and the
//! gateway must serve one request per line: nothing is counted as lost and sent again.

mod support;

use std::io::Read;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use batch_testkit::{RedisCluster, RedisServer, TempDir};
use dispatcher_sim::{
    Dispatcher, DispatcherConfig, Gateway, GatewayConfig, GatewayHandle, QueueEntry,
};
use support::*;

const LIST: &str = "llm-d-async:results:pool-p:$batch";
const WARNING: &str = "the dispatcher sends results of requests that name";

/// Where the test's Redis is: one server or a cluster, kept alive for the test.
enum Redis {
    One(RedisServer),
    Cluster(RedisCluster),
}

impl Redis {
    fn url(&self) -> String {
        match self {
            Redis::One(r) => r.url(),
            Redis::Cluster(c) => c.url(),
        }
    }
}

/// A fast simulated dispatcher for pool-p whose queue entry sends every result to [`LIST`].
fn entry_naming_one_list(url: &str, gateway: &GatewayHandle) -> DispatcherConfig {
    let mut entry = QueueEntry::new("llm-d-async:requests:pool-p");
    entry.igw_base_url = Some(gateway.base_url());
    entry.request_path_url = Some("/v1/chat/completions".into());
    entry.result_queue_name = Some(LIST.into());
    let mut config = DispatcherConfig::new(url.to_owned(), vec![entry]);
    config.poll_interval = Duration::from_millis(20);
    config.batch_size = 100;
    config
}

fn config(dir: &TempDir, url: &str) -> PathBuf {
    let url_file = dir.path().join("redis-url");
    std::fs::write(&url_file, format!("{url}\n")).unwrap();
    // A short lost-request timeout: a result that waited unseen would be sent again.
    let yaml = format!(
        "dispatch_mode: async\nredis_url_file: {}\nwork_dir: {}\nasync_dispatch:\n  result_poll_timeout: 200ms\n  lost_request_timeout: 4s\nmodel_gateways:\n  llama-3:\n    inference_pool_name: pool-p\n",
        url_file.display(),
        dir.path().join("work").display()
    );
    let path = dir.path().join("processor.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

/// `n` processes with the default config on pool-p, 500 lines each, the queue entry naming
/// `$batch`: every job completes with each line once and the gateway serves 500 × n requests;
/// the mismatch is named at most once per process, and by some process.
async fn processes_on_a_pool_whose_entry_names_one_list(n: usize, redis: Redis) {
    let dir = batch_testkit::tempdir().unwrap();
    let gateway = Gateway::start("127.0.0.1:0".parse().unwrap(), GatewayConfig::default())
        .await
        .unwrap();
    let mut sim_config = entry_naming_one_list(&redis.url(), &gateway);
    sim_config.sim.time_scale = 0.01;
    let sim = Dispatcher::start(sim_config, None).await.unwrap();
    let config = config(&dir, &redis.url());
    let jobs: Vec<(PathBuf, PathBuf, Vec<String>)> = (0..n)
        .map(|i| {
            let input = dir.path().join(format!("in-{i}.jsonl"));
            let lines = write_input(&input, 500, &["llama-3"]);
            (input, dir.path().join(format!("out-{i}")), lines)
        })
        .collect();
    let mut children = spawn_runs(
        &config,
        jobs.iter()
            .map(|(input, out, _)| (input.as_path(), out.as_path())),
    );
    let mut warned = 0;
    for (child, (_, out, lines)) in children.iter_mut().zip(&jobs) {
        let until = Instant::now() + Duration::from_secs(120);
        let status = loop {
            if let Some(status) = child.0.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < until, "{} did not finish", out.display());
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let mut stderr = String::new();
        child
            .0
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        assert!(status.success(), "{}: {stderr}", out.display());
        assert_eq!(batch_json(out)["status"], "completed", "{stderr}");
        let results = Results::read(out);
        results.assert_each_once(lines);
        results.assert_answers_match(lines);
        let warnings = stderr.matches(WARNING).count();
        assert!(warnings <= 1, "named {warnings} times: {stderr}");
        warned += warnings;
    }
    assert!(warned >= 1, "no process named the mismatch");
    assert_eq!(
        gateway.stats().total,
        500 * n as u64,
        "the gateway served more requests than lines"
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_then_four_processes_get_their_results_from_the_one_list_the_entry_names() {
    processes_on_a_pool_whose_entry_names_one_list(2, Redis::One(RedisServer::start())).await;
    processes_on_a_pool_whose_entry_names_one_list(4, Redis::One(RedisServer::start())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_on_a_three_primary_cluster() {
    processes_on_a_pool_whose_entry_names_one_list(4, Redis::Cluster(RedisCluster::start(3))).await;
}

/// The list the queue entry names is held by a process that reads nothing (frozen) while the
/// job's results pile up there: they are not lost lines, so the lost-line search, run every
/// second, sends nothing again; once the frozen holder's lease lapses, the process waiting on
/// that list reads it and the job completes with one request per line.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn results_waiting_on_a_frozen_readers_list_are_not_sent_again() {
    let redis = RedisServer::start();
    let dir = batch_testkit::tempdir().unwrap();
    let gateway = Gateway::start("127.0.0.1:0".parse().unwrap(), GatewayConfig::default())
        .await
        .unwrap();
    let lease = format!("{{{LIST}}}:lease");
    redis.command(&["SET", &lease, "elsewhere 1 space instance 0", "PX", "8000"]);
    let sim_config = entry_naming_one_list(&redis.url(), &gateway);
    let sim = Dispatcher::start(sim_config, None).await.unwrap();
    let config = config(&dir, &redis.url());
    let input = dir.path().join("in.jsonl");
    let out = dir.path().join("out");
    let lines = write_input(&input, 200, &["llama-3"]);
    let started = Instant::now();
    let status = run_cmd(&config, &input, &out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    assert!(
        started.elapsed() > Duration::from_secs(5),
        "the job ended before the frozen lease lapsed"
    );
    let results = Results::read(&out);
    results.assert_answered(&lines);
    assert_eq!(gateway.stats().total, 200, "lines were sent again");
    sim.shutdown().await;
}
