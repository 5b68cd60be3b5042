//! Jobs end to end on Redis as production runs it: a 3-primary Cluster, a Sentinel-managed
//! primary that fails over mid-job, TLS and mutual TLS, and ACL users. The processor and the
//! simulated dispatcher both connect the same ways.

mod support;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use batch_executor::{Executor, JobSpec};
use batch_redis::{ConnectOptions, RedisTls};
use batch_testkit::{ClientAuth, RedisCluster, RedisSentinels, RedisServer, TempDir, TlsRedis};
use batch_wire::BatchStatus;
use dispatcher_sim::{
    Dispatcher, DispatcherConfig, DispatcherHandle, DispatcherVersion, Gateway, GatewayConfig,
    GatewayHandle, QueueEntry,
};
use fred::interfaces::{KeysInterface, SortedSetsInterface};
use support::*;
use tokio_util::sync::CancellationToken;

const QUEUE: &str = "llm-d-async:requests:pool-a";

/// A gateway, a directory, and a Redis URL of any form.
struct Rig {
    gateway: GatewayHandle,
    dir: TempDir,
    url: String,
    tls: Option<RedisTls>,
}

impl Rig {
    async fn new(url: String, tls: Option<RedisTls>) -> Rig {
        let gateway = Gateway::start("127.0.0.1:0".parse().unwrap(), GatewayConfig::default())
            .await
            .unwrap();
        Rig {
            gateway,
            dir: batch_testkit::tempdir().unwrap(),
            url,
            tls,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// An async config for model llama-3 on pool-a; `root_extra` is more top-level YAML.
    fn config(&self, url: &str, root_extra: &str, async_extra: &str) -> PathBuf {
        let url_file = self.path("redis-url");
        std::fs::write(&url_file, format!("{url}\n")).unwrap();
        let yaml = format!(
            "dispatch_mode: async\nredis_url_file: {}\nwork_dir: {}\n{root_extra}async_dispatch:\n  result_poll_timeout: 200ms\n{async_extra}model_gateways:\n  llama-3:\n    inference_pool_name: pool-a\n",
            url_file.display(),
            self.path("work").display()
        );
        let path = self.path("processor.yaml");
        std::fs::write(&path, yaml).unwrap();
        path
    }

    async fn dispatcher(&self, configure: impl FnOnce(&mut DispatcherConfig)) -> DispatcherHandle {
        let mut q = QueueEntry::new(QUEUE);
        q.igw_base_url = Some(self.gateway.base_url());
        q.request_path_url = Some("/v1/chat/completions".into());
        let mut config = DispatcherConfig::new(self.url.clone(), vec![q]);
        config.redis_tls = self.tls.clone();
        config.poll_interval = Duration::from_millis(20);
        config.batch_size = 500;
        config.sim.time_scale = 0.01;
        configure(&mut config);
        Dispatcher::start(config, None).await.unwrap()
    }

    async fn client(&self) -> fred::clients::Client {
        let options = ConnectOptions {
            tls: self.tls.clone(),
            ..ConnectOptions::default()
        };
        batch_redis::connect(&self.url, &options).await.unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_lines_on_a_cluster_complete_exactly_once() {
    let cluster = RedisCluster::start(3);
    let rig = Rig::new(cluster.url(), None).await;
    let lines = write_input(&rig.path("in.jsonl"), 10_000, &["llama-3"]);
    let config = rig.config(&cluster.url(), "", "");
    let sim = rig.dispatcher(|_| {}).await;
    let executor = Executor::new(load(&config)).await.unwrap();
    let out = rig.path("out");
    let batch = tokio::time::timeout(
        Duration::from_secs(300),
        executor.run(
            JobSpec::new(rig.path("in.jsonl"), &out),
            CancellationToken::new(),
        ),
    )
    .await
    .expect("the job finished")
    .unwrap();
    assert_eq!(batch.status, BatchStatus::Completed);
    let results = Results::read(&out);
    results.assert_answered(&lines);
    let client = rig.client().await;
    assert_eq!(client.zcard::<u64, _>(QUEUE).await.unwrap(), 0);
    executor.shutdown().await;
    sim.shutdown().await;
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_survives_a_sentinel_failover() {
    let mut sentinels = RedisSentinels::start();
    let rig = Rig::new(sentinels.url(), None).await;
    let lines = write_input(&rig.path("in.jsonl"), 3000, &["llama-3"]);
    // Writes the old primary took but never passed on are lost in a failover: what goes
    // missing comes back through the lost-request check.
    let config = rig.config(&sentinels.url(), "", "  lost_request_timeout: 2s\n");
    let sim = rig.dispatcher(|c| c.batch_size = 20).await;
    let executor = Executor::new(load(&config)).await.unwrap();
    let out = rig.path("out");
    let run = executor.run(
        JobSpec::new(rig.path("in.jsonl"), &out),
        CancellationToken::new(),
    );
    tokio::pin!(run);
    let some = async {
        eventually("some results", Duration::from_secs(120), || {
            std::fs::read_to_string(out.join("output.jsonl"))
                .is_ok_and(|t| t.lines().count() >= 300)
        })
        .await
    };
    tokio::select! { _ = some => {}, _ = &mut run => panic!("finished before the failover") }
    let old = sentinels.kill_primary();
    let new = tokio::task::spawn_blocking(move || {
        let new = sentinels.wait_failover(old);
        (sentinels, new)
    });
    let (sentinels, new) = tokio::select! {
        r = new => r.unwrap(),
        _ = &mut run => panic!("finished during the failover"),
    };
    assert_ne!(new, old);
    let batch = tokio::time::timeout(Duration::from_secs(300), run)
        .await
        .expect("finished after the failover")
        .unwrap();
    assert_eq!(batch.status, BatchStatus::Completed);
    Results::read(&out).assert_each_once(&lines);
    executor.shutdown().await;
    sim.shutdown().await;
    drop(sentinels);
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
