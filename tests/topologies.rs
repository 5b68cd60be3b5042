//! The `processor` binary on Redis as production runs it: a 3-primary Cluster (kill -9 and a
//! resume, a cancel), TLS and mutual TLS, a plaintext server refused, and ACL users. The
//! processor and the simulated dispatcher both connect the same ways. The executor's jobs on a
//! Cluster and through a Sentinel failover are in `crates/executor/tests/jobs/topologies.rs`.

mod support;

use std::process::Stdio;
use std::time::Duration;

use batch_redis::RedisTls;
use batch_testkit::{ClientAuth, RedisCluster, RedisServer, TlsRedis};
use dispatcher_sim::{DispatcherVersion, GatewayConfig};
use fred::interfaces::{KeysInterface, SortedSetsInterface};
use support::*;

const QUEUE: &str = "llm-d-async:requests:pool-a";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_job_resumes_after_kill_9_and_a_cancel_empties_its_queue() {
    let cluster = RedisCluster::start(3);
    let rig = Rig::new(cluster.url(), None).await;
    let lines = write_input(&rig.path("in.jsonl"), 10_000, &["llama-3"]);
    let config = rig.config(&cluster.url(), "", "");
    let sim = rig.dispatcher(|c| c.batch_size = 50).await;
    let out = rig.path("out");
    let mut first = Child(
        run_cmd(&config, &rig.path("in.jsonl"), &out)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually("some results", Duration::from_secs(120), || {
        std::fs::read_to_string(out.join("output.jsonl")).is_ok_and(|t| t.lines().count() >= 1000)
    })
    .await;
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    run_ok(&config, &rig.path("in.jsonl"), &out);
    let results = Results::read(&out);
    results.assert_answered(&lines);
    sim.shutdown().await;

    // A second job, gate closed, cancelled with Ctrl-C: nothing of it stays queued.
    // Shut as the real gate is shut: its key at 0 (not set would be open).
    let client = rig.client().await;
    let _: () = client
        .set(dispatcher_sim::DEFAULT_BUDGET_KEY, 0, None, None, false)
        .await
        .unwrap();
    let closed = rig.dispatcher(redis_gate).await;
    write_input(&rig.path("cancel.jsonl"), 10_000, &["llama-3"]);
    let cancel_out = rig.path("cancel-out");
    let mut child = Child(
        run_cmd(&config, &rig.path("cancel.jsonl"), &cancel_out)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut queued = 0;
    for _ in 0..600 {
        queued = client.zcard::<u64, _>(QUEUE).await.unwrap();
        if queued == 10_000 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(queued, 10_000, "the job was not enqueued");
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGINT) };
    let status = child.0.wait().unwrap();
    assert_eq!(status.code(), Some(5));
    assert_eq!(
        client.zcard::<u64, _>(QUEUE).await.unwrap(),
        0,
        "members left queued"
    );
    let results = Results::read(&cancel_out);
    assert_eq!(results.error_codes().get("batch_cancelled"), Some(&10_000));
    closed.shutdown().await;
}

async fn tls_job(auth: ClientAuth) {
    let server = TlsRedis::start(auth);
    let pki = server.pki().clone();
    let tls = RedisTls {
        ca_file: Some(pki.ca.clone()),
        cert_file: Some(pki.client_cert.clone()),
        key_file: Some(pki.client_key.clone()),
        server_name: None,
    };
    let rig = Rig::new(server.url(), Some(tls)).await;
    let lines = write_input(&rig.path("in.jsonl"), 300, &["llama-3"]);
    let root = format!(
        "redis_tls:\n  ca_file: {}\n  cert_file: {}\n  key_file: {}\n",
        pki.ca.display(),
        pki.client_cert.display(),
        pki.client_key.display()
    );
    let config = rig.config(&server.url(), &root, "");
    let sim = rig.dispatcher(|_| {}).await;
    let out = rig.path("out");
    run_ok(&config, &rig.path("in.jsonl"), &out);
    let results = Results::read(&out);
    results.assert_answered(&lines);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_runs_over_tls_and_over_mutual_tls() {
    tls_job(ClientAuth::Optional).await;
    tls_job(ClientAuth::Required).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rediss_against_a_plaintext_server_is_refused() {
    let plain = RedisServer::start();
    let rig = Rig::new(plain.url(), None).await;
    write_input(&rig.path("in.jsonl"), 5, &["llama-3"]);
    let url = format!("rediss://:s3cret@127.0.0.1:{}", plain.port());
    let config = rig.config(&url, "", "");
    let run = run_cmd(&config, &rig.path("in.jsonl"), &rig.path("out"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("plaintext"), "says what is wrong: {stderr}");
    assert!(
        !stderr.contains("s3cret"),
        "the password was printed: {stderr}"
    );
}

/// The README's `ACL SETUSER batch ...` rule, `>PASSWORD` replaced.
fn documented_rule(password: &str) -> Vec<String> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let line = readme
        .lines()
        .find(|l| l.starts_with("ACL SETUSER batch "))
        .expect("the README documents the ACL rule");
    line.split_whitespace()
        .map(|a| a.replace(">PASSWORD", &format!(">{password}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_acl_user_with_the_documented_rule_runs_a_job_and_one_without_fails_clearly() {
    let env = Env::start(GatewayConfig::default()).await;
    let rule = documented_rule("pw-batch");
    let args: Vec<&str> = rule.iter().map(String::as_str).collect();
    assert_eq!(env.redis.command(&args), "+OK");
    assert_eq!(
        env.redis.command(&[
            "ACL", "SETUSER", "weak", "on", ">pw-weak", "~*", "-@all", "+ping", "+hello", "+auth",
            "+client"
        ]),
        "+OK"
    );
    let (lines, config) = one_pool_job(&env, 200);
    let url = format!("redis://batch:pw-batch@127.0.0.1:{}", env.redis.port());
    std::fs::write(&env.redis_url_file, &url).unwrap();
    let sim = env
        .dispatcher(&["pool-a"], |c| c.version = DispatcherVersion::V0_9)
        .await;
    run_ok(&config, &env.path("in.jsonl"), &env.path("out"));
    Results::read(&env.path("out")).assert_each_once(&lines);

    let weak = format!("redis://weak:pw-weak@127.0.0.1:{}", env.redis.port());
    std::fs::write(&env.redis_url_file, &weak).unwrap();
    let run = run_cmd(&config, &env.path("in.jsonl"), &env.path("weak-out"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "{stderr}");
    assert!(
        stderr.contains("NOPERM"),
        "names the missing permission: {stderr}"
    );
    assert!(
        !stderr.contains("pw-weak"),
        "the password was printed: {stderr}"
    );
    sim.shutdown().await;
}
