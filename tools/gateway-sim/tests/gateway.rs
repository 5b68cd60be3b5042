//! The fake inference gateway, over real HTTP on loopback.

mod common;

use std::time::{Duration, Instant};

use batch_wire::hash::body_digest;
use common::{get, post};
use gateway_sim::{
    FailureKind, FailureRule, Gateway, GatewayConfig, GatewayHandle, SeenRequest, Unseen,
};
use serde_json::Value;

async fn start(config: GatewayConfig) -> GatewayHandle {
    Gateway::start("127.0.0.1:0".parse().unwrap(), config)
        .await
        .unwrap()
}

/// Every reply is deterministic and names the digest of the exact request bytes, in the id and
/// in the content, so an output line can be matched to its own input line.
#[tokio::test]
async fn replies_name_the_digest_of_the_exact_body() {
    let gw = start(GatewayConfig::default()).await;
    let url = gw.base_url();

    let body = r#"{"model":"llama",  "messages":[{"role":"user","content":"what is 2+2"}],"max_tokens":7}"#;
    let (status, headers, reply) = post(&format!("{url}/v1/chat/completions"), body, &[])
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "application/json");
    let digest = body_digest(body.as_bytes());
    let v: Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(v["id"], format!("chatcmpl-{digest}"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "llama");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        format!("digest:{digest}")
    );
    assert_eq!(v["usage"]["completion_tokens"], 7);
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["usage"]["total_tokens"], 10);
    let (_, _, again) = post(&format!("{url}/v1/chat/completions"), body, &[])
        .await
        .unwrap();
    assert_eq!(again, reply, "replies must be deterministic");

    // One byte of whitespace more is another request, with another digest.
    let other = body.replacen("  ", " ", 1);
    let (_, _, r2) = post(&format!("{url}/v1/chat/completions"), &other, &[])
        .await
        .unwrap();
    assert!(r2.contains(&body_digest(other.as_bytes())) && !r2.contains(&digest));

    let body = r#"{"model":"m","prompt":"once upon"}"#;
    let (status, _, reply) = post(&format!("{url}/v1/completions"), body, &[])
        .await
        .unwrap();
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["id"], format!("cmpl-{}", body_digest(body.as_bytes())));
    assert_eq!(
        v["usage"]["completion_tokens"], 16,
        "16 tokens when max_tokens is absent"
    );

    let body = r#"{"model":"e","input":"hello"}"#;
    let (status, _, reply) = post(&format!("{url}/v1/embeddings"), body, &[])
        .await
        .unwrap();
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["object"], "embedding");
    assert!(reply.contains(&body_digest(body.as_bytes())));

    assert_eq!(gw.stats().responses(200), 5);
    gw.shutdown().await;
}

/// Malformed request bodies get a 400 with an OpenAI-style error body, never a crash.
#[tokio::test]
async fn malformed_bodies_get_an_openai_400() {
    let gw = start(GatewayConfig::default()).await;
    let url = format!("{}/v1/chat/completions", gw.base_url());
    for (body, needle) in [
        ("{not json", "malformed JSON"),
        ("[1,2]", "JSON object"),
        (r#"{"messages":[]}"#, "model"),
        ("", "malformed JSON"),
    ] {
        let (status, _, reply) = post(&url, body, &[]).await.unwrap();
        assert_eq!(status, 400, "{body}");
        let v: Value = serde_json::from_str(&reply).unwrap();
        let err = &v["error"];
        assert!(err["message"].as_str().unwrap().contains(needle), "{reply}");
        assert_eq!(err["type"], "invalid_request_error");
        assert!(
            err.get("param").is_some() && err.get("code").is_some(),
            "{reply}"
        );
    }
    let (status, _, _) = post(&format!("{}/v1/unknown", gw.base_url()), "{}", &[])
        .await
        .unwrap();
    assert_eq!(status, 404);
    let (status, _, _) = post(&url, r#"{"model":"m"}"#, &[]).await.unwrap();
    assert_eq!(status, 200, "still serving after bad requests");
    assert_eq!(gw.stats().responses(400), 4);
}

/// Latency = fixed + per token × max_tokens (max_completion_tokens too).
#[tokio::test]
async fn latency_grows_with_requested_tokens() {
    let gw = start(GatewayConfig {
        latency_fixed: Duration::from_millis(50),
        latency_per_token: Duration::from_millis(5),
        ..GatewayConfig::default()
    })
    .await;
    let url = format!("{}/v1/completions", gw.base_url());
    for (body, at_least) in [
        (r#"{"model":"m","max_tokens":60}"#, 350),
        (r#"{"model":"m","max_completion_tokens":30}"#, 200),
        (r#"{"model":"m"}"#, 130),
    ] {
        let started = Instant::now();
        let (status, _, _) = post(&url, body, &[]).await.unwrap();
        assert_eq!(status, 200);
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(at_least),
            "{body} took {took:?}"
        );
    }
}

/// With a length model, each answer's length is drawn (whatever max_tokens says), reported in
/// usage.completion_tokens and charged per token; the stats add up what was served.
#[tokio::test]
async fn drawn_lengths_are_reported_in_usage_and_charged_per_token() {
    let gw = start(GatewayConfig {
        latency_fixed: Duration::from_millis(2),
        latency_per_token: Duration::from_micros(200),
        length_median: Some(40),
        seed: Some(3),
        ..GatewayConfig::default()
    })
    .await;
    let url = format!("{}/v1/chat/completions", gw.base_url());
    let mut lengths = Vec::new();
    for _ in 0..30 {
        let started = Instant::now();
        let (status, _, body) = post(&url, r#"{"model":"m","max_tokens":16,"messages":[]}"#, &[])
            .await
            .unwrap();
        let took = started.elapsed();
        assert_eq!(status, 200);
        let reply: Value = serde_json::from_str(&body).unwrap();
        let tokens = reply["usage"]["completion_tokens"].as_u64().unwrap();
        let charged = Duration::from_millis(2) + Duration::from_micros(200) * tokens as u32;
        assert!(took >= charged, "{tokens} tokens in {took:?}");
        lengths.push(tokens);
    }
    lengths.sort_unstable();
    lengths.dedup();
    assert!(lengths.len() > 10, "lengths vary: {lengths:?}");
    let stats = gw.stats();
    assert_eq!(stats.answered, 30);
    let mean_tokens = stats.completion_tokens_total as f64 / 30.0;
    let unloaded = stats.mean_unloaded_latency().unwrap();
    let expected = Duration::from_millis(2) + Duration::from_micros(200).mul_f64(mean_tokens);
    assert!(
        unloaded.abs_diff(expected) < Duration::from_micros(20),
        "{unloaded:?} vs {expected:?}"
    );
    assert!(stats.mean_latency().unwrap() >= unloaded);
    let per_token = stats.mean_token_time().unwrap();
    assert!(per_token >= Duration::from_micros(199), "{per_token:?}");
}

/// A cost the usage does not show: two kinds of request, one 10 times slower, each reporting
/// the same 16 tokens; the gateway's unloaded latency counts each request's own cost.
#[tokio::test]
async fn an_unseen_cost_varies_the_latency_but_not_the_usage() {
    let gw = start(GatewayConfig {
        latency_fixed: Duration::from_millis(2),
        unseen: Unseen::TwoKinds { a: 1.0, b: 10.0 },
        seed: Some(5),
        ..GatewayConfig::default()
    })
    .await;
    let url = format!("{}/v1/chat/completions", gw.base_url());
    let (mut fast, mut slow) = (0, 0);
    for _ in 0..40 {
        let started = Instant::now();
        let (status, _, body) = post(&url, r#"{"model":"m","max_tokens":16,"messages":[]}"#, &[])
            .await
            .unwrap();
        let took = started.elapsed();
        assert_eq!(status, 200);
        let reply: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(reply["usage"]["completion_tokens"], 16);
        if took >= Duration::from_millis(20) {
            slow += 1;
        } else {
            fast += 1;
        }
    }
    assert!(fast >= 8 && slow >= 8, "{fast} fast, {slow} slow");
    let unloaded = gw.stats().mean_unloaded_latency().unwrap();
    let expected = Duration::from_millis(2) * (fast + 10 * slow) / 40;
    assert!(
        unloaded.abs_diff(expected) < Duration::from_micros(50),
        "{unloaded:?} vs {expected:?}"
    );
    let bad = GatewayConfig {
        unseen: Unseen::Tail {
            share: 1.5,
            factor: 10.0,
        },
        ..GatewayConfig::default()
    };
    assert!(bad.validate().is_err());
}

/// Prompt processing that the usage shows: a prompt of 40 words takes 40 × 1 ms more than an
/// empty one, and its answer reports the 40 prompt tokens.
#[tokio::test]
async fn a_long_prompt_takes_longer_and_says_so() {
    let gw = start(GatewayConfig {
        latency_fixed: Duration::from_millis(5),
        latency_per_prompt_token: Duration::from_millis(1),
        ..GatewayConfig::default()
    })
    .await;
    let url = format!("{}/v1/chat/completions", gw.base_url());
    let words = vec!["word"; 40].join(" ");
    let long = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": words}]});
    let short = r#"{"model":"m","messages":[]}"#;
    let started = Instant::now();
    let (status, _, body) = post(&url, &long.to_string(), &[]).await.unwrap();
    let long_took = started.elapsed();
    assert_eq!(status, 200);
    let reply: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(reply["usage"]["prompt_tokens"], 40);
    let started = Instant::now();
    let (status, _, _) = post(&url, short, &[]).await.unwrap();
    let short_took = started.elapsed();
    assert_eq!(status, 200);
    assert!(long_took >= Duration::from_millis(45), "{long_took:?}");
    assert!(short_took < Duration::from_millis(40), "{short_took:?}");
    let unloaded = gw.stats().mean_unloaded_latency().unwrap();
    assert_eq!(unloaded, Duration::from_micros(25_000));
    let vllm = GatewayConfig {
        latency_per_prompt_token: Duration::from_millis(1),
        max_num_seqs: Some(4),
        ..GatewayConfig::default()
    };
    assert!(vllm.validate().is_err());
}

/// A fast and a slow pod behind one URL: alone a request lands on the fast one; with one in
/// flight there, the next goes to the slow one, whose answer takes its factor longer.
#[tokio::test]
async fn pods_behind_one_url_fill_the_least_busy_first() {
    let gw = start(GatewayConfig {
        latency_fixed: Duration::from_millis(100),
        pod_factors: vec![1.0, 3.0],
        ..GatewayConfig::default()
    })
    .await;
    let url = format!("{}/v1/chat/completions", gw.base_url());
    let body = r#"{"model":"m","messages":[]}"#;
    let started = Instant::now();
    post(&url, body, &[]).await.unwrap();
    let alone = started.elapsed();
    assert!(alone < Duration::from_millis(250), "{alone:?}");
    let timed = || async {
        let started = Instant::now();
        post(&url, body, &[]).await.unwrap();
        started.elapsed()
    };
    let (first, second) = tokio::join!(timed(), async {
        tokio::time::sleep(Duration::from_millis(30)).await;
        timed().await
    });
    assert!(first < Duration::from_millis(250), "{first:?}");
    assert!(second >= Duration::from_millis(290), "{second:?}");
    // Both answered: the pods are free again, and the next lands on the fast one.
    let again = timed().await;
    assert!(again < Duration::from_millis(250), "{again:?}");
    let bad = GatewayConfig {
        pod_factors: vec![1.0, 0.0],
        ..GatewayConfig::default()
    };
    assert!(bad.validate().is_err());
}

/// A gateway that says 503 when it is full, as some do, instead of 429.
#[tokio::test]
async fn a_full_gateway_may_say_503() {
    let gw = start(GatewayConfig {
        latency_fixed: Duration::from_millis(400),
        capacity: Some(1),
        full_status: 503,
        ..GatewayConfig::default()
    })
    .await;
    let url = format!("{}/v1/completions", gw.base_url());
    let first = {
        let url = url.clone();
        tokio::spawn(async move { post(&url, r#"{"model":"m"}"#, &[]).await.unwrap() })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, headers, _) = post(&url, r#"{"model":"m"}"#, &[]).await.unwrap();
    assert_eq!(status, 503);
    assert!(!headers.contains_key("retry-after"));
    assert_eq!(first.await.unwrap().0, 200);
    assert!(GatewayConfig {
        full_status: 404,
        ..GatewayConfig::default()
    }
    .validate()
    .is_err());
}

/// Model-server mode: past C the time per output token grows with the requests running, the
/// prompt part does not, and only past the queue limit the answer is 429.
#[tokio::test]
async fn model_server_mode_stretches_the_time_per_token_past_the_knee() {
    let per_token = Duration::from_millis(5);
    let gw = start(GatewayConfig {
        latency_fixed: Duration::from_millis(10),
        latency_per_token: per_token,
        capacity: Some(2),
        queue_limit: Some(4),
        batching: true,
        retry_after_secs: 0,
        ..GatewayConfig::default()
    })
    .await;
    let url = format!("{}/v1/completions", gw.base_url());
    let burst = |n: usize| {
        let calls: Vec<_> = (0..n)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move {
                    post(&url, r#"{"model":"m","max_tokens":32}"#, &[])
                        .await
                        .unwrap()
                        .0
                })
            })
            .collect();
        async move {
            let mut statuses = Vec::new();
            for call in calls {
                statuses.push(call.await.unwrap());
            }
            statuses.sort_unstable();
            statuses
        }
    };
    assert_eq!(burst(2).await, vec![200, 200]);
    let unloaded = gw.stats().mean_token_time().unwrap();
    assert!(unloaded < per_token.mul_f64(1.2), "{unloaded:?}");
    // Four running, twice the knee: each token takes about twice as long; two refused.
    assert_eq!(burst(6).await, vec![200, 200, 200, 200, 429, 429]);
    let s = gw.stats();
    let loaded = Duration::from_secs_f64(
        (s.token_micros_total as f64 - unloaded.as_secs_f64() * 1e6 * 64.0) / 1e6 / 128.0,
    );
    assert!(
        loaded >= per_token.mul_f64(1.6),
        "{loaded:?} per token with 4 running"
    );
    assert_eq!(s.unloaded_micros_total, 6 * (10_000 + 32 * 5_000));
}

/// Capacity C: more than C in flight get 429 with Retry-After.
#[tokio::test]
async fn capacity_overflow_gets_429_with_retry_after() {
    let gw = start(GatewayConfig {
        latency_fixed: Duration::from_millis(400),
        capacity: Some(2),
        retry_after_secs: 3,
        ..GatewayConfig::default()
    })
    .await;
    let url = format!("{}/v1/completions", gw.base_url());
    let calls: Vec<_> = (0..5)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { post(&url, r#"{"model":"m"}"#, &[]).await.unwrap() })
        })
        .collect();
    let mut ok = 0;
    let mut limited = 0;
    for call in calls {
        let (status, headers, body) = call.await.unwrap();
        match status {
            200 => ok += 1,
            429 => {
                limited += 1;
                assert_eq!(headers["retry-after"], "3");
                assert!(body.contains("capacity"), "{body}");
            }
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!((ok, limited), (2, 3));
    let stats = gw.stats();
    assert_eq!(stats.max_in_flight_seen, 2);
    assert_eq!(stats.in_flight, 0);
    assert_eq!(stats.responses(429), 3);
}

/// Failure injection by rate and type: 429, 500, 503, 400, the ttl-expired header, and
/// connection reset; a rule with a limit fires that many times and is then spent.
#[tokio::test]
async fn injected_failures_by_kind() {
    let gw = start(GatewayConfig::default()).await;
    let url = format!("{}/v1/completions", gw.base_url());
    let body = r#"{"model":"m"}"#;
    for (kind, status) in [
        (FailureKind::Status429, 429),
        (FailureKind::Status500, 500),
        (FailureKind::Status503, 503),
        (FailureKind::Status400, 400),
        (FailureKind::TtlExpired, 429),
    ] {
        gw.set_config(GatewayConfig {
            failures: vec![FailureRule::new(kind, 1.0).limit(1)],
            ..GatewayConfig::default()
        })
        .unwrap();
        let (got, headers, reply) = post(&url, body, &[]).await.unwrap();
        assert_eq!(got, status, "{kind}");
        assert!(serde_json::from_str::<Value>(&reply).unwrap()["error"].is_object());
        assert_eq!(
            headers
                .get("x-llm-d-request-dropped-reason")
                .map(|v| v.to_str().unwrap()),
            (kind == FailureKind::TtlExpired).then_some("rejected-ttl-expired"),
        );
        if status == 429 {
            assert!(headers.contains_key("retry-after"));
        }
        let (after, _, _) = post(&url, body, &[]).await.unwrap();
        assert_eq!(after, 200, "the {kind} rule is spent after its limit");
    }

    gw.set_config(GatewayConfig {
        failures: vec![FailureRule::new(FailureKind::ConnectionReset, 1.0)],
        ..GatewayConfig::default()
    })
    .unwrap();
    let err = post(&url, body, &[]).await.unwrap_err();
    assert!(!err.is_empty());
    assert_eq!(gw.stats().resets, 1);

    // Rate 0.5 with a seed: some of each, and the same sequence for the same seed.
    let mut runs = Vec::new();
    for _ in 0..2 {
        gw.set_config(GatewayConfig {
            failures: vec![FailureRule::new(FailureKind::Status503, 0.5)],
            seed: Some(9),
            ..GatewayConfig::default()
        })
        .unwrap();
        let mut statuses = Vec::new();
        for _ in 0..40 {
            statuses.push(post(&url, body, &[]).await.unwrap().0);
        }
        runs.push(statuses);
    }
    assert_eq!(runs[0], runs[1]);
    let failed = runs[0].iter().filter(|s| **s == 503).count();
    assert!(
        (5..=35).contains(&failed),
        "{failed} of 40 failed at rate 0.5"
    );
}

/// POST /admin/config changes the behaviour at run time; GET /admin/requests shows the last
/// requests' headers; /metrics shows in-flight, waiting and responses by status; /health is up.
#[tokio::test]
async fn admin_endpoints() {
    let gw = start(GatewayConfig::default()).await;
    let base = gw.base_url();

    let (status, body) = get(&format!("{base}/health")).await;
    assert_eq!((status, body.trim()), (200, "ok"));

    let (status, _, reply) = post(
        &format!("{base}/admin/config"),
        r#"{"latency_fixed":"30ms","capacity":1,"failures":[{"kind":"503","rate":1,"limit":1}]}"#,
        &[],
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{reply}");
    let config = gw.config();
    assert_eq!(config.latency_fixed, Duration::from_millis(30));
    assert_eq!(config.capacity, Some(1));
    let (_, shown) = get(&format!("{base}/admin/config")).await;
    assert_eq!(
        serde_json::from_str::<GatewayConfig>(&shown).unwrap(),
        config
    );

    let (status, _, reply) = post(&format!("{base}/admin/config"), r#"{"latncy":"1s"}"#, &[])
        .await
        .unwrap();
    assert_eq!(status, 400, "{reply}");
    let (status, _, _) = post(
        &format!("{base}/admin/config"),
        r#"{"failures":[{"kind":"500","rate":3}]}"#,
        &[],
    )
    .await
    .unwrap();
    assert_eq!(status, 400);
    assert_eq!(gw.config(), config, "a refused config changes nothing");

    let url = format!("{base}/v1/chat/completions");
    let body = r#"{"model":"m","messages":[]}"#;
    let headers = [
        ("X-Request-ID", "batch_req_job_1"),
        ("x-slo-ttft-ms", "5000"),
        ("x-tenant", "t1"),
    ];
    assert_eq!(post(&url, body, &headers).await.unwrap().0, 503);
    assert_eq!(post(&url, body, &headers).await.unwrap().0, 200);

    let (status, listed) = get(&format!("{base}/admin/requests")).await;
    assert_eq!(status, 200);
    let seen: Vec<SeenRequest> = serde_json::from_str(&listed).unwrap();
    assert_eq!(seen, gw.recent_requests());
    assert_eq!(seen.len(), 2);
    let last = &seen[1];
    assert_eq!(last.path, "/v1/chat/completions");
    assert_eq!(last.header("x-request-id"), Some("batch_req_job_1"));
    assert_eq!(last.header("X-SLO-TTFT-MS"), Some("5000"));
    assert_eq!(last.header("x-tenant"), Some("t1"));
    assert_eq!(last.body_digest, body_digest(body.as_bytes()));

    let (status, page) = get(&format!("{base}/metrics")).await;
    assert_eq!(status, 200);
    for line in [
        "gateway_in_flight_requests 0",
        "gateway_waiting_requests 0",
        "gateway_requests_total 2",
        "gateway_responses_total{status=\"200\"} 1",
        "gateway_responses_total{status=\"503\"} 1",
    ] {
        assert!(
            page.lines().any(|l| l == line),
            "missing {line:?} in\n{page}"
        );
    }
}

/// The in-flight gauge counts requests being served; it is what the prometheus-budget gate reads.
#[tokio::test]
async fn in_flight_is_visible_while_serving() {
    let gw = start(GatewayConfig {
        latency_fixed: Duration::from_millis(500),
        ..GatewayConfig::default()
    })
    .await;
    let url = format!("{}/v1/completions", gw.base_url());
    let calls: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { post(&url, r#"{"model":"m"}"#, &[]).await })
        })
        .collect();
    common::eventually(Duration::from_secs(5), "3 in flight", || async {
        gw.stats().in_flight == 3
    })
    .await;
    let (_, page) = get(&format!("{}/metrics", gw.base_url())).await;
    assert!(page.contains("gateway_in_flight_requests 3\n"), "{page}");
    for c in calls {
        assert_eq!(c.await.unwrap().unwrap().0, 200);
    }
    assert_eq!(gw.stats().in_flight, 0);
}

fn chat_with_system(system: &str, question: &str) -> String {
    serde_json::json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question}
        ],
        "max_tokens": 1
    })
    .to_string()
}

/// The prefix-cache model: each endpoint keeps the last K prompt prefixes (the first system
/// message) in an LRU; hits and misses are counted in the stats, on `/admin/stats` and on
/// `/metrics`.
#[tokio::test]
async fn prefix_cache_counts_hits_and_misses_per_endpoint() {
    let gw = start(GatewayConfig {
        prefix_cache_size: 2,
        ..GatewayConfig::default()
    })
    .await;
    let chat = format!("{}/v1/chat/completions", gw.base_url());
    // A, A, B, A: miss, hit, miss, hit. Then C evicts B (A was used last), so B misses again.
    let mut expected = Vec::new();
    for (system, hit) in [
        ("A", false),
        ("A", true),
        ("B", false),
        ("A", true),
        ("C", false),
        ("B", false),
    ] {
        let body = chat_with_system(system, &format!("question {}", expected.len()));
        assert_eq!(post(&chat, &body, &[]).await.unwrap().0, 200);
        expected.push(hit);
    }
    let hits = expected.iter().filter(|h| **h).count() as u64;
    let misses = expected.len() as u64 - hits;
    assert_eq!((hits, misses), (2, 4));
    let s = gw.stats();
    assert_eq!((s.prefix_cache_hits, s.prefix_cache_misses), (hits, misses));

    // Another endpoint has its own cache: the same prefix misses there first.
    let completions = format!("{}/v1/completions", gw.base_url());
    post(&completions, &chat_with_system("A", "x"), &[])
        .await
        .unwrap();
    // A request without messages has no prefix and counts neither way.
    post(&completions, r#"{"model":"m","prompt":"p"}"#, &[])
        .await
        .unwrap();
    let s = gw.stats();
    assert_eq!((s.prefix_cache_hits, s.prefix_cache_misses), (2, 5));

    let (_, stats) = get(&format!("{}/admin/stats", gw.base_url())).await;
    let stats: Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(stats["prefix_cache_hits"], 2);
    assert_eq!(stats["prefix_cache_misses"], 5);
    assert_eq!(stats["total"], 8);
    let (_, page) = get(&format!("{}/metrics", gw.base_url())).await;
    for line in [
        "sim_gateway_prefix_cache_hits_total 2",
        "sim_gateway_prefix_cache_misses_total 5",
    ] {
        assert!(
            page.lines().any(|l| l == line),
            "missing {line:?} in\n{page}"
        );
    }
}

/// Off by default (size 0): nothing is counted; turned on at run time through `/admin/config`.
#[tokio::test]
async fn prefix_cache_is_off_by_default_and_configurable_at_run_time() {
    let gw = start(GatewayConfig::default()).await;
    let chat = format!("{}/v1/chat/completions", gw.base_url());
    for _ in 0..2 {
        post(&chat, &chat_with_system("S", "q"), &[]).await.unwrap();
    }
    let s = gw.stats();
    assert_eq!((s.prefix_cache_hits, s.prefix_cache_misses), (0, 0));
    let (status, _, reply) = post(
        &format!("{}/admin/config", gw.base_url()),
        r#"{"prefix_cache_size":1,"prefix_miss_latency":"5ms"}"#,
        &[],
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{reply}");
    assert_eq!(gw.config().prefix_cache_size, 1);
    assert_eq!(gw.config().prefix_miss_latency, Duration::from_millis(5));
    for _ in 0..3 {
        post(&chat, &chat_with_system("S", "q"), &[]).await.unwrap();
    }
    let s = gw.stats();
    assert_eq!((s.prefix_cache_hits, s.prefix_cache_misses), (2, 1));
}

/// A miss is charged `prefix_miss_latency` on top of the latency model; a hit is not.
#[tokio::test]
async fn a_prefix_miss_is_charged_extra_latency() {
    let miss_latency = Duration::from_millis(400);
    let gw = start(GatewayConfig {
        prefix_cache_size: 4,
        prefix_miss_latency: miss_latency,
        ..GatewayConfig::default()
    })
    .await;
    let chat = format!("{}/v1/chat/completions", gw.base_url());
    let started = Instant::now();
    post(&chat, &chat_with_system("long shared prompt", "q1"), &[])
        .await
        .unwrap();
    let miss = started.elapsed();
    assert!(miss >= miss_latency, "a miss took only {miss:?}");
    // The hit is timed against the miss, not a fixed bound: several hits must all beat the
    // charged latency (a loaded machine can slow one request, not the sum of them below it).
    let started = Instant::now();
    for i in 0..3 {
        post(
            &chat,
            &chat_with_system("long shared prompt", &format!("q{i}")),
            &[],
        )
        .await
        .unwrap();
    }
    let hits = started.elapsed();
    assert_eq!(gw.stats().prefix_cache_hits, 3);
    assert!(
        hits < miss_latency * 3,
        "three hits took {hits:?}: they were charged the miss latency"
    );
}

/// Queueing mode: past the capacity C requests are still served, each slower by n / C, and
/// only past the queue limit Q the answer is 429.
#[tokio::test]
async fn queueing_mode_slows_down_past_the_capacity_and_refuses_past_the_queue() {
    let latency = Duration::from_millis(300);
    let gw = start(GatewayConfig {
        latency_fixed: latency,
        capacity: Some(2),
        queue_limit: Some(4),
        retry_after_secs: 0,
        ..GatewayConfig::default()
    })
    .await;
    let url = format!("{}/v1/completions", gw.base_url());
    // Two at a time: no queueing.
    let started = Instant::now();
    let pair: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { post(&url, r#"{"model":"m"}"#, &[]).await.unwrap() })
        })
        .collect();
    for call in pair {
        assert_eq!(call.await.unwrap().0, 200);
    }
    let unqueued = started.elapsed();
    assert!(unqueued < 2 * latency, "{unqueued:?}");

    // Six at once: four admitted, the last of them with 4 in flight (2 × the latency), two
    // refused.
    let started = Instant::now();
    let calls: Vec<_> = (0..6)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let (status, headers, _) = post(&url, r#"{"model":"m"}"#, &[]).await.unwrap();
                (status, headers)
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for call in calls {
        let (status, headers) = call.await.unwrap();
        if status == 429 {
            assert_eq!(headers["retry-after"], "0");
        }
        statuses.push(status);
    }
    let queued = started.elapsed();
    statuses.sort_unstable();
    assert_eq!(statuses, vec![200, 200, 200, 200, 429, 429]);
    assert!(
        queued >= 2 * latency,
        "the 4th admitted took 2 × L: {queued:?}"
    );
    let stats = gw.stats();
    assert_eq!(stats.max_in_flight_seen, 4);
    assert_eq!(stats.in_flight, 0);
}

/// The capacity can change while requests are in flight: lowering it refuses newcomers until
/// the in-flight count is below it, raising it admits more at once (a gateway losing and
/// regaining replicas).
#[tokio::test]
async fn capacity_changes_at_run_time_take_effect_for_newcomers() {
    let gw = start(GatewayConfig {
        latency_fixed: Duration::from_millis(400),
        capacity: Some(3),
        retry_after_secs: 0,
        ..GatewayConfig::default()
    })
    .await;
    let url = format!("{}/v1/completions", gw.base_url());
    let burst = |n: usize| {
        (0..n)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move { post(&url, r#"{"model":"m"}"#, &[]).await.unwrap().0 })
            })
            .collect::<Vec<_>>()
    };
    let held = burst(3);
    common::eventually(Duration::from_secs(5), "3 in flight", || async {
        gw.stats().in_flight == 3
    })
    .await;
    gw.set_config(GatewayConfig {
        capacity: Some(1),
        ..gw.config()
    })
    .unwrap();
    assert_eq!(
        burst(1).pop().unwrap().await.unwrap(),
        429,
        "3 held, capacity 1"
    );
    for call in held {
        assert_eq!(call.await.unwrap(), 200, "lowering interrupts nobody");
    }
    gw.set_config(GatewayConfig {
        capacity: Some(5),
        ..gw.config()
    })
    .unwrap();
    let mut statuses = Vec::new();
    for call in burst(5) {
        statuses.push(call.await.unwrap());
    }
    assert_eq!(statuses, vec![200; 5]);
}

/// vLLM mode: `max_num_seqs` run at once, the rest wait in the server's queue (seen on
/// `/metrics` under vLLM's names), a waiting online request (priority 0) goes before waiting
/// batch requests (priority 10) that came earlier, and past `max_waiting` the answer is 429.
#[tokio::test]
async fn vllm_mode_runs_max_num_seqs_and_queues_the_rest_by_priority() {
    let gw = start(GatewayConfig {
        latency_fixed: Duration::from_millis(400),
        max_num_seqs: Some(2),
        max_waiting: Some(4),
        priority_scheduling: true,
        retry_after_secs: 0,
        ..GatewayConfig::default()
    })
    .await;
    let url = format!("{}/v1/completions", gw.base_url());
    let metrics_url = format!("{}/metrics", gw.base_url());
    let send = |body: &'static str| {
        let url = url.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let status = post(&url, body, &[]).await.unwrap().0;
            (status, started.elapsed())
        })
    };
    let batch = r#"{"model":"m","max_tokens":1,"priority":10}"#;
    let mut batch_calls = Vec::new();
    for _ in 0..5 {
        batch_calls.push(send(batch));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let metrics = get(&metrics_url).await.1;
    assert!(
        metrics.contains("vllm:num_requests_running{model_name=\"sim-model\"} 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("vllm:num_requests_waiting{model_name=\"sim-model\"} 3"),
        "{metrics}"
    );
    let online = send(r#"{"model":"m","max_tokens":1}"#);
    tokio::time::sleep(Duration::from_millis(10)).await;
    // Four wait now: another is refused at once.
    let refused = send(batch).await.unwrap();
    assert_eq!(refused.0, 429);
    assert!(refused.1 < Duration::from_millis(200), "{:?}", refused.1);

    // The online request runs in the second wave (done at ~0.8 s), ahead of the batch
    // requests waiting; in arrival order it would run in the third (~1.2 s).
    let (status, online_took) = online.await.unwrap();
    assert_eq!(status, 200);
    assert!(
        online_took >= Duration::from_millis(600) && online_took < Duration::from_millis(1000),
        "{online_took:?}"
    );
    let mut took: Vec<Duration> = Vec::new();
    for call in batch_calls {
        let (status, t) = call.await.unwrap();
        assert_eq!(status, 200);
        took.push(t);
    }
    // Two in the first wave (~0.4 s), one beside the online one (~0.8 s), two last (~1.2 s).
    assert!(took[0] < Duration::from_millis(600), "{took:?}");
    assert!(took[4] >= Duration::from_millis(1050), "{took:?}");
    let after = get(&metrics_url).await.1;
    assert!(
        after.contains("vllm:num_requests_running{model_name=\"sim-model\"} 0"),
        "{after}"
    );
}

/// vLLM mode: each output token is slower as more requests run, by `itl_growth` at full batch.
#[tokio::test]
async fn vllm_mode_slows_tokens_as_more_run() {
    let per_token = Duration::from_millis(4);
    let gw = start(GatewayConfig {
        latency_per_token: per_token,
        max_num_seqs: Some(4),
        itl_growth: 1.0,
        ..GatewayConfig::default()
    })
    .await;
    let url = format!("{}/v1/completions", gw.base_url());
    let burst = |n: usize| {
        let calls: Vec<_> = (0..n)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move {
                    post(&url, r#"{"model":"m","max_tokens":64}"#, &[])
                        .await
                        .unwrap()
                        .0
                })
            })
            .collect();
        async move {
            for call in calls {
                assert_eq!(call.await.unwrap(), 200);
            }
        }
    };
    burst(1).await;
    let alone = gw.stats().mean_token_time().unwrap();
    assert!(alone < per_token.mul_f64(1.3), "{alone:?}");
    burst(4).await;
    let s = gw.stats();
    let full = Duration::from_secs_f64(
        (s.token_micros_total as f64 - alone.as_secs_f64() * 1e6 * 64.0) / 1e6 / 256.0,
    );
    assert!(
        full >= per_token.mul_f64(1.7),
        "{full:?} per token with 4 running"
    );
}

/// A streamed answer as a client reads it: each server-sent event with the time it arrived,
/// counted from the request's send.
async fn read_stream(url: &str, body: &'static str) -> (u16, String, Vec<(Duration, String)>) {
    use http_body_util::{BodyExt, Full};
    let client = gateway_sim::http::client();
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from_static(body.as_bytes())))
        .unwrap();
    let sent = Instant::now();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let content_type = resp.headers()["content-type"].to_str().unwrap().to_owned();
    let mut body = resp.into_body();
    let (mut events, mut pending) = (Vec::new(), String::new());
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.unwrap().into_data() else {
            continue;
        };
        pending.push_str(std::str::from_utf8(&data).unwrap());
        while let Some(end) = pending.find("\n\n") {
            let event = pending[..end].to_owned();
            pending.drain(..end + 2);
            events.push((sent.elapsed(), event));
        }
    }
    assert!(pending.is_empty(), "a partial event: {pending:?}");
    (status, content_type, events)
}

/// vLLM mode streams a chat answer as vLLM does: one `chat.completion.chunk` event per token,
/// each sent at its token's time (the first after the queue wait and the time to the first
/// token), then the usage event when asked for, then `[DONE]`.
#[tokio::test]
async fn vllm_mode_streams_one_event_per_token_at_its_time() {
    let gw = start(GatewayConfig {
        latency_fixed: Duration::from_millis(100),
        latency_per_token: Duration::from_millis(20),
        max_num_seqs: Some(1),
        ..GatewayConfig::default()
    })
    .await;
    let url = format!("{}/v1/chat/completions", gw.base_url());
    const BODY: &str = r#"{"model":"m","messages":[{"role":"user","content":"three little words"}],"max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}"#;
    let (first, second) = tokio::join!(read_stream(&url, BODY), async {
        // Sent just after: it waits in the queue behind the first (one runs at a time).
        tokio::time::sleep(Duration::from_millis(20)).await;
        read_stream(&url, BODY).await
    });
    let digest = body_digest(BODY.as_bytes());
    for (status, content_type, events) in [&first, &second] {
        assert_eq!((*status, content_type.as_str()), (200, "text/event-stream"));
        assert_eq!(events.len(), 8 + 2, "{events:?}");
        assert_eq!(events[9].1, "data: [DONE]");
        let chunks: Vec<Value> = events[..9]
            .iter()
            .map(|(_, e)| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
            .collect();
        let content: String = chunks[..8]
            .iter()
            .map(|c| {
                assert_eq!(c["object"], "chat.completion.chunk");
                c["choices"][0]["delta"]["content"].as_str().unwrap()
            })
            .collect();
        assert_eq!(content, format!("digest:{digest}"));
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(chunks[7]["choices"][0]["finish_reason"], "stop");
        assert!(chunks[6]["choices"][0]["finish_reason"].is_null());
        assert_eq!(chunks[8]["choices"], serde_json::json!([]));
        assert_eq!(chunks[8]["usage"]["completion_tokens"], 8);
        assert_eq!(chunks[8]["usage"]["prompt_tokens"], 3);
        // Spread over time: seven gaps of one token's time after the first token.
        let spread = events[7].0 - events[0].0;
        assert!(
            spread >= Duration::from_millis(130),
            "{spread:?}: {events:?}"
        );
    }
    let first_ttft = first.2[0].0;
    assert!(
        first_ttft >= Duration::from_millis(100) && first_ttft < Duration::from_millis(250),
        "{first_ttft:?}"
    );
    // The second waited for the first to finish (~240 ms) before its own 100 ms.
    let second_ttft = second.2[0].0;
    assert!(
        second_ttft >= Duration::from_millis(300),
        "{second_ttft:?} after the first's {:?}",
        first.2[7].0
    );
    let stats = gw.stats();
    assert_eq!((stats.responses(200), stats.answered), (2, 2));
    assert_eq!(stats.completion_tokens_total, 16);

    // Without `stream`, the same request is answered whole, as before.
    let plain = BODY.replace(r#""stream":true"#, r#""stream":false"#);
    let (status, headers, reply) = post(&url, &plain, &[]).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "application/json");
    let v: Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(v["object"], "chat.completion");
}

/// A client that leaves a streamed answer frees its place in the server, waiting or running, as
/// vLLM aborts a request whose client disconnected.
#[tokio::test]
async fn vllm_mode_frees_the_place_of_a_stream_left() {
    let gw = start(GatewayConfig {
        latency_per_token: Duration::from_millis(20),
        max_num_seqs: Some(1),
        ..GatewayConfig::default()
    })
    .await;
    let url = format!("{}/v1/chat/completions", gw.base_url());
    let metrics_url = format!("{}/metrics", gw.base_url());
    let waiting = |n: usize| {
        let metrics_url = metrics_url.clone();
        async move {
            get(&metrics_url).await.1.contains(&format!(
                "vllm:num_requests_waiting{{model_name=\"sim-model\"}} {n}"
            ))
        }
    };
    let body = r#"{"model":"m","messages":[],"max_tokens":500,"stream":true}"#;
    let running = tokio::spawn(read_stream_owned(url.clone(), body));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiter = tokio::spawn(read_stream_owned(url.clone(), body));
    common::eventually(Duration::from_secs(2), "one waiting", || waiting(1)).await;
    assert_eq!(gw.load().running(), 1);
    waiter.abort();
    common::eventually(Duration::from_secs(2), "the waiter gone", || waiting(0)).await;
    running.abort();
    let load = gw.load();
    common::eventually(Duration::from_secs(2), "the slot freed", || {
        let load = load.clone();
        async move { load.running() == 0 }
    })
    .await;
    assert_eq!(gw.stats().answered, 0);
}

async fn read_stream_owned(url: String, body: &'static str) {
    read_stream(&url, body).await;
}
