//! Redis Cluster and Sentinel, against real servers started by the test kit.

mod common;

use std::time::{Duration, Instant};

use common::{add_user, documented_rule};

use batch_redis::{connect, ConnectOptions};
use batch_testkit::{RedisCluster, RedisSentinels};
use fred::prelude::*;
use fred::util::redis_keyslot;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_serves_keys_in_every_slot_and_scripts_on_one_tag() {
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3))
        .await
        .unwrap();
    // As the documented ACL user: the client's cluster commands are in the rule too.
    for node in cluster.nodes() {
        add_user(node, &documented_rule(), "cluster-pw");
    }
    let url = cluster
        .url()
        .replace("redis-cluster://", "redis-cluster://batch:cluster-pw@");
    let client = connect(&url, &ConnectOptions::default()).await.unwrap();

    // Keys spread over the slots of all three nodes.
    let keys: Vec<String> = (0..30).map(|i| format!("llm-d-async:key-{i}")).collect();
    for key in &keys {
        let _: () = client
            .set(key, key.as_str(), None, None, false)
            .await
            .unwrap();
    }
    for key in &keys {
        let value: String = client.get(key).await.unwrap();
        assert_eq!(&value, key);
    }
    let mut per_node = vec![0; 3];
    for (i, node) in cluster.nodes().iter().enumerate() {
        per_node[i] = node
            .command(&["DBSIZE"])
            .trim_start_matches(':')
            .parse::<u32>()
            .unwrap();
    }
    assert!(per_node.iter().all(|n| *n > 0), "{per_node:?}");
    assert_eq!(per_node.iter().sum::<u32>(), 30);

    // A script over two keys of one hash tag runs on the node that owns the tag.
    let (a, b) = (
        "{llm-d-async:job-7}:requests",
        "{llm-d-async:job-7}:results",
    );
    assert_eq!(redis_keyslot(a.as_bytes()), redis_keyslot(b.as_bytes()));
    let moved: i64 = client
        .eval(
            "redis.call('RPUSH', KEYS[1], ARGV[1]) \
             redis.call('RENAME', KEYS[1], KEYS[2]) \
             return redis.call('LLEN', KEYS[2])",
            vec![a, b],
            vec!["x"],
        )
        .await
        .unwrap();
    assert_eq!(moved, 1);
    let exists: i64 = client.exists(a).await.unwrap();
    assert_eq!(exists, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_client_follows_a_failover() {
    let mut set = tokio::task::spawn_blocking(RedisSentinels::start)
        .await
        .unwrap();
    // The primary and the replica know the documented ACL user; the Sentinels need no login.
    let old = set.primary_port();
    for port in [old, set.replica_port()] {
        add_user(set.server(port), &documented_rule(), "sentinel-pw");
    }
    let url = set
        .url()
        .replace("redis-sentinel://", "redis-sentinel://batch:sentinel-pw@");
    let client = connect(&url, &ConnectOptions::default()).await.unwrap();
    let _: () = client
        .set("llm-d-async:before", "failover", None, None, false)
        .await
        .unwrap();
    assert_eq!(
        set.server(old).command(&["GET", "llm-d-async:before"]),
        "failover"
    );

    let (set, new) = tokio::task::spawn_blocking(move || {
        let old = set.kill_primary();
        let new = set.wait_failover(old);
        (set, new)
    })
    .await
    .unwrap();
    assert_ne!(new, old);

    // The client finds the new primary on its own; commands succeed again within ~30 s.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let attempt = async {
            let _: () = client
                .set("llm-d-async:after", "failover", None, None, false)
                .await?;
            client.get::<String, _>("llm-d-async:after").await
        };
        match attempt.await {
            Ok(value) => {
                assert_eq!(value, "failover");
                break;
            }
            Err(e) => assert!(
                Instant::now() < deadline,
                "no successful SET/GET after the failover within 60 s: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The write reached the promoted replica.
    assert_eq!(
        set.server(new).command(&["GET", "llm-d-async:after"]),
        "failover"
    );
}
