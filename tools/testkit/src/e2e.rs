//! The rig of the end-to-end tests, shared by the executor's tests (in process) and the
//! `processor` binary's (`tests/` at the workspace root): a real Redis, the simulated gateway
//! and dispatcher, and a temporary directory ([`Env`], or [`Rig`] for a Redis of any topology);
//! input files and configs written into it; and the checks on the result files that every test
//! repeats ([`Results`]). Nothing here knows the executor's types, so a crate may take this
//! module as a dev-dependency without a second copy of itself. Behind the `e2e` feature.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use batch_redis::{ConnectOptions, RedisTls};
use batch_wire::{hash::body_digest, InputLine};
use dispatcher_sim::{
    Dispatcher, DispatcherConfig, DispatcherHandle, Gateway, GatewayHandle, QueueEntry,
    DEFAULT_BUDGET_KEY,
};
pub use dispatcher_sim::{DispatcherVersion, GatewayConfig};
use serde_json::Value;

use crate::{RedisServer, TempDir};

pub mod api;
pub mod tenants;

/// The request queue of `pool-a`, the pool of the usual job.
pub const POOL_A_QUEUE: &str = "llm-d-async:requests:pool-a";

/// Two async tests in a module named after `scenario`, `v0_9` and `v0_10`, each running
/// `scenario(version)` against that dispatcher release.
#[macro_export]
macro_rules! both_versions {
    ($scenario:ident) => {
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn v0_9() {
                super::$scenario($crate::e2e::DispatcherVersion::V0_9).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn v0_10() {
                super::$scenario($crate::e2e::DispatcherVersion::V0_10).await;
            }
        }
    };
}

/// A gateway answering every request after `latency`, the rest as by default.
pub fn fixed_latency(latency: Duration) -> GatewayConfig {
    GatewayConfig {
        latency_fixed: latency,
        ..GatewayConfig::default()
    }
}

/// The usual job: `n` lines of `llama-3` written to the env's `in.jsonl`, and an async config
/// sending them to `pool-a`; the lines and the config's path.
pub fn one_pool_job(env: &Env, n: usize) -> (Vec<String>, PathBuf) {
    let lines = write_input(&env.path("in.jsonl"), n, &["llama-3"]);
    (lines, env.async_config(&[("llama-3", "pool-a")], ""))
}

/// The usual async rig: an env with `gateway`, the usual job of `n` lines ([`one_pool_job`]) and
/// a dispatcher for `pool-a` configured by `configure`: the env, the lines, the config's path and
/// the dispatcher.
pub async fn one_pool(
    gateway: GatewayConfig,
    n: usize,
    configure: impl FnOnce(&mut DispatcherConfig),
) -> (Env, Vec<String>, PathBuf, DispatcherHandle) {
    let env = Env::start(gateway).await;
    let (lines, config) = one_pool_job(&env, n);
    let sim = env.dispatcher(&["pool-a"], configure).await;
    (env, lines, config, sim)
}

/// [`one_pool`] with the dispatcher release `version`.
pub async fn one_pool_version(
    gateway: GatewayConfig,
    n: usize,
    version: DispatcherVersion,
    configure: impl FnOnce(&mut DispatcherConfig),
) -> (Env, Vec<String>, PathBuf, DispatcherHandle) {
    one_pool(gateway, n, |c| {
        c.version = version;
        configure(c);
    })
    .await
}

/// Writes `n` chat requests, model `models[i % len]`, and returns the lines.
pub fn write_input(path: &Path, n: usize, models: &[&str]) -> Vec<String> {
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let model = models[i % models.len()];
            let system = ["You are terse.", "Answer in French."][i % 2];
            serde_json::json!({
                "custom_id": format!("req-{i}"),
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": format!("question number {i}")}
                    ],
                    "max_tokens": 8
                }
            })
            .to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").expect("writing the input file");
    lines
}

/// Everything a test needs around a processor: a Redis, a gateway, a temp dir.
pub struct Env {
    /// The Redis of the queues and of the service's state.
    pub redis: RedisServer,
    /// The simulated inference gateway.
    pub gateway: GatewayHandle,
    /// Inputs, configs, work and output directories.
    pub dir: TempDir,
    /// The file holding the Redis URL, as the configs name it.
    pub redis_url_file: PathBuf,
}

impl Env {
    /// A fresh Redis, a gateway configured by `gateway`, an empty directory.
    pub async fn start(gateway: GatewayConfig) -> Env {
        let redis = RedisServer::start();
        let gateway = Gateway::start("127.0.0.1:0".parse().unwrap(), gateway)
            .await
            .expect("starting the gateway");
        let dir = crate::tempdir().unwrap();
        let redis_url_file = redis.write_url_file(dir.path());
        Env {
            redis,
            gateway,
            dir,
            redis_url_file,
        }
    }

    /// `name` in the env's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// An async config: `pools` maps model → pool; `async_extra` holds more `async_dispatch`
    /// lines (indented by two spaces).
    pub fn async_config(&self, pools: &[(&str, &str)], async_extra: &str) -> PathBuf {
        let mut yaml = format!(
            "dispatch_mode: async\nredis_url_file: {}\nwork_dir: {}\nasync_dispatch:\n  result_poll_timeout: 200ms\n{async_extra}model_gateways:\n",
            self.redis_url_file.display(),
            self.path("work").display()
        );
        for (model, pool) in pools {
            yaml.push_str(&format!("  {model}:\n    inference_pool_name: {pool}\n"));
        }
        let path = self.path("processor.yaml");
        std::fs::write(&path, yaml).unwrap();
        path
    }

    /// A sync config: every model goes to this env's gateway; `extra` is appended YAML.
    pub fn sync_config(&self, models: &[&str], model_extra: &str, extra: &str) -> PathBuf {
        let mut yaml = format!(
            "dispatch_mode: sync\nwork_dir: {}\nmodel_gateways:\n",
            self.path("work").display()
        );
        for model in models {
            yaml.push_str(&format!(
                "  {model}:\n    url: {}\n{model_extra}",
                self.gateway.base_url()
            ));
        }
        yaml.push_str(extra);
        let path = self.path("processor.yaml");
        std::fs::write(&path, yaml).unwrap();
        path
    }

    /// Starts the simulated dispatcher on the given pools, fast polling, gate wide open unless
    /// `configure` changes it.
    pub async fn dispatcher(
        &self,
        pools: &[&str],
        configure: impl FnOnce(&mut DispatcherConfig),
    ) -> DispatcherHandle {
        let queues = pools
            .iter()
            .map(|pool| {
                let mut q = QueueEntry::new(format!("llm-d-async:requests:{pool}"));
                q.igw_base_url = Some(self.gateway.base_url());
                q.request_path_url = Some("/v1/chat/completions".into());
                q
            })
            .collect();
        let mut config = DispatcherConfig::new(self.redis.url(), queues);
        config.poll_interval = Duration::from_millis(20);
        config.batch_size = 500;
        config.sim.time_scale = 0.01;
        config.version = DispatcherVersion::V0_9;
        configure(&mut config);
        Dispatcher::start(config, None)
            .await
            .expect("starting the dispatcher")
    }

    /// Like [`Env::dispatcher`], behaving like the given release.
    pub async fn dispatcher_version(
        &self,
        pools: &[&str],
        version: DispatcherVersion,
        configure: impl FnOnce(&mut DispatcherConfig),
    ) -> DispatcherHandle {
        self.dispatcher(pools, |c| {
            c.version = version;
            configure(c);
        })
        .await
    }
}

/// The lines of `output.jsonl` and `error.jsonl` in `dir`.
pub struct Results {
    /// The lines of `output.jsonl`.
    pub output: Vec<Value>,
    /// The lines of `error.jsonl`.
    pub error: Vec<Value>,
}

impl Results {
    /// Reads both files of `dir`; a missing file has no lines.
    pub fn read(dir: &Path) -> Results {
        let read = |name: &str| -> Vec<Value> {
            match std::fs::read_to_string(dir.join(name)) {
                Ok(text) => text
                    .lines()
                    .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{name}: {e}: {l}")))
                    .collect(),
                Err(_) => Vec::new(),
            }
        };
        Results {
            output: read("output.jsonl"),
            error: read("error.jsonl"),
        }
    }

    /// Panics unless every custom_id of `lines` appears exactly once across both files.
    pub fn assert_each_once(&self, lines: &[String]) {
        let mut seen: HashMap<String, usize> = HashMap::new();
        for l in self.output.iter().chain(&self.error) {
            *seen
                .entry(l["custom_id"].as_str().unwrap().to_owned())
                .or_default() += 1;
        }
        let doubled: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
        assert!(
            doubled.is_empty(),
            "custom_ids written more than once: {doubled:?}"
        );
        for line in lines {
            let input: Value = serde_json::from_str(line).unwrap();
            let id = input["custom_id"].as_str().unwrap();
            assert!(seen.contains_key(id), "{id} has no line");
        }
        assert_eq!(seen.len(), lines.len(), "lines of unknown requests");
        for l in &self.output {
            assert!(l["error"].is_null() && l["response"].is_object(), "{l}");
        }
        for l in &self.error {
            assert!(
                l["response"].is_null() && l["error"]["code"].is_string(),
                "{l}"
            );
        }
    }

    /// Panics unless each 200 answer carries the digest of its own input body.
    pub fn assert_answers_match(&self, lines: &[String]) {
        let digests: BTreeMap<String, String> = lines
            .iter()
            .map(|l| {
                let input: InputLine = serde_json::from_str(l).unwrap();
                (
                    input.custom_id.into_owned(),
                    body_digest(input.body.get().as_bytes()),
                )
            })
            .collect();
        let mut checked = 0;
        for l in &self.output {
            if l["response"]["status_code"] != 200 {
                continue;
            }
            let custom_id = l["custom_id"].as_str().unwrap();
            let body_id = l["response"]["body"]["id"].as_str().unwrap();
            assert_eq!(
                body_id,
                format!("chatcmpl-{}", digests[custom_id]),
                "{custom_id} got the answer of another request"
            );
            checked += 1;
        }
        assert!(checked > 0, "no 200 answers to check");
    }

    /// [`Results::assert_each_once`], and the error lines are `n` of code `code`, no other.
    #[track_caller]
    pub fn assert_each_once_with_errors(&self, lines: &[String], code: &str, n: u64) {
        self.assert_each_once(lines);
        assert_eq!(
            self.error_codes(),
            BTreeMap::from([(code.to_owned(), n as usize)])
        );
    }

    /// [`Results::assert_each_once`] and [`Results::assert_answers_match`]: every line answered
    /// once, each by the answer to its own request.
    #[track_caller]
    pub fn assert_answered(&self, lines: &[String]) {
        self.assert_each_once(lines);
        self.assert_answers_match(lines);
    }

    /// How many error lines carry each error code.
    pub fn error_codes(&self) -> BTreeMap<String, usize> {
        let mut codes = BTreeMap::new();
        for l in &self.error {
            *codes
                .entry(l["error"]["code"].as_str().unwrap().to_owned())
                .or_default() += 1;
        }
        codes
    }

    /// How many output lines carry each HTTP status.
    pub fn statuses(&self) -> BTreeMap<u64, usize> {
        let mut statuses = BTreeMap::new();
        for l in &self.output {
            *statuses
                .entry(l["response"]["status_code"].as_u64().unwrap())
                .or_default() += 1;
        }
        statuses
    }
}

/// The `batch.json` of the job directory `dir`.
pub fn batch_json(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("batch.json")).unwrap()).unwrap()
}

/// Polls `check` every 20 ms until it holds, for at most `limit`; returns how long it took.
pub async fn eventually(what: &str, limit: Duration, mut check: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !check() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    start.elapsed()
}

/// Lines in `<dir>/output.jsonl` so far.
pub fn output_lines(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("output.jsonl"))
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

/// Every queue of the simulated dispatcher behind a `redis` gate as the real dispatcher takes it:
/// the gate's own `address` (the dispatcher's Redis) and `DEFAULT_BUDGET_KEY` as its budget. The
/// real gate counts a key that is not set as open, so this sets the key to 0 first: nothing is
/// taken until a test sets it above 0. Only for a plain `redis://host:port` URL.
pub fn closed_gate(config: &mut DispatcherConfig) {
    let address = gate_address(&config.redis_url);
    let port = address
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .unwrap_or_else(|| panic!("closed_gate needs a redis://host:port URL, not {address}"));
    let reply = crate::command_on(port, &["SET", DEFAULT_BUDGET_KEY, "0"]);
    assert_eq!(reply, ["+OK"], "shutting the gate");
    redis_gate(config);
}

/// Every queue behind a `redis` gate on `DEFAULT_BUDGET_KEY`, with the `address` the real
/// dispatcher needs; the key's value is left to the test (not set: open, as in the real one).
pub fn redis_gate(config: &mut DispatcherConfig) {
    let address = gate_address(&config.redis_url);
    for q in &mut config.queues {
        q.gate_type = Some("redis".into());
        q.gate_params.insert("address".into(), address.clone());
        q.gate_params
            .insert("budget_key".into(), DEFAULT_BUDGET_KEY.to_owned());
    }
}

/// The first `host:port` of a Redis URL, as a gate's `address`.
fn gate_address(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    rest.split(['/', ',', '?'])
        .next()
        .unwrap_or(rest)
        .to_owned()
}

/// A gateway, a directory, and a Redis URL of any form.
pub struct Rig {
    /// The simulated inference gateway.
    pub gateway: GatewayHandle,
    /// Inputs, configs, work and output directories.
    pub dir: TempDir,
    /// The Redis URL the dispatcher and [`Rig::client`] connect to.
    pub url: String,
    /// Their TLS settings, if the URL needs them.
    pub tls: Option<RedisTls>,
}

impl Rig {
    /// A gateway and a directory beside the Redis at `url`.
    pub async fn new(url: String, tls: Option<RedisTls>) -> Rig {
        let gateway = Gateway::start("127.0.0.1:0".parse().unwrap(), GatewayConfig::default())
            .await
            .unwrap();
        Rig {
            gateway,
            dir: crate::tempdir().unwrap(),
            url,
            tls,
        }
    }

    /// `name` in the rig's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// An async config for model llama-3 on pool-a, Redis at `url`; `root_extra` is more
    /// top-level YAML, `async_extra` more `async_dispatch` lines (indented by two spaces).
    pub fn config(&self, url: &str, root_extra: &str, async_extra: &str) -> PathBuf {
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

    /// Starts the simulated dispatcher on pool-a, fast polling, as `configure` leaves it.
    pub async fn dispatcher(
        &self,
        configure: impl FnOnce(&mut DispatcherConfig),
    ) -> DispatcherHandle {
        let mut q = QueueEntry::new(POOL_A_QUEUE);
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

    /// A client of the rig's Redis, as the processor connects.
    pub async fn client(&self) -> fred::clients::Client {
        let options = ConnectOptions {
            tls: self.tls.clone(),
            ..ConnectOptions::default()
        };
        batch_redis::connect(&self.url, &options).await.unwrap()
    }
}
