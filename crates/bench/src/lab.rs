//! The bench's own Redis, scratch directory and processor configs.

use std::path::{Path, PathBuf};
use std::process::Command;

use batch_config::ProcessorConfig;
use batch_testkit::{RedisServer, TempDir};
use fred::clients::Client;
use fred::interfaces::{ClientLike, SortedSetsInterface};
use fred::types::CustomCommand;

use crate::inputs::{MODEL, POOL};
use crate::BenchError;

/// A Redis server on a free loopback port and a scratch directory, both removed when dropped.
pub struct Lab {
    redis: RedisServer,
    dir: TempDir,
    redis_url_file: PathBuf,
    client: Client,
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
        // The test kit panics when the server cannot start; turn that into an error.
        let redis = std::panic::catch_unwind(RedisServer::start).map_err(|panic| {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            BenchError::Check(format!("redis-server did not start: {why}"))
        })?;
        let dir = batch_testkit::tempdir()
            .map_err(|e| BenchError::io(Path::new("a temporary directory"), e))?;
        let redis_url_file = redis.write_url_file(dir.path());
        let client = connect(&redis.url()).await?;
        Ok(Self {
            redis,
            dir,
            redis_url_file,
            client,
        })
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn redis_url(&self) -> String {
        self.redis.url()
    }

    /// The Redis port.
    pub fn redis_port(&self) -> u16 {
        self.redis.port()
    }

    /// Closes the client; the server and the directory go when the lab is dropped.
    pub async fn stop(self) {
        let _ = self.client.quit().await;
    }

    /// A client of the lab's Redis.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Empties Redis between runs.
    pub async fn flush_redis(&self) -> Result<(), BenchError> {
        let cmd = CustomCommand::new_static("FLUSHALL", None, false);
        let _: String = self.client.custom(cmd, Vec::<String>::new()).await?;
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
        let yaml = format!(
            "dispatch_mode: async\nredis_url_file: {}\nwork_dir: {}\n\
             async_dispatch:\n  result_poll_timeout: 100ms\n  consumer_id: {consumer_id}\n\
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

/// A client of `url`, with the processor's own connection settings.
pub async fn connect(url: &str) -> Result<Client, BenchError> {
    Ok(batch_redis::connect(url, &batch_redis::ConnectOptions::default()).await?)
}

/// Loads a config file written by [`Lab`].
pub fn load(path: &Path) -> Result<ProcessorConfig, BenchError> {
    ProcessorConfig::load(path).map_err(|e| BenchError::Config(e.to_string()))
}
