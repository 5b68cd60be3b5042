//! Helpers for tests that need real parts.
//!
//! [`RedisServer`] starts a real `redis-server` bound to 127.0.0.1 on a free port, with its data
//! in a temporary directory, waits until it answers `PING`, and kills it when dropped (also when
//! the test panics). Never the shared port 6379, never a non-loopback address.
//!
//! ```no_run
//! use batch_testkit::RedisServer;
//!
//! let redis = RedisServer::start();
//! assert!(redis.url().starts_with("redis://127.0.0.1:"));
//! assert_eq!(redis.command(&["PING"]), "+PONG");
//! // Dropped here: the server is killed and its directory removed.
//! ```
//!
//! With `RedisServer::builder().aof(true)` data survives [`RedisServer::restart`], so tests can
//! simulate a Redis restart without losing what was written.
//!
//! [`S3Server`] does the same for S3: a real `moto_server` (PyPI's `moto`, installed into the
//! project's virtualenv by `scripts/test.sh`) with a bucket, its endpoint and credentials given as
//! the AWS environment variables.
//!
//! With the `e2e` feature, the module `e2e` is the rig of the end-to-end tests: a Redis, the simulated
//! gateway and dispatcher, configs, and checks on a job's result files.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub use tempfile::{tempdir, TempDir};

use process::Process;

/// Damages `bytes` in one place, for tests that hold a hand-written reader to serde's answer on
/// broken input: `how` 0 inserts `byte` before index `at`, 1 removes the byte at `at`, 2
/// replaces it; past the end, `byte` is appended. `at` is taken modulo `bytes.len() + 1`.
pub fn damage(bytes: &mut Vec<u8>, at: usize, byte: u8, how: u8) {
    let at = at % (bytes.len() + 1);
    match how {
        0 => bytes.insert(at, byte),
        1 if at < bytes.len() => {
            bytes.remove(at);
        }
        _ if at < bytes.len() => bytes[at] = byte,
        _ => bytes.push(byte),
    }
}

mod cluster;
#[cfg(feature = "e2e")]
pub mod e2e;
pub mod http;
mod process;
mod prometheus;
mod proxy;
mod s3;
mod sentinel;
mod tls;

pub use cluster::RedisCluster;
pub use prometheus::PrometheusServer;
pub use proxy::{Fault, FaultProxy, ProxyStats};
pub use s3::{moto_binary, S3Server, S3_BUCKET};
pub use sentinel::RedisSentinels;
pub use tls::{ClientAuth, TestPki, TlsRedis};

const INSTALL_HINT: &str = "redis-server is not installed; install it with \
    `sudo apt-get install -y redis-server` (Debian/Ubuntu) or `brew install redis` (macOS), \
    or set REDIS_SERVER_BIN to its path";

/// The demo's batch input file, `examples/batch/demo.jsonl`: 40 chat requests to the models
/// `llama-3` and `mistral` (`scripts/demo.sh` and the crates' examples run it).
pub fn demo_input() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/batch/demo.jsonl")
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0 to find a free port")
}

/// How to start a [`RedisServer`].
#[derive(Debug, Clone, Default)]
pub struct RedisBuilder {
    aof: bool,
    args: Vec<String>,
}

impl RedisBuilder {
    /// Append-only persistence (fsync always), so data survives [`RedisServer::restart`].
    pub fn aof(mut self, on: bool) -> Self {
        self.aof = on;
        self
    }

    /// More `redis-server` arguments (`--cluster-enabled yes`, `--replicaof 127.0.0.1 P`),
    /// also used by [`RedisServer::restart`].
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Starts the server; panics with an actionable message when it cannot.
    pub fn start(self) -> RedisServer {
        let dir = tempfile::Builder::new()
            .prefix("batch-testkit-redis-")
            .tempdir()
            .expect("creating a temporary directory for redis-server");
        let mut server = RedisServer {
            process: Process::default(),
            port: 0,
            dir,
            aof: self.aof,
            args: self.args,
        };
        // The free port can be taken between probing and binding; try a few.
        for _ in 0..5 {
            server.port = free_port();
            let child = server
                .spawn(&binary())
                .unwrap_or_else(|e| panic!("could not start redis-server: {e}"));
            server.process.set(child);
            match server.wait_ready() {
                Ok(()) => return server,
                Err(e) => {
                    server.kill();
                    let log = std::fs::read_to_string(server.dir.path().join("redis.log"))
                        .unwrap_or_default();
                    if !log.contains("Address already in use") {
                        panic!("redis-server did not become ready: {e}\n--- redis.log ---\n{log}");
                    }
                }
            }
        }
        panic!("redis-server found no free port in 5 tries");
    }
}

pub(crate) fn binary() -> String {
    std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into())
}

fn spawn(bin: &str, port: u16, dir: &Path, aof: bool, extra: &[String]) -> Result<Child, String> {
    let mut cmd = Command::new(bin);
    cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string()])
        .arg("--dir")
        .arg(dir)
        .args(["--logfile", "redis.log", "--save", "", "--daemonize", "no"])
        .args(["--protected-mode", "yes"]);
    if aof {
        cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
    } else {
        cmd.args(["--appendonly", "no"]);
    }
    cmd.args(extra);
    spawn_command(cmd, bin)
}

/// Spawns a prepared server command: no stdio, killed with its parent, an install hint when the
/// binary is missing.
pub(crate) fn spawn_command(mut cmd: Command, bin: &str) -> Result<Child, String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    kill_with_parent(&mut cmd);
    cmd.spawn().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            INSTALL_HINT.to_owned()
        } else {
            format!("spawning {bin}: {e}")
        }
    })
}

/// Asks the kernel to kill the server if the thread that started it dies without dropping it
/// (a test process aborted or killed), so no server outlives its test.
#[cfg(target_os = "linux")]
pub(crate) fn kill_with_parent(cmd: &mut Command) {
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
pub(crate) fn kill_with_parent(_cmd: &mut Command) {}

/// A running `redis-server`, killed when dropped.
#[derive(Debug)]
pub struct RedisServer {
    process: Process,
    port: u16,
    dir: TempDir,
    aof: bool,
    args: Vec<String>,
}

impl RedisServer {
    fn spawn(&self, bin: &str) -> Result<Child, String> {
        spawn(bin, self.port, self.dir.path(), self.aof, &self.args)
    }

    /// Starts a server without persistence. Panics with an install hint if there is none.
    pub fn start() -> Self {
        RedisBuilder::default().start()
    }

    /// Options: see [`RedisBuilder`].
    pub fn builder() -> RedisBuilder {
        RedisBuilder::default()
    }

    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's data directory (also where `redis.log` is).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Writes the URL into a file, as the processor reads it from a mounted secret.
    pub fn write_url_file(&self, dir: &Path) -> PathBuf {
        let path = dir.join("redis-url");
        std::fs::write(&path, format!("{}\n", self.url())).expect("writing the redis-url file");
        path
    }

    /// Kills the server (as `kill -9` would). [`RedisServer::restart`] brings it back.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Whether the server process is running.
    pub fn is_running(&mut self) -> bool {
        self.process.is_running()
    }

    /// Kills the server if it runs, then starts it again on the same port and directory.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.spawn(&binary()) {
                Ok(child) => {
                    self.process.set(child);
                    match self.wait_ready() {
                        Ok(()) => return,
                        Err(e) if Instant::now() > deadline => {
                            panic!("redis-server did not restart: {e}")
                        }
                        Err(_) => self.kill(),
                    }
                }
                Err(e) => panic!("could not restart redis-server: {e}"),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs one command over a plain connection, for assertions and set-up in tests. Status and
    /// error replies come back as their line (`+OK`, `-ERR ...`), integers as `:3`, bulk strings
    /// as their payload (nil as `(nil)`), arrays as their elements joined by newlines.
    pub fn command(&self, args: &[&str]) -> String {
        self.command_list(args).join("\n")
    }

    /// Like [`RedisServer::command`], with an array reply split into its elements.
    pub fn command_list(&self, args: &[&str]) -> Vec<String> {
        command_on(self.port, args)
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let port = self.port;
        self.process.wait_ready(
            "redis-server",
            "PONG",
            Duration::from_secs(10),
            Duration::from_millis(10),
            || ping(port),
        )
    }
}

/// Runs one command on the plaintext port `port` of 127.0.0.1; replies as
/// [`RedisServer::command_list`] gives them.
pub fn command_on(port: u16, args: &[&str]) -> Vec<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connecting to redis");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("setting a read timeout");
    let mut req = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        req.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        req.extend_from_slice(a.as_bytes());
        req.extend_from_slice(b"\r\n");
    }
    stream.write_all(&req).expect("writing to redis");
    let mut reader = BufReader::new(stream);
    match read_line(&mut reader).split_at(1) {
        ("*", n) => {
            let n: i64 = n.parse().expect("array length");
            (0..n.max(0)).map(|_| read_scalar(&mut reader)).collect()
        }
        (kind, rest) => vec![scalar(&mut reader, kind, rest)],
    }
}

fn read_line(reader: &mut impl BufRead) -> String {
    let mut line = String::new();
    reader.read_line(&mut line).expect("reading from redis");
    line.trim_end_matches(['\r', '\n']).to_owned()
}

fn read_scalar(reader: &mut impl BufRead) -> String {
    let line = read_line(reader);
    let (kind, rest) = line.split_at(1);
    scalar(reader, kind, rest)
}

fn scalar(reader: &mut impl BufRead, kind: &str, rest: &str) -> String {
    match kind {
        "$" => {
            let Ok(len) = rest.parse::<usize>() else {
                return "(nil)".into();
            };
            let mut buf = vec![0; len + 2];
            reader.read_exact(&mut buf).expect("reading a bulk reply");
            buf.truncate(len);
            String::from_utf8_lossy(&buf).into_owned()
        }
        "*" => {
            let n: i64 = rest.parse().expect("array length");
            (0..n.max(0))
                .map(|_| read_scalar(reader))
                .collect::<Vec<_>>()
                .join(" ")
        }
        _ => format!("{kind}{rest}"),
    }
}

pub(crate) fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    // Loading an AOF answers -LOADING; only +PONG means ready.
    stream.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_answers_and_stops() {
        let mut redis = RedisServer::start();
        let port = redis.port();
        assert_ne!(port, 6379);
        assert_eq!(redis.command(&["PING"]), "+PONG");
        assert_eq!(redis.command(&["SET", "k", "v"]), "+OK");
        assert_eq!(redis.command(&["GET", "k"]), "v");
        assert_eq!(redis.command(&["GET", "nothing"]), "(nil)");
        redis.command(&["RPUSH", "l", "a b", "c"]);
        assert_eq!(
            redis.command_list(&["LRANGE", "l", "0", "-1"]),
            ["a b", "c"]
        );
        assert_eq!(
            redis.command_list(&["LRANGE", "empty", "0", "-1"]),
            Vec::<String>::new()
        );
        assert!(redis.command(&["NOSUCHCOMMAND"]).starts_with("-ERR"));
        assert!(redis.is_running());
        drop(redis);
        assert!(!ping(port), "server still answers after drop");
    }

    #[test]
    fn aof_survives_restart_and_plain_does_not() {
        let mut durable = RedisServer::builder().aof(true).start();
        durable.command(&["RPUSH", "l", "a", "b"]);
        durable.restart();
        assert_eq!(durable.command(&["LLEN", "l"]), ":2");

        let mut volatile = RedisServer::start();
        volatile.command(&["RPUSH", "l", "a"]);
        volatile.restart();
        assert_eq!(volatile.command(&["LLEN", "l"]), ":0");
    }

    #[test]
    fn killed_on_panic() {
        let port = std::thread::spawn(|| {
            let redis = RedisServer::start();
            let port = redis.port();
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                let _redis = redis;
                panic!("test failure");
            }))
            .unwrap_err();
            port
        })
        .join()
        .unwrap();
        assert!(!ping(port));
    }

    #[test]
    fn missing_binary_names_the_fix() {
        let err = spawn(
            "/nonexistent/redis-server",
            free_port(),
            Path::new("/tmp"),
            false,
            &[],
        )
        .unwrap_err();
        assert!(err.contains("apt-get install -y redis-server"), "{err}");
    }
}
