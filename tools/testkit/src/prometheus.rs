//! A real Prometheus on a free loopback port, scraping the targets a test names: for the code
//! that reads a pool's load through Prometheus's query API.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::process::Process;

const INSTALL_HINT: &str = "prometheus is not installed; install it with \
    `sudo apt-get install -y prometheus` (Debian/Ubuntu), or set PROMETHEUS_BIN to its path";

/// A Prometheus server scraping `targets` every `scrape_interval`, each target's series
/// labelled `inference_pool: <pool>` as an llm-d deployment labels them. Killed when dropped.
pub struct PrometheusServer {
    process: Process,
    port: u16,
    _dir: tempfile::TempDir,
}

impl PrometheusServer {
    /// Starts Prometheus scraping `targets` (`127.0.0.1:PORT`, path `/metrics`) as pool `pool`;
    /// returns once its API answers. Panics with an actionable message when it cannot.
    pub fn start(targets: &[String], pool: &str, scrape_interval: Duration) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("batch-testkit-prometheus-")
            .tempdir()
            .expect("creating a temporary directory for prometheus");
        let quoted: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let config = format!(
            "global:\n  scrape_interval: {ms}ms\n  scrape_timeout: {ms}ms\n\
             scrape_configs:\n  - job_name: pool\n    static_configs:\n      - targets: [{}]\n        labels:\n          inference_pool: '{pool}'\n",
            quoted.join(", "),
            ms = scrape_interval.as_millis()
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).expect("writing prometheus.yml");
        let binary = std::env::var("PROMETHEUS_BIN").unwrap_or_else(|_| "prometheus".into());
        for _ in 0..5 {
            let port = crate::free_port();
            let child = Command::new(&binary)
                .arg(format!("--config.file={}", config_path.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("could not start {binary}: {e}. {INSTALL_HINT}"));
            let process = Process::default();
            process.set(child);
            let ready = process.wait_ready(
                "prometheus",
                "answer on /-/ready",
                Duration::from_secs(20),
                Duration::from_millis(50),
                || ready(port),
            );
            if ready.is_ok() {
                return Self {
                    process,
                    port,
                    _dir: dir,
                };
            }
        }
        panic!("prometheus did not start on a free port in 5 tries");
    }

    /// `http://127.0.0.1:PORT`, the base of its query API.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Stops it (as `kill -9`).
    pub fn stop(&self) {
        self.process.kill();
    }
}

/// Whether `GET /-/ready` answers 200, over a plain socket (no runtime needed).
fn ready(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut socket) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = socket.set_read_timeout(Some(Duration::from_secs(1)));
    if socket
        .write_all(b"GET /-/ready HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut answer = String::new();
    let _ = socket.read_to_string(&mut answer);
    answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200")
}
