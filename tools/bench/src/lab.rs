//! The bench's own Redis (one server, or a Redis Cluster), scratch directory and processor
//! configs.

use std::path::{Path, PathBuf};
use std::process::Command;

use batch_config::ProcessorConfig;
use batch_testkit::{RedisCluster, RedisServer, TempDir};
use fred::clients::Client;
use fred::interfaces::{ClientLike, SortedSetsInterface};
use fred::types::CustomCommand;

use crate::inputs::{MODEL, POOL};
use crate::BenchError;

/// A Redis server (or a Redis Cluster) on free loopback ports and a scratch directory, all
/// removed when dropped.
pub struct Lab {
    redis: Servers,
    dir: TempDir,
    redis_url_file: PathBuf,
    client: Client,
    /// One plain client per primary of a cluster, for what goes to every node (FLUSHALL).
    primaries: Vec<Client>,
}

/// What the lab's Redis is.
enum Servers {
    Single(RedisServer),
    Cluster(RedisCluster),
}

/// Turns a test kit panic (a server that did not start) into an error.
fn started<T>(
    what: &str,
    start: impl FnOnce() -> T + std::panic::UnwindSafe,
) -> Result<T, BenchError> {
    std::panic::catch_unwind(start).map_err(|panic| {
        let why = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        BenchError::Check(format!("{what} did not start: {why}"))
    })
}

/// Checks that `program --version` runs.
fn require(program: &str) -> Result<(), BenchError> {
    match Command::new(program).arg("--version").output() {
        Ok(out) if out.status.success() => Ok(()),
        _ => Err(BenchError::MissingTool(program.to_owned())),
    }
}

impl Lab {
    /// Starts Redis (after checking that `redis-server` and `redis-benchmark` are installed).
    pub async fn start() -> Result<Self, BenchError> {
        require("redis-server")?;
        require("redis-benchmark")?;
        let redis = started("redis-server", RedisServer::start)?;
        Self::around(Servers::Single(redis)).await
    }

    /// Starts a Redis Cluster of `primaries` primaries without replicas (after checking that
    /// `redis-server`, `redis-cli` and `redis-benchmark` are installed).
    pub async fn start_cluster(primaries: usize) -> Result<Self, BenchError> {
        require("redis-server")?;
        require("redis-cli")?;
        require("redis-benchmark")?;
        let cluster = started("the Redis Cluster", move || RedisCluster::start(primaries))?;
        Self::around(Servers::Cluster(cluster)).await
    }

    async fn around(redis: Servers) -> Result<Self, BenchError> {
        let dir = batch_testkit::tempdir()
            .map_err(|e| BenchError::io(Path::new("a temporary directory"), e))?;
        let redis_url_file = dir.path().join("redis-url");
        let url = redis.url();
        std::fs::write(&redis_url_file, format!("{url}\n"))
            .map_err(|e| BenchError::io(&redis_url_file, e))?;
        let client = connect(&url).await?;
        let mut primaries = Vec::new();
        if let Servers::Cluster(cluster) = &redis {
            for node in cluster.nodes() {
                primaries.push(connect(&node.url()).await?);
            }
        }
        Ok(Self {
            redis,
            dir,
            redis_url_file,
            client,
            primaries,
        })
    }

    /// `redis://127.0.0.1:<port>`, or `redis-cluster://127.0.0.1:<port>?node=…`.
    pub fn redis_url(&self) -> String {
        self.redis.url()
    }

    /// The Redis port (of a cluster's first node).
    pub fn redis_port(&self) -> u16 {
        match &self.redis {
            Servers::Single(server) => server.port(),
            Servers::Cluster(cluster) => cluster.nodes()[0].port(),
        }
    }

    /// The number of primaries when the lab runs a Redis Cluster.
    pub fn cluster_primaries(&self) -> Option<usize> {
        match &self.redis {
            Servers::Single(_) => None,
            Servers::Cluster(cluster) => Some(cluster.nodes().len()),
        }
    }

    /// `name` for a report row: as it is on one server, with ` (cluster, N primaries)` on a
    /// cluster.
    pub fn scenario(&self, name: &str) -> String {
        match self.cluster_primaries() {
            None => name.to_owned(),
            Some(n) => format!("{name} (cluster, {n} primaries)"),
        }
    }

    /// The port of the server that holds `key`: on a cluster, the primary owning its slot (as
    /// a node's MOVED redirection names it), so `redis-benchmark` without `--cluster` measures
    /// that one key there.
    pub fn port_of(&self, key: &str) -> Result<u16, BenchError> {
        let port = self.redis_port();
        if self.cluster_primaries().is_none() {
            return Ok(port);
        }
        let reply = batch_testkit::command_on(port, &["TYPE", key]).join("\n");
        match reply.strip_prefix("-MOVED ") {
            None => Ok(port),
            Some(moved) => moved
                .rsplit(':')
                .next()
                .and_then(|p| p.trim().parse().ok())
                .ok_or_else(|| {
                    BenchError::Check(format!(
                        "node 127.0.0.1:{port} redirected {key} to {moved:?}"
                    ))
                }),
        }
    }

    /// Closes the client; the server and the directory go when the lab is dropped.
    pub async fn stop(self) {
        let _ = self.client.quit().await;
        for primary in &self.primaries {
            let _ = primary.quit().await;
        }
    }

    /// The file holding the Redis URL, for configs that name it.
    pub fn redis_url_file(&self) -> &Path {
        &self.redis_url_file
    }

    /// A client of the lab's Redis.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Empties Redis between runs (on a cluster, FLUSHALL on every primary).
    pub async fn flush_redis(&self) -> Result<(), BenchError> {
        let clients = if self.primaries.is_empty() {
            std::slice::from_ref(&self.client)
        } else {
            &self.primaries[..]
        };
        for client in clients {
            let cmd = CustomCommand::new_static("FLUSHALL", None, false);
            let _: String = client.custom(cmd, Vec::<String>::new()).await?;
        }
        Ok(())
    }

    /// `ZCARD key`.
    pub async fn zcard(&self, key: &str) -> Result<u64, BenchError> {
        Ok(self.client.zcard(key).await?)
    }

    /// A path in the scratch directory (created if it is a new subdirectory's parent).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A fresh, empty subdirectory.
    pub fn fresh_dir(&self, name: &str) -> Result<PathBuf, BenchError> {
        let dir = self.path(name);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| BenchError::io(&dir, e))?;
        }
        std::fs::create_dir_all(&dir).map_err(|e| BenchError::io(&dir, e))?;
        Ok(dir)
    }

    /// Writes an async-mode config for the benchmark model, with its own result list
    /// (`consumer_id`) so scenarios never read each other's results; `extra` is more
    /// top-level YAML.
    pub fn async_config(
        &self,
        name: &str,
        consumer_id: &str,
        extra: &str,
    ) -> Result<PathBuf, BenchError> {
        self.async_config_with(name, consumer_id, "", extra)
    }

    /// As [`Lab::async_config`], with `async_extra` more lines of `async_dispatch` (indented by 2).
    pub fn async_config_with(
        &self,
        name: &str,
        consumer_id: &str,
        async_extra: &str,
        extra: &str,
    ) -> Result<PathBuf, BenchError> {
        let yaml = format!(
            "dispatch_mode: async\nredis_url_file: {}\nwork_dir: {}\n\
             async_dispatch:\n  result_poll_timeout: 100ms\n  consumer_id: {consumer_id}\n{async_extra}\
             model_gateways:\n  {MODEL}:\n    inference_pool_name: {POOL}\n\
             input:\n  max_requests: 10000000\n{extra}",
            self.redis_url_file.display(),
            self.path("work").display(),
        );
        self.write(name, &yaml)
    }

    /// Writes a sync-mode config sending the benchmark model to `gateway`; `model_extra` holds
    /// more lines of the model's entry (indented by 4), `extra` more top-level YAML.
    pub fn sync_config(
        &self,
        name: &str,
        gateway: &str,
        model_extra: &str,
        extra: &str,
    ) -> Result<PathBuf, BenchError> {
        let yaml = format!(
            "dispatch_mode: sync\nwork_dir: {}\n\
             model_gateways:\n  {MODEL}:\n    url: {gateway}\n{model_extra}\
             input:\n  max_requests: 10000000\n{extra}",
            self.path("work").display(),
        );
        self.write(name, &yaml)
    }

    fn write(&self, name: &str, yaml: &str) -> Result<PathBuf, BenchError> {
        let path = self.path(name);
        std::fs::write(&path, yaml).map_err(|e| BenchError::io(&path, e))?;
        Ok(path)
    }
}

impl Servers {
    fn url(&self) -> String {
        match self {
            Servers::Single(server) => server.url(),
            Servers::Cluster(cluster) => cluster.url(),
        }
    }
}

/// A client of `url`, with the processor's own connection settings.
pub async fn connect(url: &str) -> Result<Client, BenchError> {
    Ok(batch_redis::connect(url, &batch_redis::ConnectOptions::default()).await?)
}

/// `INFO section` of the Redis `client` is connected to.
pub(crate) async fn info(client: &Client, section: &str) -> Result<String, BenchError> {
    let cmd = CustomCommand::new_static("INFO", None, false);
    Ok(client.custom(cmd, vec![section]).await?)
}

/// The value of `name` (with its colon, `connected_clients:`) in an INFO reply.
pub(crate) fn info_field<T: std::str::FromStr>(info: &str, name: &str) -> Option<T> {
    info.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().parse().ok())
}

/// Loads a config file written by [`Lab`].
pub fn load(path: &Path) -> Result<ProcessorConfig, BenchError> {
    ProcessorConfig::load(path).map_err(|e| BenchError::Config(e.to_string()))
}
