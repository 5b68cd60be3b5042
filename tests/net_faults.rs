//! Network faults between the processor and Redis, and between the dispatcher and Redis: a
//! fault proxy ([`batch_testkit::FaultProxy`]) on the link, the `processor` binary in async
//! mode, the simulated dispatcher and gateway. Each case checks that every custom_id ends once,
//! that the gateway got each request once (sends = lines), and that the job's progress resumes
//! within seconds of each fault's end (read from its output file, not from wall time alone).

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use batch_testkit::{Fault, FaultProxy};
use dispatcher_sim::DispatcherHandle;
use support::*;

/// How soon after a fault ends the job must be writing results again. The old lease rule
/// waited a whole lease TTL (10 s) after a cut; reconnecting and backoff are capped at 2 s.
const RESUME_WITHIN: Duration = Duration::from_secs(6);

/// A copy of the env's async config whose Redis URL goes through `proxy`.
fn config_via(env: &Env, config: &Path, proxy: &FaultProxy, name: &str) -> PathBuf {
    let url_file = env.path(&format!("{name}-redis-url"));
    std::fs::write(&url_file, proxy.redis_url() + "\n").unwrap();
    let yaml = std::fs::read_to_string(config).unwrap().replace(
        &env.redis_url_file.display().to_string(),
        &url_file.display().to_string(),
    );
    let path = env.path(&format!("{name}.yaml"));
    std::fs::write(&path, yaml).unwrap();
    path
}

/// Starts `processor run` of `input` into `out` with `config`, its stderr in `<out>.log`.
fn start(config: &Path, input: &Path, out: &Path) -> Child {
    let log = std::fs::File::create(out.with_extension("log")).unwrap();
    Child(
        run_cmd(config, input, out)
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    )
}

fn log_of(out: &Path) -> String {
    std::fs::read_to_string(out.with_extension("log")).unwrap_or_default()
}

/// Holds `fault` on `proxy` for `length`, then heals the link and returns how long the job
/// writing to `out` took to write again (zero when it had nothing left to write).
async fn hold(
    proxy: &FaultProxy,
    fault: Fault,
    length: Duration,
    out: &Path,
    total: usize,
) -> Duration {
    proxy.set(fault);
    tokio::time::sleep(length).await;
    let before = output_lines(out);
    proxy.set(Fault::None);
    if before >= total {
        return Duration::ZERO;
    }
    eventually(
        &format!("progress after {fault:?} ({before} of {total} written)"),
        Duration::from_secs(60),
        || output_lines(out) > before,
    )
    .await
}

/// Waits for the run to exit and checks the job: completed, each line once with its own
/// answer, and the gateway asked once per line.
fn finished(mut child: Child, out: &Path, lines: &[String], env: &Env, sent_before: u64) {
    let status = wait(&mut child, Duration::from_secs(120));
    assert!(status.success(), "{status:?}\n{}", log_of(out));
    let results = Results::read(out);
    results.assert_each_once(lines);
    results.assert_answers_match(lines);
    assert_eq!(batch_json(out)["status"], "completed");
    assert_eq!(
        env.gateway.stats().total - sent_before,
        lines.len() as u64,
        "sends = lines"
    );
}

fn wait(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let until = Instant::now() + limit;
    loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            return status;
        }
        assert!(
            Instant::now() < until,
            "the processor did not exit within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An env whose dispatcher answers `per_sec` lines a second or so (fixed 100 ms answers, a
/// few at once), so that a job of `n` lines spans the faults; the lines, config and dispatcher.
async fn paced(n: usize, workers: usize) -> (Env, Vec<String>, PathBuf, DispatcherHandle) {
    one_pool(fixed_latency(Duration::from_millis(100)), n, |c| {
        c.concurrency = workers;
        c.batch_size = 50;
    })
    .await
}

async fn started(out: &Path, lines: usize) {
    eventually("first results", Duration::from_secs(60), || {
        let n = output_lines(out);
        n > 0 && n < lines
    })
    .await;
}

/// Three cuts of 5 s, one of 12 s (longer than the lease's TTL), and 12 s of held replies:
/// after each, results are read again within seconds, and the process does not take its own
/// lease for another's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cuts_are_recovered_from_within_seconds() {
    let (env, lines, config, sim) = paced(5500, 8).await;
    let proxy = FaultProxy::start(env.redis.port());
    let config = config_via(&env, &config, &proxy, "cut");
    let out = env.path("out");
    let child = start(&config, &env.path("in.jsonl"), &out);
    started(&out, lines.len()).await;
    let mut resumed = Vec::new();
    for length in [5, 5, 5, 12] {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let took = hold(
            &proxy,
            Fault::Cut,
            Duration::from_secs(length),
            &out,
            lines.len(),
        )
        .await;
        resumed.push(took);
    }
    // Replies held for longer than the lease's TTL while requests pass: Redis keeps renewing
    // the lease the process has given up on, which it must know for its own.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let took = hold(
        &proxy,
        Fault::HoldReplies,
        Duration::from_secs(12),
        &out,
        lines.len(),
    )
    .await;
    resumed.push(took);
    eprintln!("progress resumed after each cut in {resumed:?}");
    finished(child, &out, &lines, &env, 0);
    for took in &resumed {
        assert!(
            *took < RESUME_WITHIN,
            "resumed {took:?} after a cut: {resumed:?}"
        );
    }
    let log = log_of(&out);
    assert!(
        !log.contains("another process reads this result list"),
        "took its own lease for another process's:\n{log}"
    );
    sim.shutdown().await;
}

/// Latency with jitter, a blackhole (nothing answered for 8 s), reset connections, and a link
/// cut into small slices at a low rate, one after another in one job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_held_and_reset_links_lose_nothing() {
    let (env, lines, config, sim) = paced(3000, 8).await;
    let proxy = FaultProxy::start(env.redis.port());
    let config = config_via(&env, &config, &proxy, "slow");
    let out = env.path("out");
    let child = start(&config, &env.path("in.jsonl"), &out);
    started(&out, lines.len()).await;
    let faults = [
        (
            Fault::Latency {
                base: Duration::from_millis(200),
                jitter: Duration::from_millis(100),
            },
            5,
        ),
        (Fault::Blackhole, 8),
        (Fault::ResetPeer, 2),
        (
            Fault::Slow {
                slice: 64,
                bytes_per_sec: 64 * 1024,
            },
            5,
        ),
    ];
    let mut resumed = Vec::new();
    for (fault, length) in faults {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let took = hold(
            &proxy,
            fault,
            Duration::from_secs(length),
            &out,
            lines.len(),
        )
        .await;
        resumed.push((fault, took));
    }
    eprintln!("progress resumed after each fault in {resumed:?}");
    finished(child, &out, &lines, &env, 0);
    for (fault, took) in &resumed {
        assert!(*took < RESUME_WITHIN, "resumed {took:?} after {fault:?}");
    }
    sim.shutdown().await;
}

/// kill -9 while the link is cut; a resume started during the outage waits for Redis (it used
/// to give up after ~3 s) and finishes once the link is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resume_started_during_an_outage_waits_it_out() {
    let (env, lines, config, sim) = paced(2000, 8).await;
    let proxy = FaultProxy::start(env.redis.port());
    let config = config_via(&env, &config, &proxy, "resume");
    let out = env.path("out");
    let mut first = start(&config, &env.path("in.jsonl"), &out);
    started(&out, lines.len()).await;
    proxy.set(Fault::Cut);
    tokio::time::sleep(Duration::from_millis(500)).await;
    first.0.kill().unwrap(); // SIGKILL, during the outage
    first.0.wait().unwrap();
    let second = start(&config, &env.path("in.jsonl"), &out);
    tokio::time::sleep(Duration::from_secs(6)).await;
    let mut second = second;
    assert!(
        second.0.try_wait().unwrap().is_none(),
        "the resume gave up while Redis was out:\n{}",
        log_of(&out)
    );
    proxy.set(Fault::None);
    finished(second, &out, &lines, &env, 0);
    let log = log_of(&out);
    assert_eq!(
        log.matches("Redis not reachable").count(),
        1,
        "one warning for the outage:\n{log}"
    );
    assert!(log.contains("resuming job"), "{log}");
    sim.shutdown().await;
}

/// A SIGTERM while a run waits for Redis at start stops it at once, the job untouched, with
/// the exit code of a paused job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_waiting_for_redis_at_start_pauses() {
    let (env, _lines, config, _sim) = paced(10, 1).await;
    let proxy = FaultProxy::start(env.redis.port());
    proxy.set(Fault::Cut);
    let config = config_via(&env, &config, &proxy, "term");
    let out = env.path("out");
    let mut child = start(&config, &env.path("in.jsonl"), &out);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(child.0.try_wait().unwrap().is_none(), "{}", log_of(&out));
    // SAFETY: a signal to our own child process.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    let status = wait(&mut child, Duration::from_secs(10));
    assert_eq!(status.code(), Some(6), "{}", log_of(&out));
    assert!(log_of(&out).contains("stopped while waiting for Redis"));
}

/// Processes on one pool, each behind its own faulty link: the first's is cut for longer than
/// the lease TTL (so another's standby reader takes its list and parks its results), the
/// second's is slow, the third's (when there is one) holds everything for 8 s then resets.
/// Every job finishes, each line once, whoever read which list.
async fn processes_with_faulty_links(n: usize) {
    let env = Env::start(fixed_latency(Duration::from_millis(100))).await;
    let config = env.async_config(&[("llama-3", "pool-a")], "");
    let sim = env
        .dispatcher(&["pool-a"], |c| {
            c.concurrency = 8;
            c.batch_size = 50;
        })
        .await;
    let mut jobs = Vec::new();
    for (i, name) in ["a", "b", "c"].into_iter().enumerate().take(n) {
        // Other custom_ids in each job, so that a result written to the wrong job would show.
        let input = env.path(&format!("{name}.jsonl"));
        let lines: Vec<String> = write_input(&input, 2000 - 400 * i, &["llama-3"])
            .iter()
            .map(|l| l.replace("req-", &format!("{name}-req-")))
            .collect();
        std::fs::write(&input, lines.join("\n") + "\n").unwrap();
        let link = FaultProxy::start(env.redis.port());
        let out = env.path(&format!("{name}-out"));
        let child = start(&config_via(&env, &config, &link, name), &input, &out);
        started(&out, lines.len()).await;
        jobs.push((lines, link, out, child));
    }
    jobs[1].1.set(Fault::Latency {
        base: Duration::from_millis(50),
        jitter: Duration::from_millis(25),
    });
    let third = async {
        if let Some((lines, link, out, _)) = jobs.get(2) {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let took = hold(
                link,
                Fault::Blackhole,
                Duration::from_secs(8),
                out,
                lines.len(),
            )
            .await;
            link.set(Fault::ResetPeer);
            tokio::time::sleep(Duration::from_millis(500)).await;
            link.set(Fault::None);
            eprintln!("C wrote again {took:?} after its blackhole");
        }
    };
    let (lines, link, out, _) = &jobs[0];
    let (took, ()) = tokio::join!(
        hold(link, Fault::Cut, Duration::from_secs(14), out, lines.len()),
        third
    );
    eprintln!("A wrote again {took:?} after its cut");
    let mut total = 0;
    for (lines, _link, out, mut child) in jobs {
        let status = wait(&mut child, Duration::from_secs(120));
        assert!(status.success(), "{status:?}\n{}", log_of(&out));
        Results::read(&out).assert_each_once(&lines);
        total += lines.len() as u64;
    }
    assert_eq!(env.gateway.stats().total, total, "sends = lines");
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_processes_with_faulty_links_finish_every_line_once() {
    processes_with_faulty_links(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_processes_with_faulty_links_finish_every_line_once() {
    processes_with_faulty_links(3).await;
}

/// A rolling restart of two `processor serve` replicas (SIGTERM, start again, one after the
/// other) while the other replica's link to Redis is cut for 5 s: both batches complete, each
/// line once, sent once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rolling_restart_of_serve_with_a_cut_in_the_middle_loses_nothing() {
    let env = Env::start(fixed_latency(Duration::from_millis(100))).await;
    let sim = env
        .dispatcher(&["pool-a"], |c| {
            c.concurrency = 8;
            c.batch_size = 50;
        })
        .await;
    let storage = env.path("storage");
    std::fs::create_dir_all(&storage).unwrap();
    let base = env.async_config(&[("llama-3", "pool-a")], "");
    let links = [
        FaultProxy::start(env.redis.port()),
        FaultProxy::start(env.redis.port()),
    ];
    let mut replicas: Vec<serve::Service> = links
        .iter()
        .enumerate()
        .map(|(n, link)| {
            let config = config_via(&env, &base, link, &format!("replica-{n}"));
            let own = std::fs::read_to_string(&config).unwrap().replace(
                &format!("work_dir: {}\n", env.path("work").display()),
                &format!("work_dir: {}\n", env.path(&format!("work-{n}")).display()),
            );
            std::fs::write(&config, own).unwrap();
            serve::add_serve_section(
                &config,
                &storage,
                batches::TWO_TENANTS,
                &format!(
                    "  replica_id: replica-{n}\n  lease_ttl: 2s\n  checkpoint_interval: 300ms\n"
                ),
                "",
            );
            serve::Service::start(&config)
        })
        .collect();
    let api = replicas[0].client(Some(batches::KEY_A));
    let mut submitted = Vec::new();
    for name in ["one", "two"] {
        submitted.push(batches::submit(&api, name, 1500).await);
    }
    for (_, id, _) in &submitted {
        api.wait_batch(id, Duration::from_secs(60), "some lines done", |b| {
            batches::count(b, "completed") > 0
        })
        .await;
    }
    for (restarted, cut) in [(0, 1), (1, 0)] {
        links[cut].set(Fault::Cut);
        let (status, took) =
            replicas[restarted].signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
        assert!(
            status.success(),
            "{status:?}\n{}",
            replicas[restarted].all_stderr()
        );
        eprintln!("replica-{restarted} stopped in {took:?} while replica-{cut} was cut off");
        replicas[restarted].restart();
        tokio::time::sleep(Duration::from_secs(5)).await;
        links[cut].set(Fault::None);
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let api = replicas[1].client(Some(batches::KEY_A));
    let mut lines = 0;
    for (_, id, batch_lines) in &submitted {
        let batch = api.wait_final(id, Duration::from_secs(180)).await;
        assert_eq!(batch["status"], "completed", "{batch}");
        let results = api.results(&batch).await;
        results.assert_each_once(batch_lines);
        results.assert_answers_match(batch_lines);
        lines += batch_lines.len() as u64;
    }
    assert_eq!(env.gateway.stats().total, lines, "sends = lines");
    sim.shutdown().await;
}

/// The dispatcher's own link to Redis cut 3 × 5 s: it waits, and the job still ends with
/// every line once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cuts_between_the_dispatcher_and_redis_lose_nothing() {
    let env = Env::start(fixed_latency(Duration::from_millis(100))).await;
    let (lines, config) = one_pool_job(&env, 3000);
    let proxy = FaultProxy::start(env.redis.port());
    let url = proxy.redis_url();
    let sim = env
        .dispatcher(&["pool-a"], |c| {
            c.redis_url = url;
            c.concurrency = 8;
            c.batch_size = 50;
        })
        .await;
    let out = env.path("out");
    let child = start(&config, &env.path("in.jsonl"), &out);
    started(&out, lines.len()).await;
    let mut resumed = Vec::new();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let took = hold(
            &proxy,
            Fault::Cut,
            Duration::from_secs(5),
            &out,
            lines.len(),
        )
        .await;
        resumed.push(took);
    }
    eprintln!(
        "progress resumed after each dispatcher cut in {resumed:?}; dispatcher {:?}",
        sim.stats()
    );
    finished(child, &out, &lines, &env, 0);
    for took in &resumed {
        assert!(
            *took < RESUME_WITHIN,
            "resumed {took:?} after a cut: {resumed:?}"
        );
    }
    sim.shutdown().await;
}

/// A Redis that stays down is waited for until the job's deadline, no longer: then the run
/// fails with the usual clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_past_the_deadline_ends_the_wait() {
    let (env, _lines, config, _sim) = paced(10, 1).await;
    let proxy = FaultProxy::start(env.redis.port());
    proxy.set(Fault::Cut);
    let config = config_via(&env, &config, &proxy, "deadline");
    let out = env.path("out");
    let started = Instant::now();
    let run = run_cmd(&config, &env.path("in.jsonl"), &out)
        .args(["--completion-window", "4s"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("cannot reach Redis at redis://127.0.0.1:"),
        "{stderr}"
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(3),
        "gave up before the deadline: {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(30),
        "waited past the deadline: {waited:?}"
    );
}
