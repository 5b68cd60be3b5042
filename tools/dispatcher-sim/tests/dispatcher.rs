//! Conformance of the simulated dispatcher with `dispatcher-contract.md` §2–§4, as v0.9 ("M"),
//! against a real redis-server and the simulated gateway. Each test quotes the sentence of the
//! contract it pins. v0.10 ("N", §6) is in `dispatcher_v0_10.rs`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use batch_testkit::{free_port, RedisServer};
use batch_wire::hash::body_digest;
use batch_wire::{Envelope, Outcome};
use common::*;
use dispatcher_sim::{
    Dispatcher, ExpiredPolicy, FailureKind, FailureRule, GatewayConfig, QueueEntry,
};
use fred::prelude::{KeysInterface, SortedSetsInterface};

const RESULTS: &str = "llm-d-async:results:pool-a:$batch";
const WAIT: Duration = Duration::from_secs(10);

impl Rig {
    /// Enqueues `n` chat requests routed to `RESULTS`, deadline an hour away; returns payloads.
    async fn enqueue_n(&self, n: usize) -> Vec<String> {
        let mut payloads = Vec::new();
        for i in 0..n {
            let payload = chat(&format!("question {i}"));
            enqueue(
                &self.client,
                QUEUE,
                &format!("req-{i}"),
                now() + 3600,
                &payload,
                &format!(r#"{{"request_token":"tok-{i}","result_queue_name":"{RESULTS}"}}"#),
            )
            .await;
            payloads.push(payload);
        }
        payloads
    }
}

/// "Score = deadline (seconds, as a float); the dispatcher takes the lowest score first." and
/// "takes up to n members, lowest score first (M: one ZPOPMIN each)".
#[tokio::test]
async fn lowest_deadline_first_across_members() {
    let rig = Rig::new(GatewayConfig::default()).await;
    let base = now() + 1000;
    // Inserted out of order; one at a time (batch 1, one worker) so order is observable.
    let deadlines = [base + 40, base + 10, base + 30, base, base + 20];
    for (i, d) in deadlines.iter().enumerate() {
        enqueue(
            &rig.client,
            QUEUE,
            &format!("r{i}"),
            *d,
            &chat(&format!("p{i}")),
            &internal_to(RESULTS),
        )
        .await;
    }
    let mut config = fast(&rig.redis.url(), vec![rig.entry()]);
    config.batch_size = 1;
    config.concurrency = 1;
    let d = rig.start(config).await;
    let results = results(&rig.client, RESULTS, 5, WAIT).await;
    let ids: Vec<&str> = results.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["r3", "r1", "r4", "r2", "r0"]);
    let seen: Vec<String> = rig
        .gw
        .recent_requests()
        .into_iter()
        .map(|r| r.body_digest)
        .collect();
    let expected: Vec<String> = [3, 1, 4, 2, 0]
        .iter()
        .map(|i| body_digest(chat(&format!("p{i}")).as_bytes()))
        .collect();
    assert_eq!(seen, expected, "the gateway saw them in deadline order");
    d.shutdown().await;
}

/// "If n = 0 nothing is taken." (`n = floor(batch_size × budget)`, budget 0.)
#[tokio::test]
async fn budget_zero_takes_nothing() {
    let rig = Rig::new(GatewayConfig::default()).await;
    rig.enqueue_n(3).await;
    let mut entry = rig.entry();
    redis_gate(&mut entry, &rig.redis.url(), "budget-zero");
    set(&rig.client, "budget-zero", "0").await;
    let d = rig.start(fast(&rig.redis.url(), vec![entry])).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(zcard(&rig.client, QUEUE).await, 3);
    assert_eq!(d.stats().taken, 0);
    assert_eq!(rig.gw.stats().total, 0);
    d.shutdown().await;
}

/// "Every `poll_interval_ms` (default 1000), per queue: `n = floor(batch_size × budget)`":
/// budget 0.5 with batch size 10 takes 5 per tick.
#[tokio::test]
async fn budget_half_with_batch_ten_takes_five_per_tick() {
    let rig = Rig::new(GatewayConfig::default()).await;
    rig.enqueue_n(12).await;
    let mut entry = rig.entry();
    redis_gate(&mut entry, &rig.redis.url(), "budget-half");
    set(&rig.client, "budget-half", "0.5").await;
    let mut config = fast(&rig.redis.url(), vec![entry]);
    config.poll_interval = Duration::from_millis(600);
    let started = Instant::now();
    let d = rig.start(config).await;
    // Ticks at about 0, 600 and 1200 ms; look between them.
    for (at, taken, left) in [(300, 5, 7), (900, 10, 2), (1500, 12, 0)] {
        tokio::time::sleep_until((started + Duration::from_millis(at)).into()).await;
        assert_eq!(d.stats().taken, taken, "at {at} ms");
        assert_eq!(zcard(&rig.client, QUEUE).await, left, "at {at} ms");
    }
    results(&rig.client, RESULTS, 12, WAIT).await;
    d.shutdown().await;
}

/// "`request_kind` … and `data` are required. A member without them is popped and dropped with
/// no result ever written", and "a string deadline fails to parse".
#[tokio::test]
async fn invalid_envelopes_are_dropped_without_result() {
    let rig = Rig::new(GatewayConfig::default()).await;
    let deadline = now() + 3600;
    // The seed's own example: a bare request message.
    let bare =
        format!(r#"{{"id":"bare","created":1,"deadline":{deadline},"payload":{{"model":"m"}}}}"#);
    let no_kind = format!(
        r#"{{"internal":{},"data":{{"id":"nokind","created":1,"deadline":{deadline},"payload":{{"model":"m"}}}}}}"#,
        internal_to(RESULTS)
    );
    let string_deadline = format!(
        r#"{{"internal":{},"request_kind":"plain","data":{{"id":"strdl","created":1,"deadline":"{deadline}","payload":{{"model":"m"}}}}}}"#,
        internal_to(RESULTS)
    );
    for m in [&bare, &no_kind, &string_deadline] {
        zadd(&rig.client, QUEUE, deadline as f64, m).await;
    }
    zadd(&rig.client, QUEUE, deadline as f64, "not json at all").await;
    rig.enqueue_to("good", deadline + 1, &chat("ok"), RESULTS)
        .await;
    let d = rig.start(fast(&rig.redis.url(), vec![rig.entry()])).await;
    let got = results(&rig.client, RESULTS, 1, WAIT).await;
    assert_eq!(got[0].id, "good");
    eventually(WAIT, "all taken", || async {
        zcard(&rig.client, QUEUE).await == 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        llen(&rig.client, RESULTS).await,
        0,
        "no result for invalid members"
    );
    assert_eq!(llen(&rig.client, "result-list").await, 0);
    let s = d.stats();
    assert_eq!(s.dropped_invalid, 4);
    assert_eq!(s.taken, 5);
    assert_eq!(rig.gw.stats().total, 1);
    d.shutdown().await;
}

/// "`deadline < now` (whole seconds): M drops it silently, no result".
#[tokio::test]
async fn expired_messages_are_dropped_silently_by_default() {
    let rig = Rig::new(GatewayConfig::default()).await;
    rig.enqueue_to("old", now() - 5, &chat("late"), RESULTS)
        .await;
    rig.enqueue_to("fresh", now() + 600, &chat("on time"), RESULTS)
        .await;
    let d = rig.start(fast(&rig.redis.url(), vec![rig.entry()])).await;
    let got = results(&rig.client, RESULTS, 1, WAIT).await;
    assert_eq!(got[0].id, "fresh");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(llen(&rig.client, RESULTS).await, 0);
    assert_eq!(d.stats().dropped_expired, 1);
    assert_eq!(rig.gw.stats().total, 1, "the expired one was never sent");
    d.shutdown().await;
}

/// "N writes a `DEADLINE_EXCEEDED` result" (`--sim.expired result`).
#[tokio::test]
async fn expired_messages_get_deadline_exceeded_with_the_switch() {
    let rig = Rig::new(GatewayConfig::default()).await;
    rig.enqueue_to("old", now() - 5, &chat("late"), RESULTS)
        .await;
    let mut config = fast(&rig.redis.url(), vec![rig.entry()]);
    config.sim.expired = ExpiredPolicy::Result;
    let d = rig.start(config).await;
    let got = results(&rig.client, RESULTS, 1, WAIT).await;
    assert_eq!(got[0].id, "old");
    assert_eq!(got[0].status_code, None);
    assert_eq!(got[0].error_code.as_deref(), Some("DEADLINE_EXCEEDED"));
    assert_eq!(rig.gw.stats().total, 0);
    assert_eq!(d.stats().results_for("DEADLINE_EXCEEDED"), 1);
    d.shutdown().await;
}

/// "`GET request-cancel:<id>` equals the message's `request_token`: a `CANCELLED` result" (at
/// dequeue), and a marker with another token cancels nothing.
#[tokio::test]
async fn a_cancel_marker_yields_cancelled() {
    let rig = Rig::new(GatewayConfig::default()).await;
    let deadline = now() + 600;
    enqueue(
        &rig.client,
        QUEUE,
        "c1",
        deadline,
        &chat("a"),
        &format!(r#"{{"request_token":"tok-1","result_queue_name":"{RESULTS}"}}"#),
    )
    .await;
    enqueue(
        &rig.client,
        QUEUE,
        "c2",
        deadline + 1,
        &chat("b"),
        &format!(r#"{{"request_token":"tok-2","result_queue_name":"{RESULTS}"}}"#),
    )
    .await;
    set(&rig.client, "request-cancel:c1", "tok-1").await;
    set(&rig.client, "request-cancel:c2", "an-older-token").await;
    let d = rig.start(fast(&rig.redis.url(), vec![rig.entry()])).await;
    let got: BTreeMap<String, _> = results(&rig.client, RESULTS, 2, WAIT)
        .await
        .into_iter()
        .map(|r| (r.id.clone(), r))
        .collect();
    assert_eq!(
        got["c1"].outcome(),
        Outcome::Failed {
            code: "CANCELLED",
            message: "cancelled"
        }
    );
    assert_eq!(got["c1"].payload, r#"{"error":"cancelled"}"#);
    assert_eq!(got["c2"].status_code, Some(200));
    assert_eq!(rig.gw.stats().total, 1, "the cancelled one was never sent");
    d.shutdown().await;
}

/// "At dequeue, and before sending, a matching marker yields a `CANCELLED` result": a message
/// waiting for a free worker is checked again.
#[tokio::test]
async fn a_cancel_marker_set_after_dequeue_is_seen_before_sending() {
    let rig = Rig::new(GatewayConfig {
        latency_fixed: Duration::from_millis(600),
        ..GatewayConfig::default()
    })
    .await;
    let deadline = now() + 600;
    rig.enqueue_to("first", deadline, &chat("a"), RESULTS).await;
    enqueue(
        &rig.client,
        QUEUE,
        "second",
        deadline + 1,
        &chat("b"),
        &format!(r#"{{"request_token":"tok-2","result_queue_name":"{RESULTS}"}}"#),
    )
    .await;
    let mut config = fast(&rig.redis.url(), vec![rig.entry()]);
    config.concurrency = 1;
    let d = rig.start(config).await;
    // "first" is at the gateway, "second" is taken and waits for the only worker.
    eventually(WAIT, "both taken, the first at the gateway", || async {
        d.stats().taken == 2 && rig.gw.stats().in_flight == 1
    })
    .await;
    set(&rig.client, "request-cancel:second", "tok-2").await;
    let got = results(&rig.client, RESULTS, 2, WAIT).await;
    assert_eq!(
        (got[0].id.as_str(), got[0].status_code),
        ("first", Some(200))
    );
    assert_eq!(got[1].id, "second");
    assert!(matches!(
        got[1].outcome(),
        Outcome::Failed {
            code: "CANCELLED",
            ..
        }
    ));
    assert_eq!(rig.gw.stats().total, 1);
    d.shutdown().await;
}

/// The retry_count of every member currently in the retry sorted set.
/// "429 and 5xx → retried …, `internal.retry_count` incremented; no retry limit, only the
/// deadline stops it". Observed on the real v0.9.0: the retry goes back into the request
/// queue (never into `retry-sortedset`), re-serialised with its retry count.
#[tokio::test]
async fn v0_9_retries_go_back_into_the_request_queue_until_success() {
    let rig = Rig::new(GatewayConfig {
        failures: vec![
            FailureRule::new(FailureKind::Status429, 1.0).limit(2),
            FailureRule::new(FailureKind::Status503, 1.0).limit(1),
        ],
        ..GatewayConfig::default()
    })
    .await;
    let payload = chat("try again");
    rig.enqueue_to("r", now() + 600, &payload, RESULTS).await;
    let d = rig.start(fast(&rig.redis.url(), vec![rig.entry()])).await;
    let got = results(&rig.client, RESULTS, 1, WAIT).await;
    assert_eq!(got[0].status_code, Some(200));
    assert!(got[0].payload.contains(&body_digest(payload.as_bytes())));
    let gw = rig.gw.stats();
    assert_eq!(
        (gw.responses(429), gw.responses(503), gw.responses(200)),
        (2, 1, 1)
    );
    let s = d.stats();
    assert_eq!((s.retried, s.dispatched, s.results_total()), (3, 4, 1));
    assert_eq!(
        s.taken, 4,
        "every retry is taken from the request queue again"
    );
    let retry_set: i64 = rig.client.exists("retry-sortedset").await.unwrap();
    assert_eq!(retry_set, 0, "v0.9.0 has no retry set");
    let digests: BTreeSet<String> = rig
        .gw
        .recent_requests()
        .into_iter()
        .map(|r| r.body_digest)
        .collect();
    assert_eq!(digests.len(), 1, "every retry re-sends the same bytes");
    d.shutdown().await;
}

/// Observed on the real v0.9.0 (MONITOR): a retry is ZADDed to its request queue at
/// now + backoff, far below every deadline score, so the next poll takes it again: all 23
/// retried requests of a 100-line run were taken again before their backoff score. Here a
/// `Retry-After` of 100 s (1 s scaled) does not hold the next attempt back.
#[tokio::test]
async fn v0_9_does_not_enforce_the_backoff_retries_jump_the_queue() {
    let rig = Rig::new(GatewayConfig {
        failures: vec![FailureRule::new(FailureKind::Status429, 1.0)],
        retry_after_secs: 100,
        ..GatewayConfig::default()
    })
    .await;
    let deadline = now() + 600;
    rig.enqueue_to("r", deadline, &chat("x"), RESULTS).await;
    let d = rig.start(fast(&rig.redis.url(), vec![rig.entry()])).await;
    // The member waiting between two polls: in the request queue, due in about 1 s, with
    // its retry count, re-serialised.
    let until = Instant::now() + WAIT;
    let (member, score) = loop {
        let members: Vec<(String, f64)> = rig
            .client
            .zrange(QUEUE, 0, -1, None, false, None, true)
            .await
            .unwrap();
        if let Some(first) = members.into_iter().find(|(m, _)| m.contains("retry_count")) {
            break first;
        }
        assert!(Instant::now() < until, "no retry seen in the request queue");
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    let env = Envelope::parse(&member).unwrap();
    assert!(env.internal.retry_count.unwrap_or(0) >= 1);
    let wait = score - now() as f64;
    assert!(
        wait > -1.0 && wait < 2.0,
        "due in {wait} s, not at the deadline"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        rig.gw.stats().total >= 4,
        "half a second held {} attempts: the 1 s backoff is not enforced",
        rig.gw.stats().total
    );
    d.shutdown().await;
}

/// "a longer `Retry-After` is honoured": in v0.10 (main after #390) the retry waits in
/// `retry-sortedset` scored at its due time (scaled).
#[tokio::test]
async fn v0_10_a_longer_retry_after_scores_the_retry_set() {
    let rig = Rig::new(GatewayConfig {
        failures: vec![FailureRule::new(FailureKind::Status429, 1.0)],
        retry_after_secs: 100,
        ..GatewayConfig::default()
    })
    .await;
    rig.enqueue_to("r", now() + 600, &chat("x"), RESULTS).await;
    let d = rig
        .start(fast_v0_10(&rig.redis.url(), vec![rig.entry()]))
        .await;
    eventually(WAIT, "a retry scheduled", || async {
        zcard(&rig.client, "retry-sortedset").await == 1
    })
    .await;
    let scheduled: Vec<(String, f64)> = rig
        .client
        .zrange("retry-sortedset", 0, -1, None, false, None, true)
        .await
        .unwrap();
    let wait = scheduled[0].1 - now() as f64;
    // 100 s × 0.01 = 1 s, where the 2–4 s window alone would give 20–40 ms.
    assert!(wait > 0.0 && wait < 2.0, "due in {wait} s");
    d.shutdown().await;
}

/// "only the deadline stops it, and then the last HTTP status and body are returned".
#[tokio::test]
async fn retries_stop_at_the_deadline_with_the_last_status_and_body() {
    let rig = Rig::new(GatewayConfig {
        failures: vec![FailureRule::new(FailureKind::Status503, 1.0)],
        ..GatewayConfig::default()
    })
    .await;
    rig.enqueue_to("r", now() + 2, &chat("x"), RESULTS).await;
    let mut config = fast(&rig.redis.url(), vec![rig.entry()]);
    config.sim.time_scale = 0.5; // 1–2 s, 2–4 s, …: the deadline comes first.
    let d = rig.start(config).await;
    let got = results(&rig.client, RESULTS, 1, WAIT).await;
    assert_eq!(got[0].status_code, Some(503));
    assert!(
        got[0].payload.contains("simulated overload"),
        "{}",
        got[0].payload
    );
    assert!(d.stats().retried <= 1);
    d.shutdown().await;
}

/// "4xx other than 429 → that status and body, no retry."
#[tokio::test]
async fn status_400_is_not_retried() {
    let rig = Rig::new(GatewayConfig {
        failures: vec![FailureRule::new(FailureKind::Status400, 1.0)],
        ..GatewayConfig::default()
    })
    .await;
    rig.enqueue_to("r", now() + 600, &chat("x"), RESULTS).await;
    let d = rig.start(fast(&rig.redis.url(), vec![rig.entry()])).await;
    let got = results(&rig.client, RESULTS, 1, WAIT).await;
    assert_eq!(got[0].status_code, Some(400));
    let body: serde_json::Value = serde_json::from_str(&got[0].payload).unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(rig.gw.stats().total, 1);
    assert_eq!(d.stats().retried, 0);
    assert_eq!(zcard(&rig.client, "retry-sortedset").await, 0);
    d.shutdown().await;
}

/// "Connection failure or request timeout → `INFERENCE_ERROR`, not retried." A closed port, a
/// reset connection and a gateway slower than `--request-timeout`.
#[tokio::test]
async fn connection_failures_and_timeouts_yield_inference_error() {
    let rig = Rig::new(GatewayConfig {
        latency_fixed: Duration::from_secs(3),
        failures: vec![FailureRule {
            path: Some("/v1/completions".into()),
            ..FailureRule::new(FailureKind::ConnectionReset, 1.0)
        }],
        ..GatewayConfig::default()
    })
    .await;
    let closed = format!("http://127.0.0.1:{}", free_port());
    let queues = vec![
        entry("q-closed", &closed),
        QueueEntry {
            request_path_url: Some("/v1/completions".into()),
            ..entry("q-reset", &rig.gw.base_url())
        },
        entry("q-slow", &rig.gw.base_url()),
    ];
    for (q, id) in [
        ("q-closed", "closed"),
        ("q-reset", "reset"),
        ("q-slow", "slow"),
    ] {
        enqueue(
            &rig.client,
            q,
            id,
            now() + 600,
            &chat(id),
            &internal_to(RESULTS),
        )
        .await;
    }
    let mut config = fast(&rig.redis.url(), queues);
    config.request_timeout = Duration::from_millis(300);
    let d = rig.start(config).await;
    let got: BTreeMap<String, _> = results(&rig.client, RESULTS, 3, WAIT)
        .await
        .into_iter()
        .map(|r| (r.id.clone(), r))
        .collect();
    for id in ["closed", "reset", "slow"] {
        let r = &got[id];
        assert_eq!(r.status_code, None, "{id}");
        assert_eq!(r.error_code.as_deref(), Some("INFERENCE_ERROR"), "{id}");
    }
    assert!(got["slow"]
        .error_message
        .as_deref()
        .unwrap()
        .contains("timed out"));
    assert_eq!(d.stats().retried, 0);
    assert_eq!(rig.gw.stats().resets, 1);
    d.shutdown().await;
}

/// "Which list: the queue entry's `result_queue_name` if set, else the message's
/// `internal.result_queue_name`, else the dispatcher's default", and "`metadata` is NOT sent back".
#[tokio::test]
async fn results_go_to_the_routed_list_and_carry_no_metadata() {
    let rig = Rig::new(GatewayConfig::default()).await;
    let pinned = QueueEntry {
        result_queue_name: Some("entry-results".into()),
        ..entry("q-pinned", &rig.gw.base_url())
    };
    let open = entry("q-open", &rig.gw.base_url());
    let deadline = now() + 600;
    enqueue(
        &rig.client,
        "q-pinned",
        "a",
        deadline,
        &chat("a"),
        &internal_to("envelope-results"),
    )
    .await;
    enqueue(
        &rig.client,
        "q-open",
        "b",
        deadline,
        &chat("b"),
        &internal_to("envelope-results"),
    )
    .await;
    enqueue(&rig.client, "q-open", "c", deadline, &chat("c"), "{}").await;
    let mut config = fast(&rig.redis.url(), vec![pinned, open]);
    config.default_result_queue = "default-results".into();
    let d = rig.start(config).await;
    for (list, id) in [
        ("entry-results", "a"),
        ("envelope-results", "b"),
        ("default-results", "c"),
    ] {
        let got = results(&rig.client, list, 1, WAIT).await;
        assert_eq!(got[0].id, id, "{list}");
        assert_eq!(got[0].metadata, None);
        assert_eq!(got[0].request_token, None, "v0.9 sends no request_token");
    }
    d.shutdown().await;
}

/// Read in the real v0.9.0 and main (`flushResultBatch`): the entry whose `result_queue_name`
/// applies is looked up by the member's own `internal.queue_id` when it carries one, not by the
/// queue it was taken from; an id naming no entry falls through to the envelope's list.
#[tokio::test]
async fn the_result_list_follows_the_members_own_queue_id() {
    let rig = Rig::new(GatewayConfig::default()).await;
    let pinned = QueueEntry {
        result_queue_name: Some("entry-results".into()),
        ..entry("q-pinned", &rig.gw.base_url())
    };
    let other = QueueEntry {
        id: Some("other".into()),
        result_queue_name: Some("other-results".into()),
        ..entry("q-other", &rig.gw.base_url())
    };
    let deadline = now() + 600;
    for (id, queue_id) in [("named", "other"), ("stranger", "nobody")] {
        enqueue(
            &rig.client,
            "q-pinned",
            id,
            deadline,
            &chat(id),
            &format!(r#"{{"queue_id":"{queue_id}","result_queue_name":"envelope-results"}}"#),
        )
        .await;
    }
    let d = rig.start(fast(&rig.redis.url(), vec![pinned, other])).await;
    let got = results(&rig.client, "other-results", 1, WAIT).await;
    assert_eq!(got[0].id, "named");
    let got = results(&rig.client, "envelope-results", 1, WAIT).await;
    assert_eq!(got[0].id, "stranger");
    assert_eq!(llen(&rig.client, "entry-results").await, 0);
    d.shutdown().await;
}

/// "it is POSTed to `igw_base_url + (endpoint or request_path_url)` …, `Content-Type:
/// application/json`, plus the message's `headers`"; "`payload` is a JSON object sent as the
/// POST body" (byte for byte).
#[tokio::test]
async fn the_payload_is_re_encoded_as_go_does_and_headers_are_forwarded() {
    let rig = Rig::new(GatewayConfig::default()).await;
    let payload = r#"{ "model" : "m",   "prompt":"spacing\u00e9 kept" , "max_tokens":2.0 }"#;
    let deadline = now() + 600;
    let member = format!(
        r#"{{"internal":{},"request_kind":"plain","data":{{"id":"h1","created":1,"deadline":{deadline},"payload":{payload},"headers":{{"X-Request-ID":"batch_req_h1","x-slo-ttft-ms":"1234"}},"endpoint":"/v1/embeddings"}}}}"#,
        internal_to(RESULTS)
    );
    zadd(&rig.client, QUEUE, deadline as f64, &member).await;
    rig.enqueue_to("h2", deadline + 1, payload, RESULTS).await;
    let mut e = rig.entry();
    e.request_path_url = Some("v1/completions".into());
    e.inference_objective = Some("batch-low".into());
    let d = rig.start(fast(&rig.redis.url(), vec![e])).await;
    let got = results(&rig.client, RESULTS, 2, WAIT).await;
    let seen = rig.gw.recent_requests();
    assert_eq!(seen.len(), 2);
    // What the real dispatcher POSTs: decoded into Go values and encoded again, keys sorted,
    // compact, the escape decoded, 2.0 written as 2.
    let digest = body_digest(r#"{"max_tokens":2,"model":"m","prompt":"spacingé kept"}"#.as_bytes());
    for s in &seen {
        assert_eq!(s.body_digest, digest);
        assert_eq!(s.method, "POST");
        assert_eq!(s.header("content-type"), Some("application/json"));
        assert_eq!(s.header("x-gateway-inference-objective"), Some("batch-low"));
    }
    assert_eq!(
        seen[0].path, "/v1/embeddings",
        "the message's endpoint wins"
    );
    assert_eq!(seen[0].header("x-request-id"), Some("batch_req_h1"));
    assert_eq!(seen[0].header("x-slo-ttft-ms"), Some("1234"));
    assert_eq!(seen[1].path, "/v1/completions");
    assert_eq!(seen[1].header("x-request-id"), None);
    assert!(got[0].payload.contains("\"object\":\"list\""));
    assert!(got[1].payload.contains(&format!("cmpl-{digest}")));
    d.shutdown().await;
}

/// Fault injection: "`--sim.duplicate-rate P` (push some results twice)".
#[tokio::test]
async fn duplicate_injection_pushes_results_twice() {
    let rig = Rig::new(GatewayConfig::default()).await;
    rig.enqueue_n(3).await;
    let mut config = fast(&rig.redis.url(), vec![rig.entry()]);
    config.sim.duplicate_rate = 1.0;
    let d = rig.start(config).await;
    let got = results(&rig.client, RESULTS, 6, WAIT).await;
    let mut per_id = BTreeMap::<String, Vec<String>>::new();
    for r in got {
        per_id.entry(r.id.clone()).or_default().push(r.to_json());
    }
    assert_eq!(per_id.len(), 3);
    for copies in per_id.values() {
        assert_eq!(copies.len(), 2);
        assert_eq!(copies[0], copies[1]);
    }
    let s = d.stats();
    assert_eq!((s.duplicated, s.results_total()), (3, 3));
    d.shutdown().await;
}

/// "Requests lost when the dispatcher is hard-killed between pop and send": `--sim.crash-after N`
/// takes exactly N, loses those in hand, and takes or writes nothing more.
#[tokio::test]
async fn crash_after_loses_exactly_the_messages_in_hand() {
    let rig = Rig::new(GatewayConfig {
        latency_fixed: Duration::from_millis(500),
        ..GatewayConfig::default()
    })
    .await;
    rig.enqueue_n(10).await;
    let mut config = fast(&rig.redis.url(), vec![rig.entry()]);
    config.sim.crash_after = Some(3);
    let d = rig.start(config).await;
    tokio::time::timeout(WAIT, d.crashed())
        .await
        .expect("crash-after fired");
    assert!(d.has_crashed());
    // Long enough for the gateway to have answered anything it got.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(d.stats().taken, 3);
    assert_eq!(zcard(&rig.client, QUEUE).await, 7, "exactly 3 taken");
    assert_eq!(
        llen(&rig.client, RESULTS).await,
        0,
        "those in hand got no result"
    );
    assert_eq!(zcard(&rig.client, "retry-sortedset").await, 0);
    assert!(
        rig.gw.stats().total <= 2,
        "the third was lost before sending"
    );
    // The 7 left are the ones with the latest deadlines... all equal here, so check identity.
    let left: Vec<String> = rig
        .client
        .zrange(QUEUE, 0, -1, None, false, None, false)
        .await
        .unwrap();
    assert_eq!(left.len(), 7);
    d.shutdown().await;
}

/// "gate refuses: the message goes back into the request queue at its deadline score", re-serialised.
/// Observed on the real v0.9.0 (MONITOR, `local-max-concurrency` limit 2, 300 lines): the gate
/// is applied in the poller right after the cancel check; a refused member is ZADDed back at its
/// bare deadline, re-serialised (`queue_id` filled in), below every fractional score of its
/// job, so the next ZPOPMIN of the same poll takes the same member again (3,003 ZPOPMIN and
/// 2,682 refusals for 300 lines).
#[tokio::test]
async fn a_refused_member_goes_back_at_its_bare_deadline_and_is_popped_again_in_the_same_poll() {
    let rig = Rig::new(GatewayConfig {
        latency_fixed: Duration::from_millis(600),
        ..GatewayConfig::default()
    })
    .await;
    let deadline = now() + 600;
    let mut originals = Vec::new();
    for (i, frac) in [0.25, 0.5, 0.75].into_iter().enumerate() {
        let member = envelope(
            &format!("j{i}"),
            deadline,
            &chat(&format!("{i}")),
            &internal_to(RESULTS),
        );
        zadd(&rig.client, QUEUE, deadline as f64 + frac, &member).await;
        originals.push(member);
    }
    let mut e = rig.entry();
    e.gate_type = Some("local-max-concurrency".into());
    e.gate_params.insert("limit".into(), "1".into());
    e.id = Some("pool-a".into());
    let mut config = fast(&rig.redis.url(), vec![e]);
    config.poll_interval = Duration::from_millis(200);
    let d = rig.start(config).await;
    eventually(WAIT, "the first at the gateway", || async {
        rig.gw.stats().in_flight == 1
    })
    .await;
    // One poll of batch 10: one sent, then nine pops of the same refused member.
    eventually(WAIT, "nine refusals", || async {
        d.stats().gate_refused >= 9
    })
    .await;
    let back: Vec<(String, f64)> = rig
        .client
        .zrange(QUEUE, 0, -1, None, false, None, true)
        .await
        .unwrap();
    assert_eq!(back.len(), 2);
    assert_eq!(back[0].1, deadline as f64, "the bare deadline, no fraction");
    assert_eq!(back[1], (originals[2].clone(), deadline as f64 + 0.75));
    let env = Envelope::parse(&back[0].0).unwrap();
    assert_eq!(env.data.id, "j1");
    assert_ne!(back[0].0, originals[1], "re-serialised");
    assert_eq!(env.internal.queue_id.as_deref(), Some("pool-a"));
    assert_eq!(env.internal.request_queue_name.as_deref(), Some(QUEUE));
    let got = results(&rig.client, RESULTS, 3, WAIT).await;
    let ids: Vec<&str> = got.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["j0", "j1", "j2"]);
    assert_eq!(rig.gw.stats().total, 3, "each sent once");
    d.shutdown().await;
}

/// "`redis` (budget read as a float from a Redis key, `budget_key`, default
/// `dispatch-gate-budget`)". Observed on the real v0.9.0 and main: budget 0 takes nothing (a
/// GET of the key and a ZCARD per poll), and a missing key is budget 1, an open gate.
#[tokio::test]
async fn the_redis_gate_reads_its_budget_key_and_a_missing_key_is_open() {
    let rig = Rig::new(GatewayConfig::default()).await;
    rig.enqueue_n(4).await;
    let mut e = rig.entry();
    redis_gate(&mut e, &rig.redis.url(), "dispatch-gate-budget");
    set(&rig.client, "dispatch-gate-budget", "0").await;
    let d = rig.start(fast(&rig.redis.url(), vec![e])).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(d.stats().taken, 0, "budget 0");
    set(&rig.client, "dispatch-gate-budget", "0.2").await; // floor(10 × 0.2) = 2 per tick
    results(&rig.client, RESULTS, 4, WAIT).await;
    assert_eq!(d.stats().taken, 4);
    let _: i64 = rig.client.del("dispatch-gate-budget").await.unwrap();
    rig.enqueue_n(2).await;
    results(&rig.client, RESULTS, 2, WAIT).await;
    assert_eq!(d.stats().taken, 6, "a missing key opens the gate");
    d.shutdown().await;
}

/// "`prometheus-budget` (`pool`, `max_concurrency` default 100, `baseline` default 0.05 …;
/// budget = D − B)", computed from the embedded gateway's in-flight count.
#[tokio::test]
async fn the_prometheus_budget_gate_follows_the_embedded_gateways_load() {
    let redis = RedisServer::start();
    let client = common::redis_client(&redis.url()).await;
    let gw = gateway(GatewayConfig {
        latency_fixed: Duration::from_millis(400),
        ..GatewayConfig::default()
    })
    .await;
    for i in 0..8 {
        enqueue(
            &client,
            QUEUE,
            &format!("p{i}"),
            now() + 600,
            &chat(&format!("{i}")),
            &internal_to(RESULTS),
        )
        .await;
    }
    let e = QueueEntry {
        gate_type: Some("prometheus-budget".into()),
        gate_params: [("max_concurrency", "4"), ("baseline", "0")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        ..QueueEntry::new(QUEUE)
    };
    let mut config = fast(&redis.url(), vec![e]);
    config.batch_size = 4;
    config.prometheus_cache_ttl = Duration::ZERO;
    let d = Dispatcher::start(config, Some(&gw)).await.unwrap();
    results(&client, RESULTS, 8, WAIT).await;
    let s = gw.stats();
    assert_eq!(s.responses(200), 8);
    // Without the gate all 8 would be in flight at once (4 per 50 ms poll, 400 ms each). The
    // gate reads the load when it takes (as the real one does, per poll and per message), so
    // a message taken but not yet at the gateway is not counted: it may overshoot by one.
    assert!(
        s.max_in_flight_seen <= 5,
        "budget 0 at 4 in flight, saw {}",
        s.max_in_flight_seen
    );
    d.shutdown().await;
}

/// The most requests at the gateway at once when 12 go through the gate `gate` builds (given
/// the gateway's metrics page), its load readings reused for `cache_ttl`, in front of `server`
/// (400 ms answers), 4 taken per poll.
async fn peak_through(
    server: GatewayConfig,
    gate: impl FnOnce(&str) -> (String, BTreeMap<String, String>),
    cache_ttl: Duration,
) -> usize {
    let redis = RedisServer::start();
    let client = common::redis_client(&redis.url()).await;
    let gw = gateway(server).await;
    for i in 0..12 {
        let id = format!("p{i}");
        enqueue(
            &client,
            QUEUE,
            &id,
            now() + 600,
            &chat(&id),
            &internal_to(RESULTS),
        )
        .await;
    }
    let (gate_type, gate_params) = gate(&format!("{}/metrics", gw.base_url()));
    let e = QueueEntry {
        gate_type: Some(gate_type),
        gate_params,
        ..QueueEntry::new(QUEUE)
    };
    let mut config = fast(&redis.url(), vec![e]);
    config.batch_size = 4;
    config.prometheus_cache_ttl = cache_ttl;
    let d = Dispatcher::start(config, Some(&gw)).await.unwrap();
    results(&client, RESULTS, 12, WAIT).await;
    let s = gw.stats();
    assert_eq!(s.responses(200), 12);
    d.shutdown().await;
    s.max_in_flight_seen
}

/// String gate parameters from pairs.
fn params(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// [`peak_through`] a `prometheus-budget` gate of `max_concurrency`, baseline 0.
async fn gated_peak(server: GatewayConfig, max_concurrency: &str, cache_ttl: Duration) -> usize {
    let gate = |_: &str| {
        (
            "prometheus-budget".to_owned(),
            params(&[("max_concurrency", max_concurrency), ("baseline", "0")]),
        )
    };
    peak_through(server, gate, cache_ttl).await
}

/// The real gate reads `vllm:num_requests_running`, which a model server caps at its
/// `max_num_seqs`: the requests waiting in the server's queue are not counted, so a gate sized
/// above `max_num_seqs` never closes and the whole batch lands in the server's queue. Sized to
/// it, the gate holds the batch at the server's slots.
#[tokio::test]
async fn the_prometheus_budget_gate_counts_running_requests_not_waiting_ones() {
    let vllm = || GatewayConfig {
        latency_fixed: Duration::from_millis(400),
        max_num_seqs: Some(4),
        ..GatewayConfig::default()
    };
    let above = gated_peak(vllm(), "8", Duration::ZERO).await;
    assert!(
        above >= 10,
        "running never reaches 8 with 4 slots, so the gate stays open: saw only {above} at once"
    );
    let sized = gated_peak(vllm(), "4", Duration::ZERO).await;
    assert!(
        sized <= 5,
        "budget 0 at 4 running: saw {sized} at once (one may overshoot)"
    );
}

/// An `endpoint-scrape` gate's parameters: `metric` of `page`, `max_count_per_pod` `max`,
/// baseline 0.
fn scrape_params(page: &str, metric: &str, max: &str) -> BTreeMap<String, String> {
    params(&[
        ("url", page),
        ("metric", metric),
        ("max_count_per_pod", max),
        ("baseline", "0"),
    ])
}

/// The same gate as an entry of a composite's `gates`.
fn scrape(page: &str, metric: &str, max: &str) -> serde_json::Value {
    serde_json::json!({"gate_type": "endpoint-scrape", "gate_params": scrape_params(page, metric, max)})
}

/// A `composite` gate of `gates`.
fn composite(gates: serde_json::Value) -> (String, BTreeMap<String, String>) {
    (
        "composite".to_owned(),
        params(&[("gates", gates.to_string().as_str())]),
    )
}

/// The `endpoint-scrape` gate reads a model server's page itself: with `max_count_per_pod` 4 on
/// `vllm:num_requests_running` it holds the batch at 4 running, alone or inside a `composite`
/// (the least budget of its gates), as `processor queues` prints it for a pool whose pages are
/// known.
#[tokio::test]
async fn an_endpoint_scrape_gate_holds_the_batch_at_the_servers_slots() {
    for in_composite in [false, true] {
        let server = GatewayConfig {
            latency_fixed: Duration::from_millis(400),
            max_num_seqs: Some(8),
            ..GatewayConfig::default()
        };
        let gate = |page: &str| {
            let running = ("vllm:num_requests_running", "4");
            if in_composite {
                let one = scrape(page, running.0, running.1);
                composite(serde_json::json!([one, {"gate_type": "constant"}]))
            } else {
                (
                    "endpoint-scrape".to_owned(),
                    scrape_params(page, running.0, running.1),
                )
            }
        };
        let peak = peak_through(server, gate, Duration::ZERO).await;
        assert!(
            peak <= 5,
            "composite {in_composite}: budget 0 at 4 running, saw {peak}"
        );
    }
}

/// A waiting gate beside the running one (what `processor queues` prints with `metrics_urls`):
/// the running gate alone, sized above the server's 4 slots, would let all 12 in; the waiting
/// gate (`vllm:num_requests_waiting`, `max_count_per_pod` 1) closes as soon as one waits.
#[tokio::test]
async fn a_waiting_gate_closes_as_soon_as_a_request_queues() {
    let server = GatewayConfig {
        latency_fixed: Duration::from_millis(400),
        max_num_seqs: Some(4),
        ..GatewayConfig::default()
    };
    let gate = |page: &str| {
        composite(serde_json::json!([
            scrape(page, "vllm:num_requests_running", "8"),
            scrape(page, "vllm:num_requests_waiting", "1"),
        ]))
    };
    let peak = peak_through(server, gate, Duration::ZERO).await;
    // 4 running, and the poll that first sees one waiting may have sent one more.
    assert!(peak <= 6, "closed once one waits: saw {peak} at once");
}

/// The real gate reuses a reading for `--prometheus-cache-ttl`: while it does, every poll
/// releases on the load it saw first, so a gate that would hold 4 lets a burst through.
#[tokio::test]
async fn a_cached_load_reading_lets_a_burst_past_the_gate() {
    let slow = || GatewayConfig {
        latency_fixed: Duration::from_millis(400),
        ..GatewayConfig::default()
    };
    let stale = gated_peak(slow(), "4", Duration::from_secs(3)).await;
    assert!(
        stale >= 8,
        "a reading of 0 reused for 3 s opens the gate at every poll: saw only {stale} at once"
    );
    let fresh = gated_peak(slow(), "4", Duration::ZERO).await;
    assert!(fresh <= 5, "read at every poll: saw {fresh} at once");
}

/// Startup errors: a gate the real one would refuse (here `local-max-concurrency` without its
/// `limit`) is named; a queue without `igw_base_url` needs the embedded gateway.
#[tokio::test]
async fn startup_refuses_unknown_gates_and_queues_without_a_gateway() {
    let mut e = QueueEntry::new(QUEUE);
    e.igw_base_url = Some("http://127.0.0.1:9".into());
    e.gate_type = Some("local-max-concurrency".into());
    let err = Dispatcher::start(fast("redis://127.0.0.1:9", vec![e]), None)
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("local-max-concurrency"), "{err}");
    let err = Dispatcher::start(
        fast("redis://127.0.0.1:9", vec![QueueEntry::new(QUEUE)]),
        None,
    )
    .await
    .err()
    .unwrap();
    assert!(err.to_string().contains("--embedded-gateway"), "{err}");
    let err = Dispatcher::start(
        fast("not a url", vec![entry(QUEUE, "http://127.0.0.1:9")]),
        None,
    )
    .await
    .err()
    .unwrap();
    assert!(err.to_string().contains("redis URL"), "{err}");
}

/// "Redis errors: retry with backoff and log, never panic": a dispatcher outlives a Redis
/// restart and carries on.
#[tokio::test]
async fn survives_a_redis_restart() {
    let mut redis = RedisServer::builder().aof(true).start();
    let gw = gateway(GatewayConfig::default()).await;
    let d = Dispatcher::start(fast(&redis.url(), vec![entry(QUEUE, &gw.base_url())]), None)
        .await
        .unwrap();
    {
        let client = common::redis_client(&redis.url()).await;
        enqueue(
            &client,
            QUEUE,
            "before",
            now() + 600,
            &chat("a"),
            &internal_to(RESULTS),
        )
        .await;
        results(&client, RESULTS, 1, WAIT).await;
    }
    redis.kill();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    redis.restart();
    let client = common::redis_client(&redis.url()).await;
    enqueue(
        &client,
        QUEUE,
        "after",
        now() + 600,
        &chat("b"),
        &internal_to(RESULTS),
    )
    .await;
    let got = results(&client, RESULTS, 1, Duration::from_secs(20)).await;
    assert_eq!(got[0].id, "after");
    assert_eq!(d.stats().taken, 2);
    d.shutdown().await;
}

/// The dispatcher's counters on its own `/metrics` (taken, dispatched, results by outcome, dropped).
#[tokio::test]
async fn counters_are_served_on_metrics() {
    let rig = Rig::new(GatewayConfig::default()).await;
    rig.enqueue_n(2).await;
    zadd(&rig.client, QUEUE, 1.0, "junk").await;
    let mut config = fast(&rig.redis.url(), vec![rig.entry()]);
    config.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let d = rig.start(config).await;
    results(&rig.client, RESULTS, 2, WAIT).await;
    let addr = d.metrics_addr().unwrap();
    eventually(WAIT, "metrics", || async {
        let (_, page) = get(&format!("http://{addr}/metrics")).await;
        [
            "dispatcher_taken_total 3",
            "dispatcher_dispatched_total 2",
            "dispatcher_results_total{outcome=\"200\"} 2",
            "dispatcher_dropped_total{reason=\"invalid\"} 1",
        ]
        .iter()
        .all(|l| page.lines().any(|p| p == *l))
    })
    .await;
    d.shutdown().await;
}

/// Fault injection: "`--sim.result-delay D`" holds each result back before it is pushed.
#[tokio::test]
async fn result_delay_holds_results_back() {
    let rig = Rig::new(GatewayConfig::default()).await;
    rig.enqueue_n(1).await;
    let mut config = fast(&rig.redis.url(), vec![rig.entry()]);
    config.sim.result_delay = Duration::from_millis(600);
    let d = rig.start(config).await;
    eventually(WAIT, "answered", || async {
        rig.gw.stats().responses(200) == 1
    })
    .await;
    let answered = Instant::now();
    assert_eq!(
        llen(&rig.client, RESULTS).await,
        0,
        "pushed before the delay"
    );
    results(&rig.client, RESULTS, 1, WAIT).await;
    assert!(
        answered.elapsed() >= Duration::from_millis(400),
        "{:?}",
        answered.elapsed()
    );
    d.shutdown().await;
}

/// Observed on the real v0.9.0 and main (MONITOR): after each result is pushed, a script
/// deletes `request-active:<id>` and `request-cancel:<id>` when they hold the request's token;
/// keys holding another token (a later attempt's) stay.
#[tokio::test]
async fn a_pushed_result_clears_the_active_and_cancel_keys_that_hold_its_token() {
    let rig = Rig::new(GatewayConfig::default()).await;
    set(&rig.client, "request-active:mine", "tok").await;
    set(&rig.client, "request-active:other", "newer-token").await;
    for id in ["mine", "other"] {
        enqueue(
            &rig.client,
            QUEUE,
            id,
            now() + 600,
            &chat(id),
            &format!(r#"{{"request_token":"tok","result_queue_name":"{RESULTS}"}}"#),
        )
        .await;
    }
    let d = rig.start(fast(&rig.redis.url(), vec![rig.entry()])).await;
    results(&rig.client, RESULTS, 2, WAIT).await;
    eventually(WAIT, "the active key cleared", || async {
        let n: i64 = rig.client.exists("request-active:mine").await.unwrap();
        n == 0
    })
    .await;
    let kept: Option<String> = rig.client.get("request-active:other").await.unwrap();
    assert_eq!(kept.as_deref(), Some("newer-token"));
    d.shutdown().await;
}

/// The real worker checks the deadline again before sending: a message whose deadline passed
/// while it waited for a worker gets `DEADLINE_EXCEEDED`, even from v0.9 (only the dequeue
/// side drops expired members silently).
#[tokio::test]
async fn a_deadline_passing_while_waiting_for_a_worker_yields_deadline_exceeded() {
    let rig = Rig::new(GatewayConfig {
        latency_fixed: Duration::from_millis(2500),
        ..GatewayConfig::default()
    })
    .await;
    let deadline = now() + 1;
    for id in ["slow", "late"] {
        enqueue(
            &rig.client,
            QUEUE,
            id,
            deadline,
            &chat(id),
            &internal_to(RESULTS),
        )
        .await;
    }
    let mut config = fast(&rig.redis.url(), vec![rig.entry()]);
    config.concurrency = 1;
    let d = rig.start(config).await;
    let got = results(&rig.client, RESULTS, 2, WAIT).await;
    // The one taken second waited out the first's 2.5 s on the only worker.
    let mut outcomes: Vec<String> = got
        .iter()
        .map(|r| match (r.status_code, &r.error_code) {
            (Some(s), _) => s.to_string(),
            (None, code) => code.clone().unwrap_or_default(),
        })
        .collect();
    outcomes.sort();
    assert_eq!(outcomes, ["200", "DEADLINE_EXCEEDED"]);
    assert_eq!(rig.gw.stats().total, 1, "the late one is never sent");
    d.shutdown().await;
}

/// Observed in the real code path: Go decodes the payload into `map[string]any`, so a number
/// beyond float64 (`1e400`) makes the member undecodable: it is dropped with no result.
#[tokio::test]
async fn a_payload_go_cannot_decode_is_dropped_without_a_result() {
    let rig = Rig::new(GatewayConfig::default()).await;
    rig.enqueue_to(
        "huge",
        now() + 600,
        r#"{"model":"m","prompt":"p","seed":1e400}"#,
        RESULTS,
    )
    .await;
    rig.enqueue_to("fine", now() + 601, &chat("fine"), RESULTS)
        .await;
    let d = rig.start(fast(&rig.redis.url(), vec![rig.entry()])).await;
    let got = results(&rig.client, RESULTS, 1, WAIT).await;
    assert_eq!(got[0].id, "fine");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(llen(&rig.client, RESULTS).await, 0);
    assert_eq!(d.stats().dropped_invalid, 1);
    assert_eq!(rig.gw.stats().total, 1);
    d.shutdown().await;
}
