//! Faults injected into the async path through the `processor` binary: several processes on one
//! pool, a consumer id in use, a write that fails half way, SIGTERM, `processor cancel`, a second
//! writer, a changed input, an idle consumer, a Redis that may evict keys, a Redis restarted
//! empty. Real redis-server, the simulated dispatcher and gateway. The faults an executor meets
//! in process are in `crates/executor/tests/jobs/faults.rs`.

mod support;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dispatcher_sim::GatewayConfig;
use support::*;

const QUEUE: &str = "llm-d-async:requests:pool-a";

fn signal(child: &std::process::Child, sig: i32) {
    // SAFETY: a signal to our own child process.
    unsafe { libc::kill(child.id() as i32, sig) };
}

fn lines_in(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

fn wait_exit(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let until = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            Instant::now() < until,
            "the processor did not exit within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stderr_of(child: &mut std::process::Child) -> String {
    let mut text = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut text);
    }
    text
}

/// N processes with the default config (no consumer_id) on one pool, 2,000 lines each: every
/// job completes with each custom_id once. Returns the seconds it took.
async fn processes_on_one_pool(n: usize) -> f64 {
    let env = Env::start(GatewayConfig::default()).await;
    let config = env.async_config(&[("llama-3", "pool-a")], "");
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let inputs: Vec<(PathBuf, PathBuf, Vec<String>)> = (0..n)
        .map(|i| {
            let input = env.path(&format!("in-{i}.jsonl"));
            let lines = write_input(&input, 2000, &["llama-3"]);
            (input, env.path(&format!("out-{i}")), lines)
        })
        .collect();
    let started = Instant::now();
    let children = spawn_runs(
        &config,
        inputs
            .iter()
            .map(|(input, out, _)| (input.as_path(), out.as_path())),
    );
    for (mut child, (_, out, lines)) in children.into_iter().zip(&inputs) {
        let status = wait_exit(&mut child.0, Duration::from_secs(180));
        let stderr = stderr_of(&mut child.0);
        assert!(status.success(), "{}: {stderr}", out.display());
        let results = Results::read(out);
        results.assert_each_once(lines);
        results.assert_answers_match(lines);
        assert_eq!(batch_json(out)["status"], "completed");
    }
    let took = started.elapsed().as_secs_f64();
    assert_eq!(
        env.gateway.stats().total,
        2000 * n as u64,
        "lines sent more than once"
    );
    // The same work in one process, for comparison.
    let mut one = Command::new(PROCESSOR);
    one.args(["run", "--config"]).arg(&config);
    for (i, (input, _, _)) in inputs.iter().enumerate() {
        one.arg("--input")
            .arg(input)
            .arg("--output-dir")
            .arg(env.path(&format!("one-{i}")));
    }
    let started = Instant::now();
    let status = one
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let alone = started.elapsed().as_secs_f64();
    eprintln!(
        "{n} processes × 2,000 lines: {took:.1} s; the same {n} jobs in one process: {alone:.1} s"
    );
    sim.shutdown().await;
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_then_five_processes_on_one_pool_each_finish_every_line_once() {
    processes_on_one_pool(2).await;
    processes_on_one_pool(5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_explicit_consumer_id_read_by_a_live_process_is_refused() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = env.async_config(&[("llama-3", "pool-a")], "  consumer_id: replica-1\n");
    let _sim = env.dispatcher(&["pool-a"], closed_gate).await;
    write_input(&env.path("a.jsonl"), 10, &["llama-3"]);
    write_input(&env.path("b.jsonl"), 10, &["llama-3"]);
    let mut first = Child(
        run_cmd(&config, &env.path("a.jsonl"), &env.path("a"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually("the first job enqueued", Duration::from_secs(30), || {
        env.redis.command(&["ZCARD", QUEUE]) == ":10"
    })
    .await;
    let second = run_cmd(&config, &env.path("b.jsonl"), &env.path("b"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("llm-d-async:results:pool-a:replica-1"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("pid {}", first.0.id())),
        "names the holder: {stderr}"
    );
    assert!(
        stderr.contains("async_dispatch.consumer_id"),
        "names the key: {stderr}"
    );
    signal(&first.0, libc::SIGTERM);
    wait_exit(&mut first.0, Duration::from_secs(15));
}

/// A write stopped half way by a file-size limit, in either mode: the processor waits for the
/// disk, a SIGTERM pauses it, and a rerun completes every line once.
async fn write_fails_half_way(sync: bool) {
    let env = Env::start(GatewayConfig::default()).await;
    let lines = write_input(&env.path("in.jsonl"), 2000, &["llama-3"]);
    let (config, sim) = if sync {
        (env.sync_config(&["llama-3"], "", ""), None)
    } else {
        let config = env.async_config(&[("llama-3", "pool-a")], "");
        (config, Some(env.dispatcher(&["pool-a"], |_| {}).await))
    };
    // Sync mode writes its answers in batches, async mode its results.
    let complaint = if sync {
        "could not write answers"
    } else {
        "could not write results"
    };
    let out = env.path("out");
    let mut limited = run_cmd(&config, &env.path("in.jsonl"), &out);
    limited.stdout(Stdio::null()).stderr(Stdio::piped());
    // A file-size limit stops a write half way (EFBIG), as a full disk does.
    unsafe {
        use std::os::unix::process::CommandExt;
        limited.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 200_000,
                rlim_max: 200_000,
            };
            libc::setrlimit(libc::RLIMIT_FSIZE, &limit);
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    let mut child = Child(limited.spawn().unwrap());
    eventually(
        "the output file to reach the limit",
        Duration::from_secs(60),
        || std::fs::metadata(out.join("output.jsonl")).is_ok_and(|m| m.len() > 150_000),
    )
    .await;
    // Writes keep failing; the processor waits for the disk, it does not fail the job.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "the processor gave up"
    );
    signal(&child.0, libc::SIGTERM);
    let status = wait_exit(&mut child.0, Duration::from_secs(15));
    let stderr = stderr_of(&mut child.0);
    assert_eq!(status.code(), Some(6), "paused: {stderr}");
    assert!(stderr.contains(complaint), "{stderr}");
    let text = std::fs::read_to_string(out.join("output.jsonl")).unwrap();
    assert!(
        text.is_empty() || text.ends_with('\n'),
        "a torn last line was left"
    );

    run_ok(&config, &env.path("in.jsonl"), &out);
    let results = Results::read(&out);
    results.assert_answered(&lines);
    assert_eq!(batch_json(&out)["status"], "completed");
    if let Some(sim) = sim {
        sim.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_that_fails_half_way_leaves_the_job_resumable() {
    write_fails_half_way(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sync_write_that_fails_half_way_leaves_the_job_resumable() {
    write_fails_half_way(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_pauses_and_a_rerun_completes_with_nothing_cancelled() {
    let env = Env::start(fixed_latency(Duration::from_millis(5))).await;
    let (lines, config) = one_pool_job(&env, 2000);
    let sim = env.dispatcher(&["pool-a"], |c| c.batch_size = 10).await;
    let out = env.path("out");
    let mut child = Child(
        run_cmd(&config, &env.path("in.jsonl"), &out)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    eventually("some results", Duration::from_secs(60), || {
        lines_in(&out.join("output.jsonl")) >= 200
    })
    .await;
    let sent = Instant::now();
    signal(&child.0, libc::SIGTERM);
    let status = wait_exit(&mut child.0, Duration::from_secs(15));
    let stopped_in = sent.elapsed();
    let stderr = stderr_of(&mut child.0);
    assert_eq!(status.code(), Some(6), "{stderr}");
    assert!(
        stopped_in < Duration::from_secs(10),
        "took {stopped_in:?} to stop"
    );
    assert_eq!(batch_json(&out)["status"], "in_progress");
    assert!(
        Results::read(&out).error_codes().is_empty(),
        "lines were closed on SIGTERM"
    );
    assert_ne!(
        env.redis.command(&["ZCARD", QUEUE]),
        ":0",
        "requests were withdrawn"
    );

    run_ok(&config, &env.path("in.jsonl"), &out);
    let results = Results::read(&out);
    results.assert_each_once(&lines);
    assert!(
        results.error_codes().is_empty(),
        "{:?}",
        results.error_codes()
    );
    assert_eq!(batch_json(&out)["status"], "completed");
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn processor_cancel_closes_a_stopped_job() {
    let env = Env::start(GatewayConfig::default()).await;
    let (lines, config) = one_pool_job(&env, 100);
    let _sim = env.dispatcher(&["pool-a"], closed_gate).await;
    let out = env.path("out");
    let mut child = run_until_queued(&env, &config, &out, 100, Stdio::null).await;
    signal(&child.0, libc::SIGTERM);
    assert_eq!(
        wait_exit(&mut child.0, Duration::from_secs(15)).code(),
        Some(6)
    );
    assert_eq!(
        env.redis.command(&["ZCARD", QUEUE]),
        ":100",
        "a pause keeps them queued"
    );

    let cancel = Command::new(PROCESSOR)
        .args(["cancel", "--config"])
        .arg(&config)
        .arg("--output-dir")
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&cancel.stderr);
    assert!(cancel.status.success(), "{stderr}");
    assert_eq!(batch_json(&out)["status"], "cancelled");
    let results = Results::read(&out);
    results.assert_each_once(&lines);
    assert_eq!(results.error_codes().get("batch_cancelled"), Some(&100));
    assert_eq!(env.redis.command(&["ZCARD", QUEUE]), ":0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_writer_and_a_changed_input_are_refused() {
    let env = Env::start(GatewayConfig::default()).await;
    write_input(&env.path("in.jsonl"), 50, &["llama-3"]);
    let config = env.async_config(&[("llama-3", "pool-a")], "");
    let _sim = env.dispatcher(&["pool-a"], closed_gate).await;
    let out = env.path("out");
    let mut first = run_until_queued(&env, &config, &out, 50, Stdio::null).await;
    let second = run_cmd(&config, &env.path("in.jsonl"), &out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("in use by another run"), "{stderr}");
    assert!(
        stderr.contains(&format!("pid {}", first.0.id())),
        "{stderr}"
    );
    signal(&first.0, libc::SIGTERM);
    assert_eq!(
        wait_exit(&mut first.0, Duration::from_secs(15)).code(),
        Some(6)
    );

    // The input changes before the resume: the old results would land on other lines.
    write_input(&env.path("in.jsonl"), 60, &["llama-3"]);
    let resumed = run_cmd(&config, &env.path("in.jsonl"), &out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&resumed.stderr);
    assert_eq!(resumed.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("changed since the job"), "{stderr}");

    // Two inputs that would share one output directory.
    std::fs::create_dir_all(env.path("x")).unwrap();
    std::fs::create_dir_all(env.path("y")).unwrap();
    write_input(&env.path("x/same.jsonl"), 5, &["llama-3"]);
    write_input(&env.path("y/same.jsonl"), 5, &["llama-3"]);
    let both = Command::new(PROCESSOR)
        .args(["run", "--config"])
        .arg(&config)
        .arg("--input")
        .arg(env.path("x/same.jsonl"))
        .arg("--input")
        .arg(env.path("y/same.jsonl"))
        .arg("--output-dir")
        .arg(env.path("both"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&both.stderr);
    assert_eq!(both.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("would both write to"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_job_logs_no_warning() {
    let env = Env::start(GatewayConfig::default()).await;
    write_input(&env.path("in.jsonl"), 20, &["llama-3"]);
    let mut config =
        std::fs::read_to_string(env.async_config(&[("llama-3", "pool-a")], "")).unwrap();
    config = config.replace("result_poll_timeout: 200ms", "result_poll_timeout: 1s");
    std::fs::write(env.path("idle.yaml"), config).unwrap();
    let _sim = env.dispatcher(&["pool-a"], closed_gate).await;
    let mut child = Child(
        run_cmd(
            &env.path("idle.yaml"),
            &env.path("in.jsonl"),
            &env.path("out"),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap(),
    );
    tokio::time::sleep(Duration::from_secs(10)).await;
    signal(&child.0, libc::SIGTERM);
    wait_exit(&mut child.0, Duration::from_secs(15));
    let stderr = stderr_of(&mut child.0);
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| (l.contains("WARN") || l.contains("ERROR")) && !l.contains("SIGTERM"))
        // The test's Redis keeps nothing on disk, which is worth its warning at start.
        .filter(|l| !l.contains("Redis has no persistence"))
        .collect();
    assert!(
        warnings.is_empty(),
        "an idle job warned:\n{}",
        warnings.join("\n")
    );
    assert!(
        stderr.contains("requests enqueued"),
        "the job did not start: {stderr}"
    );
}

/// A Redis that may evict keys under memory pressure is refused at start, by `run` and by
/// `serve`, naming the setting and the fix (exit 2); `redis_allow_eviction: true` runs anyway
/// with a warning. A Redis without persistence is a warning, once, and a gauge.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_that_may_evict_keys_is_refused_unless_the_config_accepts_it() {
    let mut env = Env::start(GatewayConfig::default()).await;
    env.redis = batch_testkit::RedisServer::builder()
        .args(["--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"])
        .start();
    env.redis_url_file = env.redis.write_url_file(env.dir.path());
    let (lines, config) = one_pool_job(&env, 20);
    let refused = run_cmd(&config, &env.path("in.jsonl"), &env.path("out"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("maxmemory-policy is allkeys-lru")
            && stderr.contains("noeviction")
            && stderr.contains("redis_allow_eviction"),
        "{stderr}"
    );
    assert!(
        !env.path("out").join("output.jsonl").exists(),
        "nothing ran: {stderr}"
    );
    let serve_config = env.path("serve.yaml");
    std::fs::copy(&config, &serve_config).unwrap();
    support::serve::add_serve_section(&serve_config, &env.path("storage"), &[], "", "");
    let served = std::process::Command::new(PROCESSOR)
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&serve_config)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&served.stderr);
    assert_eq!(served.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("maxmemory-policy is allkeys-lru"),
        "{stderr}"
    );
    let accepted_serve = env.path("accepted-serve.yaml");
    std::fs::write(
        &accepted_serve,
        format!(
            "redis_allow_eviction: true\n{}",
            std::fs::read_to_string(&serve_config).unwrap()
        ),
    )
    .unwrap();
    let service = support::serve::Service::start(&accepted_serve);
    let metrics = service.client(None).get("/metrics").await.text();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("batch_redis_persistence_enabled") && l.ends_with(" 0")),
        "{metrics}"
    );
    drop(service);

    // Accepted: the job runs, with one warning for each of the two settings.
    let accepted = env.path("accepted.yaml");
    std::fs::write(
        &accepted,
        format!(
            "redis_allow_eviction: true\n{}",
            std::fs::read_to_string(&config).unwrap()
        ),
    )
    .unwrap();
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let ran = run_cmd(&accepted, &env.path("in.jsonl"), &env.path("out"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(ran.status.success(), "{stderr}");
    Results::read(&env.path("out")).assert_each_once(&lines);
    assert_eq!(stderr.matches("may evict keys").count(), 1, "{stderr}");
    assert_eq!(
        stderr.matches("Redis has no persistence").count(),
        1,
        "{stderr}"
    );
    sim.shutdown().await;
}

/// `processor run` on a Redis restarted empty mid-job (no persistence): the result list's lease,
/// the job's entry in the list's registry and every queued request are gone. The reader takes
/// its lease again, the job registers again, the lost lines are sent again, and the job
/// completes before its deadline with each line once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_restarted_empty_mid_job_loses_no_line() {
    let mut env = Env::start(fixed_latency(Duration::from_millis(100))).await;
    let lines = write_input(&env.path("in.jsonl"), 300, &["llama-3"]);
    let config = env.async_config(&[("llama-3", "pool-a")], "  lost_request_timeout: 2s\n");
    // A few requests at a time in the dispatcher's hands: most wait in Redis, and go with it.
    let sim = env
        .dispatcher(&["pool-a"], |c| {
            c.batch_size = 4;
            c.concurrency = 4;
        })
        .await;
    let out = env.path("out");
    let log = env.path("run.log");
    let mut child = Child(
        run_cmd(&config, &env.path("in.jsonl"), &out)
            .arg("--completion-window")
            .arg("2m")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let list = "llm-d-async:results:pool-a:$batch";
    let lease = format!("{{{list}}}:lease");
    let registry = format!("{{{list}}}:jobs");
    eventually("60 results", Duration::from_secs(60), || {
        lines_in(&out.join("output.jsonl")) >= 60
    })
    .await;
    assert_eq!(env.redis.command(&["HLEN", &registry]), ":1");
    env.redis.restart();
    let started = Instant::now();
    assert_eq!(env.redis.command(&["DBSIZE"]), ":0", "restarted with data");
    eventually("the lease taken again", Duration::from_secs(30), || {
        env.redis.command(&["EXISTS", &lease]) == ":1"
    })
    .await;
    eventually("the job registered again", Duration::from_secs(30), || {
        env.redis.command(&["HLEN", &registry]) == ":1"
    })
    .await;
    let status = wait_exit(&mut child.0, Duration::from_secs(110));
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "{stderr}");
    eprintln!("finished {:?} after the restart", started.elapsed());
    assert_eq!(batch_json(&out)["status"], "completed", "{stderr}");
    let results = Results::read(&out);
    results.assert_each_once(&lines);
    assert_eq!(
        results.output.len(),
        lines.len(),
        "{:?}",
        results.error_codes()
    );
    assert!(
        stderr.contains("enqueued again"),
        "no lost line was sent again: {stderr}"
    );
    sim.shutdown().await;
}
