//! Conformance of the simulated dispatcher with `dispatcher-contract.md` §6, as v0.10 ("N"),
//! against a real redis-server and the simulated gateway. Each test quotes the sentence of the
//! contract it pins.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use batch_wire::Envelope;
use common::*;
use dispatcher_sim::{
    ClaimKeys, DispatcherConfig, DispatcherHandle, FailureKind, FailureRule, GatewayConfig,
    QueueEntry,
};
use fred::prelude::{HashesInterface, KeysInterface, SortedSetsInterface};

const RESULTS: &str = "llm-d-async:results:pool-a:proc-1";
const WAIT: Duration = Duration::from_secs(10);

impl Rig {
    fn config(&self) -> DispatcherConfig {
        fast_v0_10(&self.redis.url(), vec![entry(QUEUE, &self.gw.base_url())])
    }

    /// A rig whose gateway answers every request after `latency`.
    async fn with_latency(latency: Duration) -> Self {
        Rig::new(GatewayConfig {
            latency_fixed: latency,
            ..GatewayConfig::default()
        })
        .await
    }

    /// A rig whose gateway answers after `latency`, with request `r1` enqueued (its member).
    async fn with_r1(latency: Duration) -> (Self, String) {
        let rig = Rig::with_latency(latency).await;
        let member = rig.enqueue("r1", now() + 3600).await;
        (rig, member)
    }

    /// Starts a dispatcher on `config` and waits until it has a request at the gateway.
    async fn start_in_hand(&self, config: DispatcherConfig) -> DispatcherHandle {
        let d = self.start(config).await;
        eventually(WAIT, "at the gateway", || async {
            self.gw.stats().in_flight == 1
        })
        .await;
        d
    }

    /// Enqueues a chat request with token `tok-<id>`, routed to `RESULTS`; returns the member.
    async fn enqueue(&self, id: &str, deadline: i64) -> String {
        enqueue(
            &self.client,
            QUEUE,
            id,
            deadline,
            &chat(id),
            &format!(r#"{{"request_token":"tok-{id}","result_queue_name":"{RESULTS}"}}"#),
        )
        .await
    }

    async fn hash(&self, key: &str) -> HashMap<String, String> {
        self.client.hgetall(key).await.unwrap()
    }

    async fn index(&self, keys: &ClaimKeys) -> Vec<(String, f64)> {
        self.client
            .zrange(keys.index.as_str(), 0, -1, None, false, None, true)
            .await
            .unwrap()
    }

    /// Every claim entry of the queue, in all three keys.
    async fn claim_count(&self, keys: &ClaimKeys) -> usize {
        self.hash(&keys.claimed).await.len()
            + self.hash(&keys.owners).await.len()
            + self.index(keys).await.len()
    }
}

fn now_f64() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// "claims each with a Lua script that ZREMs it and records it in `<q>:claimed` (hash),
/// `<q>:claim-owners` (hash) and `<q>:claims-idx` (sorted set by lease expiry). The claim key is
/// `id` + NUL + `request_token`. Lease = min(now + 300 s, deadline + 5 min)" (scaled here).
#[tokio::test]
async fn a_claim_is_recorded_while_the_request_is_in_hand() {
    let (rig, member) = Rig::with_r1(Duration::from_millis(1500)).await;
    let config = rig.config();
    let owner = config.instance_id.clone();
    let d = rig.start_in_hand(config).await;
    let keys = ClaimKeys::for_queue(QUEUE);
    let key = "r1\0tok-r1".to_owned();
    assert_eq!(zcard(&rig.client, QUEUE).await, 0, "ZREMed from the queue");
    assert_eq!(
        rig.hash(&keys.claimed).await,
        HashMap::from([(key.clone(), member)]),
        "the member, byte for byte, under its claim key"
    );
    assert_eq!(
        rig.hash(&keys.owners).await,
        HashMap::from([(key.clone(), owner)])
    );
    let index = rig.index(&keys).await;
    assert_eq!(index.len(), 1);
    assert_eq!(index[0].0, key);
    // 300 s × 0.01 = 3 s from when it was claimed.
    let left = index[0].1 - now_f64();
    assert!(left > 0.0 && left <= 3.5, "lease ends in {left} s");
    let got = results(&rig.client, RESULTS, 1, WAIT).await;
    assert_eq!(got[0].status_code, Some(200));
    d.shutdown().await;
}

/// "Lease = min(now + 300 s, deadline + 5 min)": a lease longer than the time left to the
/// deadline plus five minutes ends then.
#[tokio::test]
async fn the_lease_is_capped_at_the_deadline_plus_five_minutes() {
    let rig = Rig::with_latency(Duration::from_millis(1500)).await;
    let deadline = now() + 60;
    rig.enqueue("r1", deadline).await;
    let mut config = rig.config();
    config.sim.time_scale = 1.0;
    config.sim.claim_lease = Duration::from_secs(3600);
    let d = rig.start(config).await;
    let keys = ClaimKeys::for_queue(QUEUE);
    eventually(WAIT, "claimed", || async {
        !rig.index(&keys).await.is_empty()
    })
    .await;
    let expiry = rig.index(&keys).await[0].1;
    assert_eq!(expiry, (deadline + 300) as f64);
    results(&rig.client, RESULTS, 1, WAIT).await;
    d.shutdown().await;
}

/// "An ack script (owner checked) LPUSHes the result … and deletes the claim entries."
#[tokio::test]
async fn the_ack_removes_the_claim() {
    let rig = Rig::new(GatewayConfig::default()).await;
    for i in 0..5 {
        rig.enqueue(&format!("r{i}"), now() + 3600).await;
    }
    let d = rig.start(rig.config()).await;
    results(&rig.client, RESULTS, 5, WAIT).await;
    let keys = ClaimKeys::for_queue(QUEUE);
    eventually(WAIT, "every claim deleted", || async {
        rig.claim_count(&keys).await == 0
    })
    .await;
    let exists: i64 = rig
        .client
        .exists(vec![keys.claimed, keys.owners, keys.index])
        .await
        .unwrap();
    assert_eq!(exists, 0);
    d.shutdown().await;
}

/// "Expired requests get a result: `error_code: DEADLINE_EXCEEDED` (v0.9 dropped them
/// silently)", and "Results carry `request_token` at the top level".
#[tokio::test]
async fn expired_requests_get_deadline_exceeded_and_results_carry_the_token() {
    let rig = Rig::new(GatewayConfig::default()).await;
    rig.enqueue("old", now() - 5).await;
    rig.enqueue("fresh", now() + 600).await;
    enqueue(
        &rig.client,
        QUEUE,
        "cancelled",
        now() + 601,
        &chat("c"),
        &format!(r#"{{"request_token":"tok-c","result_queue_name":"{RESULTS}"}}"#),
    )
    .await;
    set(&rig.client, "request-cancel:cancelled", "tok-c").await;
    let d = rig.start(rig.config()).await;
    let got: HashMap<String, _> = results(&rig.client, RESULTS, 3, WAIT)
        .await
        .into_iter()
        .map(|r| (r.id.clone(), r))
        .collect();
    let old = &got["old"];
    assert_eq!(old.error_code.as_deref(), Some("DEADLINE_EXCEEDED"));
    assert_eq!(old.request_token.as_deref(), Some("tok-old"));
    assert_eq!(got["fresh"].status_code, Some(200));
    assert_eq!(got["fresh"].request_token.as_deref(), Some("tok-fresh"));
    assert_eq!(got["cancelled"].error_code.as_deref(), Some("CANCELLED"));
    assert_eq!(got["cancelled"].request_token.as_deref(), Some("tok-c"));
    assert_eq!(rig.gw.stats().total, 1, "only the fresh one was sent");
    assert_eq!(d.stats().dropped_expired, 0);
    assert_eq!(d.stats().results_for("DEADLINE_EXCEEDED"), 1);
    d.shutdown().await;
}

/// CRC16/XMODEM of the key's hash tag modulo 16384: Redis Cluster's key slot.
fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|b| *b == b'{').and_then(|open| {
        let close = bytes[open + 1..].iter().position(|b| *b == b'}')?;
        (close > 0).then(|| &bytes[open + 1..open + 1 + close])
    });
    let mut crc: u16 = 0;
    for &b in tagged.unwrap_or(bytes) {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// "In Cluster mode these keys are hash-tagged `{<queue>}:claimed` etc.": the only claim keys
/// written are the hash-tagged ones, and they share the queue's slot, so one script may touch
/// the queue and all of them.
#[tokio::test]
async fn claim_keys_are_hash_tagged_in_the_queues_slot() {
    // The examples of Redis's CLUSTER KEYSLOT documentation.
    assert_eq!(key_slot("somekey"), 11058);
    assert_eq!(key_slot("foo{hash_tag}"), 2515);
    assert_eq!(key_slot("bar{hash_tag}"), 2515);
    let (rig, _) = Rig::with_r1(Duration::from_millis(1500)).await;
    let d = rig.start_in_hand(rig.config()).await;
    let mut written = rig.redis.command_list(&["KEYS", "*claim*"]);
    written.sort();
    assert_eq!(
        written,
        [
            format!("{{{QUEUE}}}:claim-owners"),
            format!("{{{QUEUE}}}:claimed"),
            format!("{{{QUEUE}}}:claims-idx"),
        ]
    );
    for key in &written {
        assert_eq!(key_slot(key), key_slot(QUEUE), "{key}");
    }
    results(&rig.client, RESULTS, 1, WAIT).await;
    d.shutdown().await;
}

/// "Effect: a dispatcher killed with requests in hand no longer loses them": after a crash the
/// claims stay until their lease runs out, then the members come back into the queue, byte for
/// byte at their deadline score, and are answered.
#[tokio::test]
async fn crash_after_loses_nothing() {
    let rig = Rig::with_latency(Duration::from_millis(500)).await;
    let base = now() + 3600;
    let mut members = Vec::new();
    for i in 0..10 {
        members.push((rig.enqueue(&format!("r{i}"), base + i).await, base + i));
    }
    let mut config = rig.config();
    config.sim.crash_after = Some(3);
    let crashed = rig.start(config).await;
    tokio::time::timeout(WAIT, crashed.crashed())
        .await
        .expect("crash-after fired");
    let keys = ClaimKeys::for_queue(QUEUE);
    // The lease is 3 s (300 s × 0.01): well within it, the three are still claimed.
    assert_eq!(zcard(&rig.client, QUEUE).await, 7);
    assert_eq!(rig.hash(&keys.claimed).await.len(), 3);

    // A second dispatcher with a closed gate only reclaims.
    let mut closed = rig.config();
    redis_gate(&mut closed.queues[0], &rig.redis.url(), "closed-budget");
    set(&rig.client, "closed-budget", "0").await;
    let reclaimer = rig.start(closed).await;
    eventually(WAIT, "the three back in the queue", || async {
        zcard(&rig.client, QUEUE).await == 10
    })
    .await;
    assert_eq!(rig.claim_count(&keys).await, 0);
    for (member, deadline) in &members {
        let score: Option<f64> = rig.client.zscore(QUEUE, member.as_str()).await.unwrap();
        assert_eq!(score, Some(*deadline as f64), "{member}");
    }
    assert_eq!(reclaimer.stats().reclaimed, 3);
    assert_eq!(llen(&rig.client, RESULTS).await, 0);
    reclaimer.shutdown().await;
    drop(crashed);

    let d = rig.start(rig.config()).await;
    let mut ids: Vec<String> = results(&rig.client, RESULTS, 10, WAIT)
        .await
        .into_iter()
        .map(|r| r.id)
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 10);
    d.shutdown().await;
}

/// "a reclaimer (every 15 s) puts expired claims back into the request queue": a dead owner's
/// expired claim goes back, a claim whose lease has not run out stays.
#[tokio::test]
async fn the_reclaimer_returns_only_expired_claims() {
    let rig = Rig::new(GatewayConfig::default()).await;
    let keys = ClaimKeys::for_queue(QUEUE);
    let deadline = now() + 3600;
    let expired_member = envelope("dead", deadline, &chat("a"), "{}");
    let live_member = envelope("live", deadline, &chat("b"), "{}");
    for (member, key, expiry) in [
        (&expired_member, "dead\0", now_f64() - 1.0),
        (&live_member, "live\0", now_f64() + 3600.0),
    ] {
        let _: i64 = rig
            .client
            .hset(keys.claimed.as_str(), (key, member.as_str()))
            .await
            .unwrap();
        let _: i64 = rig
            .client
            .hset(keys.owners.as_str(), (key, "another-dispatcher"))
            .await
            .unwrap();
        zadd(&rig.client, &keys.index, expiry, key).await;
    }
    let mut config = rig.config();
    redis_gate(&mut config.queues[0], &rig.redis.url(), "closed-budget");
    set(&rig.client, "closed-budget", "0").await;
    let d = rig.start(config).await;
    eventually(WAIT, "the expired claim put back", || async {
        zcard(&rig.client, QUEUE).await == 1
    })
    .await;
    let score: Option<f64> = rig
        .client
        .zscore(QUEUE, expired_member.as_str())
        .await
        .unwrap();
    assert_eq!(score, Some(deadline as f64));
    assert_eq!(
        rig.hash(&keys.claimed).await,
        HashMap::from([("live\0".to_owned(), live_member)])
    );
    assert_eq!(rig.index(&keys).await.len(), 1);
    assert_eq!(d.stats().reclaimed, 1);
    d.shutdown().await;
}

/// "renewed by a heartbeat every lease/3": a request in hand for longer than its lease is not
/// reclaimed from its live owner, and is answered once.
#[tokio::test]
async fn the_heartbeat_keeps_a_long_request_claimed() {
    let rig = Rig::with_latency(Duration::from_millis(2500)).await;
    rig.enqueue("slow", now() + 3600).await;
    let mut config = rig.config();
    // 100 s × 0.01 = a 1 s lease, renewed every 0.3 s; reclaimer every 0.15 s.
    config.sim.claim_lease = Duration::from_secs(100);
    let d = rig.start(config).await;
    let got = results(&rig.client, RESULTS, 1, WAIT).await;
    assert_eq!(got[0].status_code, Some(200));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(llen(&rig.client, RESULTS).await, 0, "answered once");
    assert_eq!(rig.gw.stats().total, 1, "sent once");
    let s = d.stats();
    assert_eq!((s.reclaimed, s.claims_lost), (0, 0));
    d.shutdown().await;
}

/// "429 and 5xx → retried … via a shared `retry-sortedset`" keeps working with claims: a retry
/// waits in the retry set, the mover puts it back into its request queue when due, where it is
/// claimed like any member; no claim is left once answered.
#[tokio::test]
async fn retries_work_with_claims() {
    let rig = Rig::new(GatewayConfig {
        failures: vec![FailureRule::new(FailureKind::Status503, 1.0).limit(2)],
        ..GatewayConfig::default()
    })
    .await;
    rig.enqueue("r", now() + 600).await;
    let d = rig.start(rig.config()).await;
    let got = results(&rig.client, RESULTS, 1, WAIT).await;
    assert_eq!(got[0].status_code, Some(200));
    assert_eq!(got[0].request_token.as_deref(), Some("tok-r"));
    assert_eq!(d.stats().retried, 2);
    let queue = ClaimKeys::for_queue(QUEUE);
    let retries = ClaimKeys::for_queue("retry-sortedset");
    eventually(WAIT, "no claims left", || async {
        rig.claim_count(&queue).await + rig.claim_count(&retries).await == 0
    })
    .await;
    assert_eq!(zcard(&rig.client, "retry-sortedset").await, 0);
    d.shutdown().await;
}

/// "gate refuses: the message goes back into the request queue at its deadline score", and its
/// claim is released. The gate decides in the poller (as observed on the real one), here a
/// `local-max-concurrency` gate of one slot while the first request is at the gateway.
#[tokio::test]
async fn a_gate_refusal_puts_the_message_back_and_releases_its_claim() {
    let rig = Rig::with_latency(Duration::from_millis(800)).await;
    let deadline = now() + 600;
    rig.enqueue("first", deadline).await;
    rig.enqueue("second", deadline + 7).await;
    let mut config = rig.config();
    config.queues[0] = QueueEntry {
        gate_type: Some("local-max-concurrency".into()),
        gate_params: [("limit".to_owned(), "1".to_owned())].into(),
        ..config.queues[0].clone()
    };
    let d = rig.start(config).await;
    eventually(WAIT, "the first at the gateway", || async {
        rig.gw.stats().in_flight == 1
    })
    .await;
    eventually(WAIT, "second refused", || async {
        d.stats().gate_refused >= 1
    })
    .await;
    let keys = ClaimKeys::for_queue(QUEUE);
    eventually(WAIT, "second back at its deadline, unclaimed", || async {
        let back: Vec<(String, f64)> = rig
            .client
            .zrange(QUEUE, 0, -1, None, false, None, true)
            .await
            .unwrap();
        back.len() == 1
            && back[0].1 == (deadline + 7) as f64
            && Envelope::parse(&back[0].0).unwrap().data.id == "second"
            && !rig
                .hash(&keys.claimed)
                .await
                .contains_key("second\0tok-second")
    })
    .await;
    let got = results(&rig.client, RESULTS, 2, WAIT).await;
    assert_eq!(got[1].id, "second");
    assert_eq!(rig.gw.stats().total, 2);
    eventually(WAIT, "no claims left", || async {
        rig.claim_count(&keys).await == 0
    })
    .await;
    d.shutdown().await;
}

/// "An ack script (owner checked)": a result whose claim now belongs to another dispatcher is
/// not written; the request comes back when that claim's lease runs out and is answered then.
#[tokio::test]
async fn the_ack_is_owner_checked() {
    let (rig, _) = Rig::with_r1(Duration::from_millis(800)).await;
    let d = rig.start_in_hand(rig.config()).await;
    let keys = ClaimKeys::for_queue(QUEUE);
    let _: i64 = rig
        .client
        .hset(keys.owners.as_str(), ("r1\0tok-r1", "someone-else"))
        .await
        .unwrap();
    eventually(WAIT, "the result refused", || async {
        d.stats().claims_lost == 1
    })
    .await;
    assert_eq!(llen(&rig.client, RESULTS).await, 0);
    // The lease (3 s) runs out, the reclaimer puts it back, and it is answered.
    let got = results(&rig.client, RESULTS, 1, WAIT).await;
    assert_eq!(got[0].id, "r1");
    let s = d.stats();
    assert_eq!(
        (s.reclaimed, s.claims_lost, rig.gw.stats().total),
        (1, 1, 2)
    );
    d.shutdown().await;
}

/// Observed on the real main (after #390; MONITOR, 100 lines with 30 % 503s): a retry is ZADDed
/// to `retry-sortedset` at now + backoff; every poll interval a mover reads the due ones
/// (`ZRANGE retry-sortedset -inf <now> BYSCORE LIMIT 0 <batch_size>`), ZREMs each and ZADDs it
/// byte for byte into its request queue at its deadline score; all 45 retries came back
/// byte-identical and none before it was due. A retry not yet due stays.
#[tokio::test]
async fn due_retries_move_back_byte_for_byte_into_the_request_queue_at_their_deadline() {
    let rig = Rig::new(GatewayConfig::default()).await;
    let deadline = now() + 600;
    let due = envelope(
        "due",
        deadline,
        &chat("a"),
        &format!(r#"{{"retry_count":1,"request_queue_name":"{QUEUE}","request_token":"t"}}"#),
    );
    let later = envelope("later", deadline, &chat("b"), r#"{"retry_count":1}"#);
    zadd(&rig.client, "retry-sortedset", (now() - 1) as f64, &due).await;
    zadd(&rig.client, "retry-sortedset", (now() + 100) as f64, &later).await;
    // The gate stays shut, so what the mover puts back stays where it lands.
    let mut config = rig.config();
    redis_gate(&mut config.queues[0], &rig.redis.url(), "closed-budget");
    set(&rig.client, "closed-budget", "0").await;
    let d = rig.start(config).await;
    eventually(WAIT, "the due retry in the request queue", || async {
        zcard(&rig.client, QUEUE).await == 1
    })
    .await;
    let score: Option<f64> = rig.client.zscore(QUEUE, due.as_str()).await.unwrap();
    assert_eq!(
        score,
        Some(deadline as f64),
        "byte for byte, at its deadline"
    );
    let left: Vec<String> = rig
        .client
        .zrange("retry-sortedset", 0, -1, None, false, None, false)
        .await
        .unwrap();
    assert_eq!(left, [later]);
    d.shutdown().await;
}
