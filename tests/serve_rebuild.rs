//! Rebuilding the service's Redis state from storage on its own terms (issue #29): `/ready`
//! fails while a loss is being repaired and answers again once the state is back;
//! `processor serve --rebuild-state` puts back what Redis lost though its marker survived, and
//! prints what it found; a batch caught finalizing when Redis forgets still ends once.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use batch_testkit::S3Server;
use dispatcher_sim::{GatewayConfig, DEFAULT_BUDGET_KEY};
use serde_json::Value;
use support::serve::*;
use support::*;

const KEY: &str = "sk-rebuild-0001";
/// The service's Redis keys under the default `serve.state_prefix`.
fn keys() -> batch_state::StateKeys {
    batch_state::StateKeys::new("batch-processor")
}

/// Polls `check` every 100 ms until it holds, or panics after `limit` naming `what`.
async fn eventually(what: &str, limit: Duration, mut check: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < limit, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A completed batch of `n` lines of the tenant, with its lines.
async fn completed_batch(api: &Api, name: &str, n: usize) -> (Value, Vec<String>) {
    let (text, lines) = input_jsonl(name, n, "llama-3");
    let file = api
        .upload_ok(&format!("{name}.jsonl"), text.as_bytes())
        .await;
    let created = api.create_batch_ok(&file).await;
    let id = created["id"].as_str().unwrap();
    let batch = api.wait_final(id, Duration::from_secs(120)).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    (batch, lines)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ready_fails_while_the_lost_state_waits_for_its_rebuild_and_answers_after() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = async_service(&env, &[(KEY, "alpha")], "", "");
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let service = Service::start(&config);
    let api = service.client(Some(KEY));
    let probe = service.client(None);
    let (batch, lines) = completed_batch(&api, "before", 5).await;
    assert_eq!(probe.get("/ready").await.status, 200);

    // Another replica holds the rebuild lock; the state's marker goes (as after a FLUSHALL).
    let lock = keys().rebuild_lock();
    assert_eq!(
        env.redis
            .command(&["SET", &lock, "another-replica", "PX", "60000"]),
        "+OK"
    );
    assert_eq!(env.redis.command(&["DEL", &keys().state()]), ":1");
    eventually(
        "/ready fails once the loss is noticed",
        Duration::from_secs(10),
        async || probe.get("/ready").await.status == 503,
    )
    .await;
    // It keeps failing, and says why, as long as the rebuild has not been done.
    for _ in 0..10 {
        let ready = probe.get("/ready").await;
        assert_eq!(ready.status, 503, "{}", ready.text());
        assert!(
            ready.text().contains("lost the service's state"),
            "{}",
            ready.text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The other replica goes away without rebuilding: this one takes the lock and rebuilds.
    assert_eq!(env.redis.command(&["DEL", &lock]), ":1");
    eventually(
        "/ready answers after the rebuild",
        Duration::from_secs(10),
        async || probe.get("/ready").await.status == 200,
    )
    .await;
    let again = api.batch(batch["id"].as_str().unwrap()).await;
    assert_eq!(again["status"], "completed", "{again}");
    api.results(&again).await.assert_each_once(&lines);
    let log = service.all_stderr();
    assert!(log.contains("Redis lost the service's state"), "{log}");
    assert!(
        log.contains("rebuilt the service's state from storage"),
        "{log}"
    );
    drop(service);
    sim.shutdown().await;
}

/// A child process killed when dropped, so that a failing test leaves none behind.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `processor serve --rebuild-state` and returns it with its first two stdout lines.
fn serve_rebuilding(config: &std::path::Path) -> (Killed, String, String) {
    let mut child = Command::new(PROCESSOR)
        .args([
            "serve",
            "--rebuild-state",
            "--listen",
            "127.0.0.1:0",
            "--config",
        ])
        .arg(config)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawning processor serve --rebuild-state");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let child = Killed(child);
    let (mut first, mut second) = (String::new(), String::new());
    out.read_line(&mut first).unwrap();
    out.read_line(&mut second).unwrap();
    // Drained, so that a later write never fails.
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    (child, first, second)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rebuild_state_puts_back_a_lost_record_and_reports_what_it_found() {
    let env = Env::start(GatewayConfig::default()).await;
    let config = async_service(&env, &[(KEY, "alpha")], "", "");
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;
    let service = Service::start(&config);
    let api = service.client(Some(KEY));
    let (lost, lines) = completed_batch(&api, "lost", 6).await;
    let (kept, _) = completed_batch(&api, "kept", 4).await;
    drop(service);

    // One batch's record goes; the marker stays, so a plain start sees no loss.
    let id = lost["id"].as_str().unwrap();
    assert_eq!(env.redis.command(&["DEL", &keys().batch(id)]), ":1");
    let plain = Service::start(&config);
    assert_eq!(
        plain
            .client(Some(KEY))
            .get(&format!("/v1/batches/{id}"))
            .await
            .status,
        404
    );
    drop(plain);

    let config_for = config.clone();
    let (child, first, second) = tokio::task::spawn_blocking(move || serve_rebuilding(&config_for))
        .await
        .unwrap();
    let base = first
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("first line {first:?}"))
        .to_owned();
    let report: Value = serde_json::from_str(
        second
            .trim()
            .strip_prefix("rebuilt the state from storage: ")
            .unwrap_or_else(|| panic!("second line {second:?}")),
    )
    .unwrap();
    assert_eq!(report["batches"], 1, "{report}");
    assert_eq!(report["finished"], 1, "{report}");
    assert_eq!(report["queued"], 0, "{report}");
    assert_eq!(report["resumed"], 0, "{report}");
    assert_eq!(report["unreadable"], 0, "{report}");
    assert!(
        report["present"].as_u64().unwrap() >= 1,
        "the kept batch and the files were there: {report}"
    );

    let rebuilt = Api::new(&base, Some(KEY));
    let back = rebuilt.batch(id).await;
    assert_eq!(back["status"], "completed", "{back}");
    assert_eq!(back["request_counts"], lost["request_counts"], "{back}");
    rebuilt.results(&back).await.assert_each_once(&lines);
    let listed = ids(&rebuilt.list_all("/v1/batches", "", 10).await);
    assert_eq!(
        listed,
        vec![kept["id"].as_str().unwrap(), id],
        "newest first, both listed"
    );
    drop(child);
    sim.shutdown().await;
}

/// A batch whose last answers came while S3 hung is caught in `finalizing` (its result files
/// cannot go up) when Redis forgets everything. Once S3 answers again, the state is rebuilt
/// and the batch completes, each line once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_caught_finalizing_when_redis_forgets_completes_each_line_once() {
    let env = Env::start(GatewayConfig::default()).await;
    let s3 = S3Server::start();
    let config = async_service(&env, &[(KEY, "alpha")], "", "");
    let yaml = std::fs::read_to_string(&config).unwrap();
    let file_storage = format!("storage: file://{}", env.path("storage").display());
    assert!(yaml.contains(&file_storage), "{yaml}");
    let yaml = yaml.replace(&file_storage, &format!("storage: s3://{}/svc", s3.bucket()));
    std::fs::write(&config, yaml).unwrap();
    let sim = env
        .dispatcher(&["pool-a"], |c| {
            closed_gate(c);
            c.batch_size = 1;
        })
        .await;
    let gate = |open: bool| {
        env.redis
            .command(&["SET", DEFAULT_BUDGET_KEY, if open { "1" } else { "0" }]);
    };
    // A budget key that is not set leaves the gate open: shut it first.
    gate(false);
    let service = Launch::new(&config).s3(&s3).start();
    let api = service.client(Some(KEY));
    let (text, lines) = input_jsonl("fin", 40, "llama-3");
    let file = api.upload_ok("fin.jsonl", text.as_bytes()).await;
    let id = api.create_batch_ok(&file).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    gate(true);
    api.wait_batch(&id, Duration::from_secs(120), "10 lines done", |b| {
        b["request_counts"]["completed"].as_u64() >= Some(10)
    })
    .await;
    gate(false);

    // S3 hangs; the last answers come; the job ends and cannot upload its files.
    s3.freeze();
    gate(true);
    let start = Instant::now();
    loop {
        let batch = api.batch(&id).await;
        if batch["status"] == "finalizing" {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "not finalizing: {batch}\n{}",
            service.stderr_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(env.redis.command(&["FLUSHALL"]), "+OK");
    s3.thaw();

    // Found again once the loss is noticed and the state rebuilt (the bound: 30 s).
    let path = format!("/v1/batches/{id}");
    eventually(
        "the batch found again",
        Duration::from_secs(30),
        async || api.get(&path).await.status == 200,
    )
    .await;
    let done = api.wait_final(&id, Duration::from_secs(120)).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["request_counts"]["completed"], 40, "{done}");
    api.results(&done).await.assert_each_once(&lines);
    let listed = ids(&api.list_all("/v1/batches", "", 10).await);
    assert_eq!(listed, vec![id.clone()]);
    let log = service.all_stderr();
    assert!(log.contains("Redis lost the service's state"), "{log}");
    drop(service);
    sim.shutdown().await;
}
