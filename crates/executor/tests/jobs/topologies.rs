//! Jobs in process on Redis as production runs it: a 3-primary Cluster, and a Sentinel-managed
//! primary that fails over mid-job. The executor and the simulated dispatcher both connect the
//! same ways.

use std::time::Duration;

use crate::support::*;
use batch_executor::{Executor, JobSpec};
use batch_testkit::{RedisCluster, RedisSentinels};
use batch_wire::BatchStatus;
use fred::interfaces::SortedSetsInterface;
use tokio_util::sync::CancellationToken;

const QUEUE: &str = "llm-d-async:requests:pool-a";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_lines_on_a_cluster_complete_exactly_once() {
    let cluster = RedisCluster::start(3);
    let rig = Rig::new(cluster.url(), None).await;
    let lines = write_input(&rig.path("in.jsonl"), 10_000, &["llama-3"]);
    let config = rig.config(&cluster.url(), "", "");
    let sim = rig.dispatcher(|_| {}).await;
    let executor = Executor::new(load(&config)).await.unwrap();
    let out = rig.path("out");
    let batch = tokio::time::timeout(
        Duration::from_secs(300),
        executor.run(
            JobSpec::new(rig.path("in.jsonl"), &out),
            CancellationToken::new(),
        ),
    )
    .await
    .expect("the job finished")
    .unwrap();
    assert_eq!(batch.status, BatchStatus::Completed);
    let results = Results::read(&out);
    results.assert_answered(&lines);
    let client = rig.client().await;
    assert_eq!(client.zcard::<u64, _>(QUEUE).await.unwrap(), 0);
    executor.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_survives_a_sentinel_failover() {
    let mut sentinels = RedisSentinels::start();
    let rig = Rig::new(sentinels.url(), None).await;
    let lines = write_input(&rig.path("in.jsonl"), 3000, &["llama-3"]);
    // Writes the old primary took but never passed on are lost in a failover: what goes
    // missing comes back through the lost-request check.
    let config = rig.config(&sentinels.url(), "", "  lost_request_timeout: 2s\n");
    let sim = rig.dispatcher(|c| c.batch_size = 20).await;
    let executor = Executor::new(load(&config)).await.unwrap();
    let out = rig.path("out");
    let run = executor.run(
        JobSpec::new(rig.path("in.jsonl"), &out),
        CancellationToken::new(),
    );
    tokio::pin!(run);
    let some = async {
        eventually("some results", Duration::from_secs(120), || {
            std::fs::read_to_string(out.join("output.jsonl"))
                .is_ok_and(|t| t.lines().count() >= 300)
        })
        .await
    };
    tokio::select! { _ = some => {}, _ = &mut run => panic!("finished before the failover") }
    let old = sentinels.kill_primary();
    let new = tokio::task::spawn_blocking(move || {
        let new = sentinels.wait_failover(old);
        (sentinels, new)
    });
    let (sentinels, new) = tokio::select! {
        r = new => r.unwrap(),
        _ = &mut run => panic!("finished during the failover"),
    };
    assert_ne!(new, old);
    let batch = tokio::time::timeout(Duration::from_secs(300), run)
        .await
        .expect("finished after the failover")
        .unwrap();
    assert_eq!(batch.status, BatchStatus::Completed);
    Results::read(&out).assert_each_once(&lines);
    executor.shutdown().await;
    sim.shutdown().await;
    drop(sentinels);
}
