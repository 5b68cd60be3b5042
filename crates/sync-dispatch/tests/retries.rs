//! Retry rules, outcomes and headers, against real HTTP servers on 127.0.0.1.

mod common;

use std::time::{Duration, SystemTime};

use batch_sync_dispatch::{
    DispatchError, EndpointOptions, LimitOptions, SyncDispatcher, SyncOutcome, SyncRequest,
};
use bytes::Bytes;
use common::{fast_options, request, Gateway, Reply, BODY};

fn dispatcher() -> SyncDispatcher {
    SyncDispatcher::new(LimitOptions::default())
}

fn failed_code(outcome: &SyncOutcome) -> &str {
    match outcome {
        SyncOutcome::Failed { code, .. } => code,
        other => panic!("expected a failure, got {other:?}"),
    }
}

/// A gateway whose first answer is `first()` and every later one a 200.
async fn first_then_ok(first: impl Fn() -> Reply + Send + Sync + 'static) -> Gateway {
    Gateway::start(move |n, _| if n == 0 { first() } else { Reply::ok() }).await
}

/// One request sent to `gateway` through a fresh dispatcher, its fast options changed by
/// `configure`.
async fn dispatch_one(
    gateway: &Gateway,
    configure: impl FnOnce(&mut EndpointOptions),
) -> SyncOutcome {
    let d = dispatcher();
    let mut options = fast_options(&gateway.url);
    configure(&mut options);
    d.add_endpoint("m", options).unwrap();
    d.dispatch("m", request("r1")).await
}

/// The wait between the gateway's first and second request.
fn first_gap(gateway: &Gateway) -> Duration {
    let seen = gateway.counters.seen();
    seen[1].at - seen[0].at
}

#[tokio::test]
async fn a_400_is_returned_at_once_without_retry() {
    let gateway = Gateway::start(|_, _| Reply {
        body: r#"{"error":{"message":"bad"}}"#.into(),
        ..Reply::status(400)
    })
    .await;
    let outcome = dispatch_one(&gateway, |_| {}).await;
    assert_eq!(
        outcome,
        SyncOutcome::Http {
            status: 400,
            body: Bytes::from_static(br#"{"error":{"message":"bad"}}"#)
        }
    );
    assert_eq!(gateway.counters.requests(), 1);
}

#[tokio::test]
async fn a_503_is_retried_until_the_gateway_answers() {
    let gateway = Gateway::start(|n, _| {
        if n < 2 {
            Reply::status(503)
        } else {
            Reply::ok()
        }
    })
    .await;
    let outcome = dispatch_one(&gateway, |_| {}).await;
    assert!(
        matches!(outcome, SyncOutcome::Http { status: 200, .. }),
        "{outcome:?}"
    );
    assert_eq!(gateway.counters.requests(), 3);
}

#[tokio::test]
async fn always_429_with_one_retry_ends_as_http_429() {
    let gateway = Gateway::start(|_, _| Reply::status(429)).await;
    let outcome = dispatch_one(&gateway, |o| o.max_retries = 1).await;
    assert_eq!(
        outcome,
        SyncOutcome::Http {
            status: 429,
            body: Bytes::from_static(br#"{"status":429}"#)
        }
    );
    assert_eq!(gateway.counters.requests(), 2, "one attempt and one retry");
}

#[tokio::test]
async fn other_statuses_are_final_and_5xx_all_retried() {
    for (status, attempts) in [(401, 1), (404, 1), (422, 1), (500, 3), (502, 3), (504, 3)] {
        let gateway = Gateway::start(move |_, _| Reply::status(status)).await;
        let outcome = dispatch_one(&gateway, |o| o.max_retries = 2).await;
        assert!(
            matches!(outcome, SyncOutcome::Http { status: s, .. } if s == status),
            "{status}: {outcome:?}"
        );
        assert_eq!(gateway.counters.requests(), attempts, "status {status}");
    }
}

#[tokio::test]
async fn retry_after_seconds_are_honoured() {
    let gateway = first_then_ok(|| Reply::status(429).header("retry-after", "1")).await;
    let outcome = dispatch_one(&gateway, |o| o.max_backoff = Duration::from_secs(5)).await;
    assert!(matches!(outcome, SyncOutcome::Http { status: 200, .. }));
    let gap = first_gap(&gateway);
    assert!(gap >= Duration::from_millis(990), "waited only {gap:?}");
}

#[tokio::test]
async fn retry_after_dates_are_honoured() {
    let gateway = first_then_ok(|| {
        let at = SystemTime::now() + Duration::from_secs(2);
        Reply::status(503).header("retry-after", httpdate::fmt_http_date(at))
    })
    .await;
    let outcome = dispatch_one(&gateway, |o| o.max_backoff = Duration::from_secs(5)).await;
    assert!(matches!(outcome, SyncOutcome::Http { status: 200, .. }));
    // The date has whole-second precision: 2 s ahead is about 1 s ahead at worst.
    let gap = first_gap(&gateway);
    assert!(gap >= Duration::from_millis(900), "waited only {gap:?}");
}

#[tokio::test]
async fn retry_after_is_capped_at_max_backoff() {
    let gateway = first_then_ok(|| Reply::status(429).header("retry-after", "3600")).await;
    let outcome = tokio::time::timeout(Duration::from_secs(30), dispatch_one(&gateway, |_| {}))
        .await
        .expect("an hour-long Retry-After must be cut to max_backoff");
    assert!(matches!(outcome, SyncOutcome::Http { status: 200, .. }));
}

#[tokio::test]
async fn a_429_without_retry_after_waits_three_times_the_base() {
    let gateway = first_then_ok(|| Reply::status(429)).await;
    dispatch_one(&gateway, |o| {
        o.initial_backoff = Duration::from_millis(100);
        o.max_backoff = Duration::from_secs(5);
    })
    .await;
    // 3 × 100 ms with -50 % jitter at worst; a plain base would wait 50..150 ms.
    let gap = first_gap(&gateway);
    assert!(gap >= Duration::from_millis(150), "waited only {gap:?}");
}

#[tokio::test]
async fn a_ttl_expired_drop_is_final_and_becomes_batch_expired() {
    for status in [429, 503] {
        let gateway = Gateway::start(move |_, _| {
            Reply::status(status).header("x-llm-d-request-dropped-reason", "rejected-ttl-expired")
        })
        .await;
        let outcome = dispatch_one(&gateway, |_| {}).await;
        assert_eq!(failed_code(&outcome), "batch_expired", "{status}");
        assert_eq!(gateway.counters.requests(), 1, "not retried ({status})");
    }
    // Any other drop reason is retried as usual.
    let gateway = first_then_ok(|| {
        Reply::status(429).header("x-llm-d-request-dropped-reason", "rejected-saturated")
    })
    .await;
    let outcome = dispatch_one(&gateway, |_| {}).await;
    assert!(matches!(outcome, SyncOutcome::Http { status: 200, .. }));
}

#[tokio::test]
async fn a_closed_port_fails_with_inference_error_after_the_retries() {
    let port = batch_testkit::free_port();
    let d = dispatcher();
    let mut options = fast_options(&format!("http://127.0.0.1:{port}"));
    options.max_retries = 2;
    d.add_endpoint("m", options).unwrap();
    let outcome = d.dispatch("m", request("r1")).await;
    let SyncOutcome::Failed { code, message } = outcome else {
        panic!("expected a failure");
    };
    assert_eq!(code, "INFERENCE_ERROR");
    assert!(message.contains("3 attempt"), "{message}");
    assert_eq!(d.limit("m"), Some(10), "no answer is no AIMD signal");
}

#[tokio::test]
async fn a_slow_gateway_times_out_per_attempt() {
    let gateway = Gateway::start(|_, _| Reply::ok().after(Duration::from_secs(5))).await;
    let d = dispatcher();
    let mut options = fast_options(&gateway.url);
    options.request_timeout = Duration::from_millis(100);
    options.max_retries = 1;
    d.add_endpoint("m", options).unwrap();
    let outcome = d.dispatch("m", request("r1")).await;
    let SyncOutcome::Failed { code, message } = outcome else {
        panic!("expected a failure");
    };
    assert_eq!(code, "INFERENCE_ERROR");
    assert!(message.contains("no answer within 100ms"), "{message}");
    assert_eq!(gateway.counters.requests(), 2, "a timeout is retried");
    assert_eq!(d.limit("m"), Some(10), "a timeout is no AIMD signal");
}

#[tokio::test]
async fn a_passed_slo_is_not_sent() {
    let gateway = Gateway::start(|_, _| Reply::ok()).await;
    let d = dispatcher();
    d.add_endpoint("m", fast_options(&gateway.url)).unwrap();
    let mut late = request("r1");
    late.slo_deadline = SystemTime::now() - Duration::from_secs(1);
    let outcome = d.dispatch("m", late).await;
    assert_eq!(failed_code(&outcome), "batch_expired");
    assert_eq!(gateway.counters.requests(), 0);
}

#[tokio::test]
async fn the_slo_cuts_retries_short() {
    let gateway = Gateway::start(|_, _| Reply::status(503)).await;
    let d = dispatcher();
    let mut options = fast_options(&gateway.url);
    options.max_retries = 1000;
    options.initial_backoff = Duration::from_millis(50);
    options.max_backoff = Duration::from_millis(200);
    d.add_endpoint("m", options).unwrap();
    let mut soon = request("r1");
    soon.slo_deadline = SystemTime::now() + Duration::from_millis(500);
    let outcome = d.dispatch("m", soon).await;
    assert_eq!(failed_code(&outcome), "batch_expired");
    assert!(gateway.counters.requests() < 1000);
}

#[tokio::test]
async fn the_gateway_sees_the_right_headers_path_and_body() {
    let gateway = Gateway::start(|_, _| Reply::ok()).await;
    let d = dispatcher();
    let mut options = fast_options(&format!("{}/pool-a/", gateway.url));
    options.api_key = Some("sk-secret".into());
    options.inference_objective = Some("batch-objective".into());
    d.add_endpoint("keyed", options).unwrap();
    d.add_endpoint("plain", fast_options(&gateway.url)).unwrap();

    let pass_through = vec![
        (
            "x-gateway-inference-fairness-id".to_owned(),
            "tenant-a".to_owned(),
        ),
        ("X-Request-ID".to_owned(), "spoofed".to_owned()),
        ("Host".to_owned(), "elsewhere.example".to_owned()),
    ];
    let body = Bytes::from_static(BODY);
    let outcome = d
        .dispatch(
            "keyed",
            SyncRequest {
                id: "batch_req_batch_x_7",
                path: "/v1/embeddings",
                body: body.clone(),
                slo_deadline: SystemTime::now() + Duration::from_secs(60),
                headers: &pass_through,
                flow: Default::default(),
            },
        )
        .await;
    assert!(matches!(outcome, SyncOutcome::Http { status: 200, .. }));
    d.dispatch("plain", request("r2")).await;

    let seen = gateway.counters.seen();
    let keyed = &seen[0];
    let header = |name: &str| {
        keyed
            .headers
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    assert_eq!(keyed.method, "POST");
    assert_eq!(keyed.path, "/pool-a/v1/embeddings");
    assert_eq!(keyed.body, body, "the body is sent byte for byte");
    assert_eq!(header("content-type").as_deref(), Some("application/json"));
    assert_eq!(
        header("x-request-id").as_deref(),
        Some("batch_req_batch_x_7")
    );
    assert_eq!(keyed.headers.get_all("x-request-id").iter().count(), 1);
    assert_eq!(header("authorization").as_deref(), Some("Bearer sk-secret"));
    assert_eq!(
        header("x-gateway-inference-objective").as_deref(),
        Some("batch-objective")
    );
    assert_eq!(
        header("x-gateway-inference-fairness-id").as_deref(),
        Some("tenant-a")
    );
    assert_ne!(header("host").as_deref(), Some("elsewhere.example"));
    let slo_ms: u64 = header("x-slo-ttft-ms").unwrap().parse().unwrap();
    assert!(
        (50_000..=60_000).contains(&slo_ms),
        "x-slo-ttft-ms = {slo_ms}, want the ms left to a 60 s SLO"
    );

    let plain = &seen[1];
    assert_eq!(plain.path, "/v1/chat/completions");
    assert!(plain.headers.get("authorization").is_none());
    assert!(plain.headers.get("x-gateway-inference-objective").is_none());
}

#[tokio::test]
async fn connections_are_kept_alive_and_reused() {
    let gateway = Gateway::start(|_, _| Reply::ok()).await;
    let d = dispatcher();
    d.add_endpoint("a", fast_options(&gateway.url)).unwrap();
    d.add_endpoint("b", fast_options(&gateway.url)).unwrap();
    for i in 0..10 {
        let name = if i % 2 == 0 { "a" } else { "b" };
        d.dispatch(name, request("r")).await;
    }
    assert_eq!(gateway.counters.requests(), 10);
    assert_eq!(
        gateway
            .counters
            .connections
            .load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one pooled connection served both endpoint names"
    );
}

#[tokio::test]
async fn bad_requests_fail_before_sending() {
    let gateway = Gateway::start(|_, _| Reply::ok()).await;
    let d = dispatcher();
    d.add_endpoint("m", fast_options(&gateway.url)).unwrap();

    let outcome = d.dispatch("nope", request("r1")).await;
    assert_eq!(failed_code(&outcome), "model_not_found");

    let bad_header = vec![("bad header".to_owned(), "v".to_owned())];
    let mut r = request("r1");
    r.headers = &bad_header;
    assert_eq!(failed_code(&d.dispatch("m", r).await), "INVALID_REQUEST");

    let mut r = request("r1");
    r.path = "v1/chat/completions";
    assert_eq!(failed_code(&d.dispatch("m", r).await), "INVALID_REQUEST");

    assert_eq!(
        failed_code(&d.dispatch("m", request("bad\nid")).await),
        "INVALID_REQUEST"
    );
    assert_eq!(gateway.counters.requests(), 0);
    assert_eq!(d.in_use("m"), Some(0));
}

#[test]
fn bad_options_are_refused_when_adding_an_endpoint() {
    let d = dispatcher();
    d.add_endpoint("m", EndpointOptions::new("http://127.0.0.1:1"))
        .unwrap();
    assert_eq!(
        d.add_endpoint("m", EndpointOptions::new("http://127.0.0.1:1")),
        Err(DispatchError::DuplicateEndpoint("m".into()))
    );
    let mut zero = EndpointOptions::new("http://127.0.0.1:1");
    zero.request_timeout = Duration::ZERO;
    assert!(matches!(
        d.add_endpoint("z", zero),
        Err(DispatchError::InvalidOptions { .. })
    ));
    for url in [
        "127.0.0.1:1",
        "ftp://127.0.0.1/",
        "http://",
        "http://h/?q=1",
    ] {
        assert!(
            matches!(
                d.add_endpoint("u", EndpointOptions::new(url)),
                Err(DispatchError::InvalidOptions { .. })
            ),
            "{url}"
        );
    }
    let mut half_mtls = EndpointOptions::new("https://127.0.0.1:1");
    half_mtls.tls.client_cert_file = Some("cert.pem".into());
    assert!(d.add_endpoint("t", half_mtls).is_err());

    let mut key = EndpointOptions::new("http://127.0.0.1:1");
    key.api_key = Some("line\nbreak".into());
    let err = d.add_endpoint("k", key).unwrap_err().to_string();
    assert!(!err.contains("line"), "the key is never printed: {err}");

    let mut secret = EndpointOptions::new("http://127.0.0.1:1");
    secret.api_key = Some("sk-very-secret".into());
    assert!(!format!("{secret:?}").contains("sk-very-secret"));

    for limits in [
        LimitOptions {
            global: 0,
            ..LimitOptions::default()
        },
        LimitOptions {
            per_endpoint: 0,
            ..LimitOptions::default()
        },
        LimitOptions {
            aimd_min: 11,
            ..LimitOptions::default()
        },
        LimitOptions {
            backoff_factor: 1.5,
            ..LimitOptions::default()
        },
    ] {
        let d = SyncDispatcher::new(limits);
        assert!(
            matches!(
                d.add_endpoint("m", EndpointOptions::new("http://127.0.0.1:1")),
                Err(DispatchError::InvalidLimits(_))
            ),
            "{limits:?}"
        );
    }
    // With AIMD off, its parameters are not checked.
    let d = SyncDispatcher::new(LimitOptions {
        aimd_enabled: false,
        aimd_min: 50,
        ..LimitOptions::default()
    });
    d.add_endpoint("m", EndpointOptions::new("http://127.0.0.1:1"))
        .unwrap();
}
