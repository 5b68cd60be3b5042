//! `processor serve` for the tests: the binary run on a free loopback port, restarted, signalled
//! and killed, on the config and the client of `batch_testkit::e2e::api` (re-exported here).

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub use batch_testkit::e2e::api::*;

use super::PROCESSOR;

/// A field of `/proc/<pid>/status` in kB (`VmRSS`, `VmHWM`).
pub fn status_kb(pid: i32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("reading status");
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// How to start a [`Service`]: its config, a name for its logs and messages, its `work_dir`
/// when a test needs it, and the environment of its process.
pub struct Launch {
    config: PathBuf,
    name: Option<String>,
    work_dir: Option<PathBuf>,
    env: Vec<(String, String)>,
    env_remove: Vec<String>,
}

impl Launch {
    /// A service of the config at `config`, named after the config's file stem.
    pub fn new(config: &Path) -> Launch {
        Launch {
            config: config.to_owned(),
            name: None,
            work_dir: None,
            env: Vec::new(),
            env_remove: Vec::new(),
        }
    }

    /// Names it (its stderr files are `<config dir>/<name>-serve-<n>.stderr`).
    pub fn name(mut self, name: &str) -> Launch {
        self.name = Some(name.to_owned());
        self
    }

    /// Records its `work_dir` (the config's), for [`Service::work_dir`].
    pub fn work_dir(mut self, dir: &Path) -> Launch {
        self.work_dir = Some(dir.to_owned());
        self
    }

    /// Sets an environment variable of its process.
    pub fn env(mut self, name: &str, value: &str) -> Launch {
        self.env.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Reaches `s3` as a deployment would, through `AWS_*` variables only: none inherited from
    /// this process, no shared AWS files of the machine's user.
    pub fn s3(mut self, s3: &batch_testkit::S3Server) -> Launch {
        self.env_remove.extend(
            std::env::vars()
                .map(|(name, _)| name)
                .filter(|name| name.starts_with("AWS_")),
        );
        self = self
            .env("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
            .env("AWS_CONFIG_FILE", "/nonexistent");
        for (name, value) in s3.env() {
            self = self.env(name, &value);
        }
        self
    }

    /// Starts it: see [`Service::start`].
    pub fn start(self) -> Service {
        let name = self.name.clone().unwrap_or_else(|| {
            self.config
                .file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        });
        let mut service = Service {
            child: None,
            launch: self,
            logs: Vec::new(),
            name,
            base: String::new(),
        };
        service.spawn();
        service
    }
}

/// A running `processor serve`, killed (SIGKILL) when dropped.
///
/// Start and restart it from the test's own thread: the child gets SIGKILL when the thread
/// that spawned it ends (PR_SET_PDEATHSIG), and a runtime's worker may end before the test.
pub struct Service {
    child: Option<std::process::Child>,
    launch: Launch,
    /// The stderr file of each start, in order.
    logs: Vec<PathBuf>,
    name: String,
    /// `http://127.0.0.1:PORT`, as the service printed it.
    pub base: String,
}

impl Service {
    /// Runs `processor serve --config CONFIG --listen 127.0.0.1:0` and waits (60 s at most) for
    /// its `listening on` line. Its stderr goes to `<config dir>/<config stem>-serve-<n>.stderr`.
    /// [`Launch`] starts one with a name, a work_dir or more environment.
    pub fn start(config: &Path) -> Service {
        Launch::new(config).start()
    }

    fn spawn(&mut self) {
        let config = &self.launch.config;
        let log = config.with_file_name(format!(
            "{}-serve-{}.stderr",
            self.name,
            self.logs.len() + 1
        ));
        let stderr = std::fs::File::create(&log).expect("creating the stderr file");
        self.logs.push(log);
        let mut cmd = Command::new(PROCESSOR);
        cmd.arg("serve")
            .arg("--config")
            .arg(config)
            .arg("--listen")
            .arg("127.0.0.1:0")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        for name in &self.launch.env_remove {
            cmd.env_remove(name);
        }
        for (name, value) in &self.launch.env {
            cmd.env(name, value);
        }
        kill_with_parent(&mut cmd);
        let mut child = cmd.spawn().expect("spawning processor serve");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        // Reads the first line, then drains stdout so that a later write never fails.
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut first = String::new();
            let _ = reader.read_line(&mut first);
            let _ = tx.send(first);
            let mut rest = Vec::new();
            let _ = reader.read_to_end(&mut rest);
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let line = loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => break line,
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!(
                        "{}: processor serve printed no line within 60 s; stderr:\n{}",
                        self.name,
                        self.stderr_text()
                    );
                }
            }
        };
        let Some(addr) = line.trim().strip_prefix("listening on ") else {
            let _ = child.kill();
            let status = child.wait();
            panic!(
                "{}: processor serve's first line was {line:?} (exit {status:?}); stderr:\n{}",
                self.name,
                self.stderr_text()
            );
        };
        assert!(
            addr.starts_with("http://127.0.0.1:") || addr.starts_with("https://127.0.0.1:"),
            "not a loopback address: {addr}"
        );
        self.base = addr.trim_end_matches('/').to_owned();
        self.child = Some(child);
    }

    /// Its name: [`Launch::name`], else the config's file stem.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its `work_dir`, as given to [`Launch::work_dir`].
    pub fn work_dir(&self) -> &Path {
        self.launch
            .work_dir
            .as_deref()
            .expect("started without Launch::work_dir")
    }

    /// Everything the service (its latest start) wrote to stderr so far.
    pub fn stderr_text(&self) -> String {
        self.logs
            .last()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    /// Everything every start wrote to stderr, in order.
    pub fn all_stderr(&self) -> String {
        self.logs
            .iter()
            .map(|p| std::fs::read_to_string(p).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n---- restart ----\n")
    }

    /// The last `n` lines of [`Service::all_stderr`]: what explains a hang.
    pub fn stderr_tail(&self, n: usize) -> String {
        let text = self.all_stderr();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Its process id.
    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("the service runs").id() as i32
    }

    /// Sends `signal` (SIGSTOP, SIGCONT, ...) and returns at once.
    pub fn signal(&self, signal: i32) {
        // SAFETY: a signal to our own child process, which has not been waited for.
        let rc = unsafe { libc::kill(self.pid(), signal) };
        assert_eq!(rc, 0, "{}: kill({}, {signal})", self.name, self.pid());
    }

    /// `kill -9`, and waits for the process to be gone.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends `signal` and waits up to `limit` for the exit; returns the status and how long the
    /// exit took.
    pub fn signal_and_wait(&mut self, signal: i32, limit: Duration) -> (ExitStatus, Duration) {
        self.signal(signal);
        let mut child = self.child.take().expect("the service runs");
        let sent = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return (status, sent.elapsed());
            }
            if sent.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "{}: processor serve did not exit within {limit:?} of signal {signal}; \
                     stderr:\n{}",
                    self.name,
                    self.stderr_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts it again with the same config and environment (after [`Service::kill9`] or a
    /// signal, else it is killed first); it listens on a new port.
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// A client sending `key` as its bearer token (none when `None`).
    pub fn client(&self, key: Option<&str>) -> Api {
        Api::new(&self.base, key)
    }

    /// Waits up to `limit` for every gauge of work in flight on `/metrics`
    /// (`model_inflight_requests` of each model, `processor_inflight_requests`,
    /// `batch_service_active_jobs`) to read 0, once its batches ended; panics naming those
    /// that do not. A gauge that is not shown at all counts as 0.
    pub async fn expect_idle_gauges(&self, limit: Duration) {
        let client = self.client(None);
        let start = Instant::now();
        loop {
            let text = client.get("/metrics").await.text();
            let busy: Vec<&str> = text
                .lines()
                .filter(|l| {
                    [
                        "model_inflight_requests",
                        "processor_inflight_requests",
                        "batch_service_active_jobs",
                    ]
                    .iter()
                    .any(|g| l.starts_with(g) && l[g.len()..].starts_with(['{', ' ']))
                })
                .filter(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) != Some(0.0))
                .collect();
            if busy.is_empty() {
                return;
            }
            assert!(
                start.elapsed() < limit,
                "{}: gauges not back to 0 {limit:?} after the batches ended:\n{}",
                self.name,
                busy.join("\n")
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            // A stopped process takes SIGKILL too, but SIGCONT first costs nothing.
            // SAFETY: our own child, not yet waited for.
            unsafe { libc::kill(child.id() as i32, libc::SIGCONT) };
        }
        self.kill9();
    }
}

#[cfg(target_os = "linux")]
fn kill_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn kill_with_parent(_cmd: &mut Command) {}
