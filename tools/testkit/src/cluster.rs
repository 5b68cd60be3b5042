//! A Redis Cluster of primaries on free loopback ports.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::{free_port, RedisServer};

/// A running Redis Cluster of primaries without replicas (`redis-server --cluster-enabled yes`
/// per node, slots assigned by `redis-cli --cluster create`), every node killed when dropped.
///
/// ```no_run
/// use batch_testkit::RedisCluster;
///
/// let cluster = RedisCluster::start(3);
/// assert!(cluster.url().starts_with("redis-cluster://127.0.0.1:"));
/// ```
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `primaries` nodes (at least 3, as `redis-cli --cluster create` wants), joins
    /// them, and waits until every node reports `cluster_state:ok`.
    pub fn start(primaries: usize) -> Self {
        assert!(primaries >= 3, "a Redis Cluster needs at least 3 primaries");
        let nodes: Vec<RedisServer> = (0..primaries)
            .map(|_| {
                // The bus port is explicit: port + 10000 may be above 65535 or taken.
                RedisServer::builder()
                    .args(["--cluster-enabled", "yes"])
                    .args(["--cluster-config-file", "nodes.conf"])
                    .args(["--cluster-node-timeout", "2000"])
                    .args(["--cluster-port", &free_port().to_string()])
                    .start()
            })
            .collect();
        let mut cmd = Command::new("redis-cli");
        cmd.arg("--cluster").arg("create");
        for node in &nodes {
            cmd.arg(format!("127.0.0.1:{}", node.port()));
        }
        cmd.args(["--cluster-replicas", "0", "--cluster-yes"]);
        let output = cmd.output().unwrap_or_else(|e| {
            panic!("running redis-cli --cluster create (install redis-tools): {e}")
        });
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed:\n{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let cluster = RedisCluster { nodes };
        cluster.wait_ok();
        cluster
    }

    /// `redis-cluster://127.0.0.1:P1?node=127.0.0.1:P2&node=…`, every node a seed.
    pub fn url(&self) -> String {
        let mut url = format!("redis-cluster://127.0.0.1:{}", self.nodes[0].port());
        for (i, node) in self.nodes.iter().enumerate().skip(1) {
            url.push(if i == 1 { '?' } else { '&' });
            url.push_str(&format!("node=127.0.0.1:{}", node.port()));
        }
        url
    }

    /// The nodes, in the order of [`RedisCluster::url`].
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// Kills node `i` (its slots become unreachable until [`RedisCluster::restart_node`]).
    pub fn kill_node(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// Starts node `i` again on its port and bus port; it rejoins from its `nodes.conf` with
    /// its slots (and no data). Waits for `cluster_state:ok` everywhere.
    pub fn restart_node(&mut self, i: usize) {
        self.nodes[i].restart();
        self.wait_ok();
    }

    /// Waits (up to 60 s) until every running node reports `cluster_state:ok` and knows all
    /// nodes; panics otherwise.
    pub fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let known = format!("cluster_known_nodes:{}", self.nodes.len());
        loop {
            let infos: Vec<String> = self
                .nodes
                .iter()
                .map(|n| n.command(&["CLUSTER", "INFO"]))
                .collect();
            if infos
                .iter()
                .all(|i| i.contains("cluster_state:ok") && i.contains(&known))
            {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "the cluster is not ok after 60 s:\n{}",
                    infos.join("\n---\n")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_primaries_share_the_slots_and_stop() {
        let mut cluster = RedisCluster::start(3);
        let ports: Vec<u16> = cluster.nodes().iter().map(RedisServer::port).collect();
        assert_eq!(
            cluster.url(),
            format!(
                "redis-cluster://127.0.0.1:{}?node=127.0.0.1:{}&node=127.0.0.1:{}",
                ports[0], ports[1], ports[2]
            )
        );
        // Every node owns some slots: the slot map has three ranges.
        let slots = cluster.nodes()[0].command_list(&["CLUSTER", "SLOTS"]);
        assert_eq!(slots.len(), 3, "{slots:?}");
        // A key is served by one node only; the others redirect.
        let answers: Vec<String> = cluster
            .nodes()
            .iter()
            .map(|n| n.command(&["SET", "some-key", "v"]))
            .collect();
        assert_eq!(
            answers.iter().filter(|a| *a == "+OK").count(),
            1,
            "{answers:?}"
        );
        assert_eq!(
            answers.iter().filter(|a| a.starts_with("-MOVED")).count(),
            2,
            "{answers:?}"
        );

        cluster.kill_node(2);
        assert!(!crate::ping(ports[2]));
        cluster.restart_node(2);
        assert_eq!(cluster.nodes()[2].command(&["PING"]), "+PONG");

        drop(cluster);
        for port in ports {
            assert!(!crate::ping(port), "node {port} still answers after drop");
        }
    }
}
