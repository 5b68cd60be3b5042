//! The enqueue and drain scenarios a second time, on a Redis Cluster, with the cluster's own
//! limits; their rows sit beside the single-server ones.

use super::{limits, Ctx, Scenario};
use crate::lab::Lab;
use crate::redis_benchmark::RedisBenchmark;
use crate::report::{Report, Unit};
use crate::{BenchError, Settings};

/// The scenarios that also run on the cluster.
pub(crate) fn covers(scenario: Scenario) -> bool {
    matches!(scenario, Scenario::Enqueue | Scenario::Drain)
}

/// The cluster lab, started when the first scenario needs it and kept for the next.
#[derive(Default)]
pub(crate) struct ClusterRuns {
    lab: Option<Lab>,
}

impl ClusterRuns {
    /// Runs `scenario` on a cluster of `s.cluster_primaries` primaries, adding its rows.
    pub(crate) async fn run(
        &mut self,
        scenario: Scenario,
        s: &Settings,
        report: &mut Report,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<(), BenchError> {
        if self.lab.is_none() {
            let lab = Lab::start_cluster(s.cluster_primaries).await?;
            progress(&format!(
                "Redis Cluster of {} primaries at {}",
                s.cluster_primaries,
                lab.redis_url()
            ));
            self.lab = Some(lab);
        }
        let Some(lab) = &self.lab else {
            return Ok(());
        };
        let ran = super::run(scenario, Ctx { lab, s, progress }, report).await;
        let _ = lab.flush_redis().await;
        ran
    }

    /// Closes the cluster lab's clients; its servers go with it.
    pub(crate) async fn stop(self) {
        if let Some(lab) = self.lab {
            lab.stop().await;
        }
    }
}

/// `redis-benchmark --cluster` against the lab's cluster, with random members when `random`.
fn cluster_bench(lab: &Lab, s: &Settings, random: bool) -> RedisBenchmark {
    let bench = RedisBenchmark::new(lab.redis_port(), s.redis_benchmark_requests, 1);
    RedisBenchmark {
        cluster: true,
        random_keyspace: if random { bench.random_keyspace } else { 0 },
        ..bench
    }
}

/// The enqueue scenario's `--cluster` rows and notes, for members like `member`.
pub(crate) async fn enqueue_limits(
    lab: &Lab,
    s: &Settings,
    report: &mut Report,
    member: &str,
    member_bytes: usize,
) -> Result<(), BenchError> {
    let scenario = lab.scenario("Enqueue");
    let primaries = lab.cluster_primaries().unwrap_or_default();
    let bench = cluster_bench(lab, s, true);
    let command = ["ZADD", "bench:zadd:{tag}", "1", member];
    let limits = limits::by_pipeline(lab, s, &bench, None, &command).await?;
    limits::push_rows(report, &scenario, Unit::PerSecond("req/s"), limits, |p| {
        format!("redis-benchmark --cluster ZADD, -P {p}, a key per primary")
    });
    report.note(&scenario, format!(
        "The enqueue runs again on a Redis Cluster of {primaries} primaries without replicas, on the same machine (its {} cores shared by the {primaries} servers and the bench), reached through a `redis-cluster://` URL; same job, same {member_bytes} B members. No baseline row: its MULTI spans keys of several slots, which a cluster refuses (CROSSSLOT).",
        report.machine.cores
    ));
    report.note(&scenario, format!(
        "A job's request queue is one sorted set, so one slot, so one primary: the cluster's limit for it is one primary's. The `redis-benchmark ZADD` rows (the limit the ratios use) are the single-server command against the primary holding `bench:zadd`'s slot (found from a node's MOVED redirection). The `--cluster` rows, `redis-benchmark --cluster -c 50 -n {} ZADD bench:zadd:{{tag}} 1 m:__rand_int__:<{member_bytes} B>`, spread the clients over the {primaries} primaries with a key each (redis-benchmark 7.0 needs `{{tag}}` in the key in cluster mode, so it cannot aim at one key): what the whole cluster takes, for comparison only.",
        s.redis_benchmark_requests
    ));
    Ok(())
}

/// The drain scenario's `--cluster` rows and notes, for list elements like `element`.
pub(crate) async fn drain_limits(
    lab: &Lab,
    s: &Settings,
    report: &mut Report,
    element: &str,
) -> Result<(), BenchError> {
    let scenario = lab.scenario("Drain");
    let primaries = lab.cluster_primaries().unwrap_or_default();
    let bench = cluster_bench(lab, s, false);
    let fill = ["LPUSH", "bench:list:{tag}", element];
    let limits =
        limits::by_pipeline(lab, s, &bench, Some(&fill), &["RPOP", "bench:list:{tag}"]).await?;
    limits::push_rows(
        report,
        &scenario,
        Unit::PerSecond("results/s"),
        limits,
        |p| format!("redis-benchmark --cluster RPOP, -P {p}, a list per primary"),
    );
    report.note(&scenario, format!(
        "The drain runs again on the Redis Cluster of {primaries} primaries, the job's result list filled the same way before each run. A result list is one key, so one slot, so one primary: the `redis-benchmark RPOP` rows (the limit the ratio uses) are the single-server commands (LPUSH to fill, then RPOP) against the primary holding `bench:list`'s slot. The `--cluster` rows run `redis-benchmark --cluster LPUSH bench:list:{{tag}} <element>` then `RPOP bench:list:{{tag}}` ({} requests each), a list per primary: the whole cluster's rate, for comparison only.",
        s.redis_benchmark_requests
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dbsize(port: u16) -> String {
        batch_testkit::command_on(port, &["DBSIZE"]).join("")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cluster_lab_finds_a_keys_primary_and_flushes_every_primary() {
        let lab = Lab::start_cluster(3).await.unwrap();
        assert_eq!(lab.cluster_primaries(), Some(3));
        assert_eq!(lab.scenario("Drain"), "Drain (cluster, 3 primaries)");
        let first = lab.redis_port();
        let mut ports = Vec::new();
        // Keys of different slots: between them they land on more than one primary.
        for key in ["bench:zadd", "bench:list", "a", "b", "c", "d", "e", "f"] {
            let port = lab.port_of(key).unwrap();
            assert_eq!(
                batch_testkit::command_on(port, &["SET", key, "v"]),
                ["+OK"],
                "{key} on {port}"
            );
            ports.push(port);
        }
        ports.sort_unstable();
        ports.dedup();
        assert!(ports.len() > 1, "every key on one node: {ports:?}");
        assert!(ports.iter().any(|&p| p != first));
        for &port in &ports {
            assert_ne!(dbsize(port), ":0");
        }
        lab.flush_redis().await.unwrap();
        for &port in &ports {
            assert_eq!(dbsize(port), ":0", "node {port} after flush_redis");
        }
        lab.stop().await;
    }
}
