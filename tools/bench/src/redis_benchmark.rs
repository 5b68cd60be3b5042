//! `redis-benchmark` runs: the limit our figures are compared with.

use std::process::{Command, Stdio};

use crate::BenchError;

/// One `redis-benchmark` invocation against `127.0.0.1:port`.
#[derive(Debug, Clone)]
pub struct RedisBenchmark {
    /// The server port.
    pub port: u16,
    /// Requests (`-n`).
    pub requests: usize,
    /// Pipelined requests per client (`-P`).
    pub pipeline: usize,
    /// Parallel clients (`-c`).
    pub clients: usize,
    /// Keyspace for `__rand_int__` (`-r`); none when 0.
    pub random_keyspace: u64,
    /// Cluster mode (`--cluster`): clients spread over the primaries, and `{tag}` in a key
    /// becomes a hash tag of a slot of the client's node.
    pub cluster: bool,
}

impl RedisBenchmark {
    /// `requests` requests over 50 clients, pipelining `pipeline`, random ints up to 10^11.
    pub fn new(port: u16, requests: usize, pipeline: usize) -> Self {
        Self {
            port,
            requests,
            pipeline,
            clients: 50,
            random_keyspace: 100_000_000_000,
            cluster: false,
        }
    }

    /// Runs `command` (its words) and returns the requests per second it reports.
    pub fn run(&self, command: &[&str]) -> Result<f64, BenchError> {
        let mut cmd = Command::new("redis-benchmark");
        cmd.args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-n", &self.requests.to_string()])
            .args(["-c", &self.clients.to_string()])
            .args(["-P", &self.pipeline.to_string()]);
        if self.random_keyspace > 0 {
            cmd.args(["-r", &self.random_keyspace.to_string()]);
        }
        if self.cluster {
            cmd.arg("--cluster");
        }
        cmd.arg("--csv")
            .args(command)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let out = cmd
            .output()
            .map_err(|e| BenchError::Tool(format!("redis-benchmark: {e}")))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(BenchError::Tool(format!(
                "redis-benchmark {} exited with {}: {}",
                command.first().unwrap_or(&""),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        parse_csv_rps(&stdout).ok_or_else(|| {
            BenchError::Tool(format!(
                "redis-benchmark printed no rate: {}",
                stdout.chars().take(200).collect::<String>()
            ))
        })
    }
}

/// The `rps` of the last data row of `redis-benchmark --csv`. The test name comes first and may
/// hold commas, so the rate is read as the 7th field from the end.
pub fn parse_csv_rps(csv: &str) -> Option<f64> {
    let row = csv
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty() && !l.starts_with("\"test\""))?;
    let fields: Vec<&str> = row.rsplitn(8, ',').collect();
    if fields.len() < 8 {
        return None;
    }
    fields[6].trim().trim_matches('"').parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_rate_of_the_last_row() {
        let csv = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\
                   \"ZADD k 1 m:__rand_int__:a,b\",\"38684.72\",\"15.266\",\"1.936\",\"15.559\",\"22.623\",\"31.727\",\"31.887\"\n";
        assert_eq!(parse_csv_rps(csv), Some(38684.72));
        assert_eq!(parse_csv_rps("\"test\",\"rps\"\n"), None);
        assert_eq!(parse_csv_rps(""), None);
    }
}
