//! A primary, a replica and three Sentinels watching them, on free loopback ports.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::process::Process;
use crate::{binary, command_on, free_port, ping, spawn_command, RedisServer};

/// The name the Sentinels monitor the primary under.
const SERVICE: &str = "batch-primary";

/// One `redis-server --sentinel`, killed when dropped.
#[derive(Debug)]
struct Sentinel {
    process: Process,
    port: u16,
    dir: TempDir,
}

impl Sentinel {
    fn start(primary_port: u16) -> Sentinel {
        // The free port can be taken between probing and binding; try a few.
        for _ in 0..5 {
            let dir = tempfile::Builder::new()
                .prefix("batch-testkit-sentinel-")
                .tempdir()
                .expect("creating a temporary directory for a sentinel");
            let port = free_port();
            // Sentinel rewrites its config file, so it gets one of its own.
            let conf = dir.path().join("sentinel.conf");
            std::fs::write(&conf, sentinel_conf(port, primary_port, dir.path()))
                .expect("writing sentinel.conf");
            let bin = binary();
            let mut cmd = Command::new(&bin);
            cmd.arg(&conf).arg("--sentinel");
            let child = spawn_command(cmd, &bin).unwrap_or_else(|e| panic!("{e}"));
            let sentinel = Sentinel {
                process: Process::default(),
                port,
                dir,
            };
            sentinel.process.set(child);
            let ready = sentinel.process.wait_ready(
                "redis sentinel",
                "PONG",
                Duration::from_secs(10),
                Duration::from_millis(20),
                || ping(port),
            );
            let Err(e) = ready else {
                return sentinel;
            };
            sentinel.process.kill();
            let log = std::fs::read_to_string(sentinel.dir.path().join("sentinel.log"))
                .unwrap_or_default();
            if !log.contains("Address already in use") {
                panic!("redis sentinel did not become ready: {e}\n--- sentinel.log ---\n{log}");
            }
        }
        panic!("redis sentinel found no free port in 5 tries");
    }
}

fn sentinel_conf(port: u16, primary_port: u16, dir: &Path) -> String {
    format!(
        "bind 127.0.0.1\n\
         port {port}\n\
         daemonize no\n\
         protected-mode no\n\
         dir {dir}\n\
         logfile {dir}/sentinel.log\n\
         sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2\n\
         sentinel down-after-milliseconds {SERVICE} 1000\n\
         sentinel failover-timeout {SERVICE} 3000\n\
         sentinel parallel-syncs {SERVICE} 1\n",
        dir = dir.display()
    )
}

/// A primary, one replica and three Sentinels (quorum 2, down after 1 s), all on 127.0.0.1 and
/// all killed when dropped. [`RedisSentinels::kill_primary`] and
/// [`RedisSentinels::wait_failover`] make the Sentinels promote the replica.
///
/// ```no_run
/// use batch_testkit::RedisSentinels;
///
/// let mut sentinels = RedisSentinels::start();
/// assert!(sentinels.url().starts_with("redis-sentinel://127.0.0.1:"));
/// let old = sentinels.kill_primary();
/// let new = sentinels.wait_failover(old);
/// assert_ne!(old, new);
/// ```
#[derive(Debug)]
pub struct RedisSentinels {
    servers: Vec<RedisServer>,
    sentinels: Vec<Sentinel>,
}

impl RedisSentinels {
    /// Starts everything and waits (up to 60 s) until the replica is in sync and every Sentinel
    /// sees the replica and the other two Sentinels.
    pub fn start() -> Self {
        let primary = RedisServer::start();
        let replica = RedisServer::builder()
            .args(["--replicaof", "127.0.0.1", &primary.port().to_string()])
            .start();
        let sentinels = (0..3).map(|_| Sentinel::start(primary.port())).collect();
        let set = RedisSentinels {
            servers: vec![primary, replica],
            sentinels,
        };
        set.wait_ready();
        set
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let synced = self.servers[1]
                .command(&["INFO", "replication"])
                .contains("master_link_status:up");
            let watching = self.sentinels.iter().all(|s| {
                let quorum = command_on(s.port, &["SENTINEL", "CKQUORUM", SERVICE]).join(" ");
                let replicas = command_on(s.port, &["SENTINEL", "REPLICAS", SERVICE]);
                quorum.starts_with("+OK 3 usable") && !replicas.is_empty()
            });
            if synced && watching {
                return;
            }
            if Instant::now() > deadline {
                let states: Vec<String> = self
                    .sentinels
                    .iter()
                    .map(|s| command_on(s.port, &["SENTINEL", "CKQUORUM", SERVICE]).join(" "))
                    .collect();
                panic!(
                    "the sentinels are not ready after 60 s (replica synced: {synced}): {states:?}"
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The name the Sentinels monitor the primary under.
    pub fn service_name(&self) -> &str {
        SERVICE
    }

    /// The Sentinels' ports.
    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels.iter().map(|s| s.port).collect()
    }

    /// `redis-sentinel://127.0.0.1:S1?sentinelServiceName=NAME&node=127.0.0.1:S2&node=…`.
    pub fn url(&self) -> String {
        let ports = self.sentinel_ports();
        let mut url = format!(
            "redis-sentinel://127.0.0.1:{}?sentinelServiceName={SERVICE}",
            ports[0]
        );
        for port in &ports[1..] {
            url.push_str(&format!("&node=127.0.0.1:{port}"));
        }
        url
    }

    /// The port of the primary as the Sentinels name it now.
    pub fn primary_port(&self) -> u16 {
        for sentinel in &self.sentinels {
            if !sentinel.process.is_held() {
                continue;
            }
            let addr = command_on(
                sentinel.port,
                &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE],
            );
            if let Some(port) = addr.get(1).and_then(|p| p.parse().ok()) {
                return port;
            }
        }
        panic!("no sentinel names a primary for {SERVICE}");
    }

    /// The port of the data server that is not the primary now.
    pub fn replica_port(&self) -> u16 {
        let primary = self.primary_port();
        self.servers
            .iter()
            .map(RedisServer::port)
            .find(|p| *p != primary)
            .expect("two data servers")
    }

    /// The data server (primary or replica) listening on `port`.
    pub fn server(&self, port: u16) -> &RedisServer {
        self.servers
            .iter()
            .find(|s| s.port() == port)
            .unwrap_or_else(|| panic!("no server on port {port}"))
    }

    /// Kills the current primary (as `kill -9` would) and returns its port.
    pub fn kill_primary(&mut self) -> u16 {
        let port = self.primary_port();
        let server = self
            .servers
            .iter_mut()
            .find(|s| s.port() == port)
            .unwrap_or_else(|| panic!("no server on the primary's port {port}"));
        server.kill();
        port
    }

    /// Waits (up to 60 s) until the Sentinels name a primary other than `old_port` and that
    /// server answers `ROLE` as master; returns its port.
    pub fn wait_failover(&self, old_port: u16) -> u16 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let port = self.primary_port();
            if port != old_port {
                let role = self.server(port).command_list(&["ROLE"]);
                if role.first().map(String::as_str) == Some("master") {
                    return port;
                }
            }
            if Instant::now() > deadline {
                panic!("no failover away from port {old_port} within 60 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fails_over_to_the_replica_and_stops() {
        let mut set = RedisSentinels::start();
        let url = set.url();
        let ports = set.sentinel_ports();
        assert!(url.contains(&format!("127.0.0.1:{}?sentinelServiceName=", ports[0])));
        assert!(url.contains(&format!("&node=127.0.0.1:{}", ports[2])));
        let old = set.primary_port();
        assert_eq!(set.server(old).command(&["SET", "k", "v"]), "+OK");

        let killed = set.kill_primary();
        assert_eq!(killed, old);
        let new = set.wait_failover(old);
        assert_ne!(new, old);
        assert_eq!(set.server(new).command(&["SET", "k2", "v"]), "+OK");

        let all: Vec<u16> = ports.iter().copied().chain([new]).collect();
        drop(set);
        for port in all {
            assert!(!ping(port), "{port} still answers after drop");
        }
    }
}
