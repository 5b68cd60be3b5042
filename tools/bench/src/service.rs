//! A `processor serve` child process and an HTTP client of its API, for the serve scenarios.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hyper::StatusCode;
use serde_json::Value;

use crate::child::log_tail;
use crate::BenchError;

mod client;

pub(crate) use client::Api;

/// How long the service may take to print its `listening on` line.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the service may take to exit after SIGTERM (the interface promises 10 s).
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// A running `processor serve`, killed when dropped (and when the bench dies:
/// `PR_SET_PDEATHSIG`).
pub(crate) struct Service {
    child: Option<Child>,
    base: String,
    log: PathBuf,
}

impl Service {
    /// Starts `processor serve --config CONFIG --listen 127.0.0.1:0` with its log in `log`
    /// and waits for its `listening on http://…` line.
    ///
    /// Spawned from an async worker thread, not a blocking one: `PR_SET_PDEATHSIG` follows the
    /// thread that spawned the child, and blocking threads exit when idle.
    pub(crate) async fn start(
        processor: &Path,
        config: &Path,
        log: &Path,
    ) -> Result<Self, BenchError> {
        let stderr = std::fs::File::create(log).map_err(|e| BenchError::io(log, e))?;
        let mut cmd = Command::new(processor);
        cmd.arg("serve")
            .arg("--config")
            .arg(config)
            .args(["--listen", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        crate::child::config_only(&mut cmd);
        crate::child::die_with_parent(&mut cmd);
        let mut child = cmd
            .spawn()
            .map_err(|e| BenchError::Tool(format!("{} serve: {e}", processor.display())))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut first = String::new();
            let _ = reader.read_line(&mut first);
            let _ = tx.send(first);
            // Keep reading so a later write to stdout never fails.
            let _ = std::io::copy(&mut reader, &mut std::io::sink());
        });
        let mut service = Self {
            child: Some(child),
            base: String::new(),
            log: log.to_owned(),
        };
        let deadline = Instant::now() + START_TIMEOUT;
        let line = loop {
            match tokio::time::timeout(Duration::from_millis(50), &mut rx).await {
                Ok(Ok(line)) => break line,
                Err(_) if Instant::now() < deadline => {
                    if let Some(status) = service.exited() {
                        return Err(service.failed(&format!("exited ({status}) before listening")));
                    }
                }
                _ => return Err(service.failed("printed no `listening on` line")),
            }
        };
        match line.trim().strip_prefix("listening on ") {
            Some(url) if url.starts_with("http://127.0.0.1:") => {
                service.base = url.trim_end_matches('/').to_owned();
                Ok(service)
            }
            _ => Err(service.failed(&format!(
                "printed {:?} instead of `listening on http://127.0.0.1:PORT`",
                line.trim()
            ))),
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// The service's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The exit status, if it has exited.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    /// An error naming what went wrong, with the end of the service's log; kills it.
    fn failed(&mut self, what: &str) -> BenchError {
        self.kill();
        BenchError::Tool(format!(
            "processor serve {what}; last lines of its log ({}):\n{}",
            self.log.display(),
            log_tail(&self.log)
        ))
    }

    /// Kills it with SIGKILL (no chance to pause its jobs or let go of their leases) and
    /// reaps it.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends SIGTERM and waits for the exit (blocking, at most [`STOP_TIMEOUT`]); fails
    /// unless it exits 0 in time (then it is killed).
    pub(crate) fn stop(mut self) -> Result<Duration, BenchError> {
        let Some(child) = self.child.as_mut() else {
            return Ok(Duration::ZERO);
        };
        let started = Instant::now();
        // SAFETY: plain syscall on our own child's pid, which is not reaped yet.
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
        }
        loop {
            match child.try_wait() {
                Ok(Some(status)) if status.success() => {
                    self.child = None;
                    return Ok(started.elapsed());
                }
                Ok(Some(status)) => {
                    self.child = None;
                    return Err(BenchError::Tool(format!(
                        "processor serve exited {status} after SIGTERM; last lines of its log ({}):\n{}",
                        self.log.display(),
                        log_tail(&self.log)
                    )));
                }
                Ok(None) if started.elapsed() < STOP_TIMEOUT => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    return Err(
                        self.failed(&format!("did not exit within {STOP_TIMEOUT:?} of SIGTERM"))
                    )
                }
            }
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `VmRSS` and `VmHWM` of `pid`, MiB.
pub(crate) fn rss_mib(pid: u32) -> Option<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?;
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<f64>()
                .ok()
        })
    };
    Some((field("VmRSS:")? / 1024.0, field("VmHWM:")? / 1024.0))
}

/// How the bench configures one `processor serve`: its directory holds `config.yaml`,
/// `serve.log` and the `work/` directory.
#[derive(Debug, Clone)]
pub(crate) struct ServeSetup {
    /// The service's own directory.
    pub(crate) dir: PathBuf,
    /// The storage directory (shared by replicas).
    pub(crate) storage: PathBuf,
    /// `serve.max_active_jobs`.
    pub(crate) max_active_jobs: usize,
    /// `serve.state_prefix`.
    pub(crate) state_prefix: &'static str,
    /// `serve.replica_id`, `serve.lease_ttl` and `serve.checkpoint_interval`, when set.
    pub(crate) replica: Option<ReplicaSetup>,
    /// `async_dispatch.lost_request_timeout`, when set.
    pub(crate) lost_request_timeout: Option<Duration>,
    /// Sync mode: the gateway's URL and `concurrency.per_endpoint` (and `global`), fixed (no
    /// limiter). Async mode through the dispatcher when `None`.
    pub(crate) sync: Option<(String, usize)>,
}

/// The replica keys of a [`ServeSetup`].
#[derive(Debug, Clone)]
pub(crate) struct ReplicaSetup {
    pub(crate) id: String,
    pub(crate) lease_ttl: Duration,
    pub(crate) checkpoint_interval: Duration,
}

impl ServeSetup {
    /// An async-mode service in `dir`, with its storage in `dir/storage`.
    pub(crate) fn new(dir: &Path, max_active_jobs: usize, state_prefix: &'static str) -> Self {
        Self {
            dir: dir.to_owned(),
            storage: dir.join("storage"),
            max_active_jobs,
            state_prefix,
            replica: None,
            lost_request_timeout: None,
            sync: None,
        }
    }

    /// The service's `work_dir`.
    pub(crate) fn work_dir(&self) -> PathBuf {
        self.dir.join("work")
    }

    /// The config file's text, naming the Redis URL in `redis_url_file`.
    fn yaml(&self, redis_url_file: &Path) -> String {
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        let (mode, model, extra) = match &self.sync {
            None => (
                "async",
                format!("inference_pool_name: {}", crate::inputs::POOL),
                format!(
                    "async_dispatch:\n  result_poll_timeout: 100ms\n{}",
                    self.lost_request_timeout
                        .map(|t| format!("  lost_request_timeout: {}\n", ms(t)))
                        .unwrap_or_default()
                ),
            ),
            Some((url, limit)) => (
                "sync",
                format!("url: {url}"),
                format!(
                    "concurrency:\n  global: {limit}\n  per_endpoint: {limit}\n  aimd:\n    enabled: false\n"
                ),
            ),
        };
        let replica = self
            .replica
            .as_ref()
            .map(|r| {
                format!(
                    "  replica_id: {}\n  lease_ttl: {}\n  checkpoint_interval: {}\n",
                    r.id,
                    ms(r.lease_ttl),
                    ms(r.checkpoint_interval)
                )
            })
            .unwrap_or_default();
        format!(
            "dispatch_mode: {mode}\nredis_url_file: {}\nwork_dir: {}\n{extra}\
             model_gateways:\n  {}:\n    {model}\n\
             serve:\n  listen: 127.0.0.1:0\n  storage: file://{}\n  max_active_jobs: {}\n  \
             state_prefix: {}\n{replica}",
            redis_url_file.display(),
            self.work_dir().display(),
            crate::inputs::MODEL,
            self.storage.display(),
            self.max_active_jobs,
            self.state_prefix,
        )
    }

    /// Writes the config and starts the service with it.
    pub(crate) async fn start(
        &self,
        lab: &crate::lab::Lab,
        processor: &Path,
    ) -> Result<Service, BenchError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| BenchError::io(&self.dir, e))?;
        let config = self.dir.join("config.yaml");
        std::fs::write(&config, self.yaml(lab.redis_url_file()))
            .map_err(|e| BenchError::io(&config, e))?;
        Service::start(processor, &config, &self.dir.join("serve.log")).await
    }
}

/// Stops a service (SIGTERM, as the interface says it must stop: within 10 s, exit 0).
pub(crate) async fn stop(service: Service) -> Result<(), BenchError> {
    crate::scenarios::blocking(move || service.stop().map(|_| ())).await
}

/// The 1-minute load average, as /proc/loadavg has it.
pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "unknown".into())
}

/// CPU time (user + system) `pid` has used so far, seconds (`/proc/<pid>/stat`).
pub(crate) fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces: the fields after it start past its closing parenthesis.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf reads a constant of the system.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (per_second > 0).then(|| ticks / per_second as f64)
}

/// The `id` of a File or Batch object, or an error naming `what` returned it.
pub(crate) fn id_of(object: &Value, what: &str) -> Result<String, BenchError> {
    object["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| BenchError::Check(format!("{what}: no id in {object}")))
}

/// The body of `POST /v1/batches` for `file_id` (chat completions, 24 h).
pub(crate) fn batch_request(file_id: &str) -> Value {
    serde_json::json!({
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    })
}

/// Uploads `input` through `api`; the body of a `POST /v1/batches` naming it.
pub(crate) async fn upload_for_batches(api: &Api, input: &Path) -> Result<Value, BenchError> {
    let file = api.upload(input, Duration::from_secs(60)).await?;
    Ok(batch_request(&id_of(&file, "POST /v1/files")?))
}

/// Creates `count` batches of `body`, the k-th through `apis[k % apis.len()]`, `in_flight` at a
/// time; their ids, in creation order.
pub(crate) async fn create_batches(
    apis: &[Api],
    body: &Value,
    count: usize,
    in_flight: usize,
) -> Result<Vec<String>, BenchError> {
    use futures::StreamExt;
    let created: Vec<Result<Value, BenchError>> = futures::stream::iter(0..count)
        .map(|k| {
            let api = &apis[k % apis.len()];
            async move {
                api.post_json("/v1/batches", body)
                    .await?
                    .json("POST /v1/batches")
            }
        })
        .buffered(in_flight)
        .collect()
        .await;
    let mut ids = Vec::with_capacity(created.len());
    for batch in created {
        let batch = batch?;
        match batch["id"].as_str() {
            Some(id) if id.starts_with("batch_") => ids.push(id.to_owned()),
            _ => {
                return Err(BenchError::Check(format!(
                    "POST /v1/batches: no batch id in {batch}"
                )))
            }
        }
    }
    Ok(ids)
}

/// Polls `GET /v1/batches` every `poll` until every batch of `ids` completed with `lines`
/// lines, each a success (checked in the first one's output file); fails when one ends
/// otherwise or `limit` passes. Returns the time since `started` at which the last one was
/// seen completed.
pub(crate) async fn wait_completed(
    api: &Api,
    ids: &[String],
    lines: usize,
    started: Instant,
    poll: Duration,
    limit: Duration,
) -> Result<f64, BenchError> {
    let mine: std::collections::HashSet<&str> = ids.iter().map(String::as_str).collect();
    loop {
        let batches = api.all_batches().await?;
        let seen = started.elapsed().as_secs_f64();
        let mut completed = Vec::new();
        for b in batches
            .iter()
            .filter(|b| b["id"].as_str().is_some_and(|id| mine.contains(id)))
        {
            match b["status"].as_str() {
                Some("completed") => completed.push(b),
                Some("failed" | "expired" | "cancelled" | "cancelling") => {
                    return Err(BenchError::Check(format!(
                        "batch {} ended {}: {}",
                        b["id"], b["status"], b["errors"]
                    )))
                }
                _ => {}
            }
        }
        if completed.len() == ids.len() {
            for b in &completed {
                let done = b["request_counts"]["completed"].as_u64();
                if done != Some(lines as u64) {
                    return Err(BenchError::Check(format!(
                        "batch {} completed with request_counts {}",
                        b["id"], b["request_counts"]
                    )));
                }
            }
            check_output(api, completed[0], lines).await?;
            return Ok(seen);
        }
        if started.elapsed() > limit {
            return Err(BenchError::Check(format!(
                "{} of {} batches completed within {limit:?}",
                completed.len(),
                ids.len()
            )));
        }
        tokio::time::sleep(poll).await;
    }
}

/// Fails unless the batch's output file has one success line per input line.
async fn check_output(api: &Api, batch: &Value, lines: usize) -> Result<(), BenchError> {
    let id = batch["output_file_id"].as_str().ok_or_else(|| {
        BenchError::Check(format!(
            "batch {} completed without an output file",
            batch["id"]
        ))
    })?;
    let path = format!("/v1/files/{id}/content");
    let reply = api.get(&path).await?;
    if reply.status != StatusCode::OK {
        return Err(BenchError::Check(format!("GET {path}: {}", reply.status)));
    }
    let text = String::from_utf8_lossy(&reply.body);
    let ok = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<Value>(l)
                .is_ok_and(|v| v["response"]["status_code"].as_u64() == Some(200))
        })
        .count();
    if ok != lines {
        return Err(BenchError::Check(format!(
            "GET {path}: {ok} successful lines of {lines}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_of_this_process_is_read_from_proc() {
        let ballast = vec![1u8; 64 << 20];
        let (rss, hwm) = rss_mib(std::process::id()).expect("/proc/self/status");
        assert!(rss >= 64.0, "VmRSS {rss} MiB with 64 MiB in use");
        assert!(hwm >= rss, "VmHWM {hwm} below VmRSS {rss}");
        assert_eq!(ballast.iter().map(|&b| b as usize).sum::<usize>(), 64 << 20);
        assert!(rss_mib(u32::MAX).is_none());
    }

    #[test]
    fn cpu_time_of_this_process_grows_with_work() {
        let before = cpu_seconds(std::process::id()).expect("/proc/self/stat");
        let started = Instant::now();
        let mut x = 0u64;
        while started.elapsed() < Duration::from_millis(300) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let after = cpu_seconds(std::process::id()).expect("/proc/self/stat");
        assert!(
            after - before >= 0.1,
            "{before} s → {after} s after 300 ms of work"
        );
        assert!(cpu_seconds(u32::MAX).is_none());
    }

    #[test]
    fn the_configs_written_for_services_are_what_the_service_loads() {
        let dir = batch_testkit::tempdir().unwrap();
        let url_file = dir.path().join("redis-url");
        std::fs::write(&url_file, "redis://127.0.0.1:1\n").unwrap();
        let load = |setup: &ServeSetup| {
            let path = dir.path().join("config.yaml");
            std::fs::write(&path, setup.yaml(&url_file)).unwrap();
            batch_config::ProcessorConfig::load_service(&path)
                .unwrap_or_else(|e| panic!("{e}\n{}", setup.yaml(&url_file)))
        };
        let plain = ServeSetup::new(&dir.path().join("s"), 7, "pre");
        let c = load(&plain);
        assert_eq!(c.dispatch_mode, batch_config::DispatchMode::Async);
        assert_eq!(
            (c.serve.max_active_jobs, c.serve.state_prefix.as_str()),
            (7, "pre")
        );
        assert_eq!(c.work_dir, dir.path().join("s").join("work"));
        assert_eq!(
            c.async_dispatch.lost_request_timeout,
            Duration::from_secs(600)
        );

        let replica = ServeSetup {
            storage: dir.path().join("shared"),
            replica: Some(ReplicaSetup {
                id: "r2".into(),
                lease_ttl: Duration::from_secs(5),
                checkpoint_interval: Duration::from_millis(1500),
            }),
            lost_request_timeout: Some(Duration::from_secs(4)),
            ..plain.clone()
        };
        let c = load(&replica);
        assert_eq!(c.serve.replica_id, "r2");
        assert_eq!(c.serve.lease_ttl, Duration::from_secs(5));
        assert_eq!(c.serve.checkpoint_interval, Duration::from_millis(1500));
        assert_eq!(
            c.async_dispatch.lost_request_timeout,
            Duration::from_secs(4)
        );
        assert!(c.serve.storage.ends_with("/shared"), "{}", c.serve.storage);

        let sync = ServeSetup {
            sync: Some(("http://127.0.0.1:9".into(), 32)),
            ..replica
        };
        let c = load(&sync);
        assert_eq!(c.dispatch_mode, batch_config::DispatchMode::Sync);
        assert_eq!((c.concurrency.global, c.concurrency.per_endpoint), (32, 32));
        assert!(!c.concurrency.aimd.enabled);
        assert_eq!(c.serve.replica_id, "r2");
    }

    #[tokio::test]
    async fn a_program_that_prints_no_listening_line_is_an_error_with_its_log() {
        let dir = batch_testkit::tempdir().unwrap();
        let script = dir.path().join("fake-processor");
        std::fs::write(
            &script,
            "#!/bin/sh\necho 'refused: bad config' >&2\necho nope\n",
        )
        .unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let log = dir.path().join("log");
        let err = Service::start(&script, Path::new("c.yaml"), &log)
            .await
            .err()
            .expect("no listening line")
            .to_string();
        assert!(
            err.contains("\"nope\"") && err.contains("refused: bad config"),
            "{err}"
        );
    }
}
