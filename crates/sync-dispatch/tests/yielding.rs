//! A batch beside online traffic on a model server that schedules as vLLM does (the gateway
//! simulator's vLLM mode): with `load`, the batch leaves online requests their room.
//!
//! These tests check the direction only (online latency clearly lower with `load` than
//! without, the batch still progressing, each request answered once), not figures a loaded
//! machine would move; the figures are the bench's (`just bench`, the yield group).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use batch_sync_dispatch::{LimitOptions, LoadOptions, SyncDispatcher, SyncOutcome, SyncRequest};
use bytes::Bytes;
use common::fast_options;
use gateway_sim::{Gateway, GatewayConfig, GatewayHandle};
use rand::Rng;

/// The tests that time online requests beside a batch run one at a time: side by side on two
/// cores, each one's CPU time would be latency for the others.
static TIMING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A vLLM-like server: 8 running at once, 40 ms to the first token, 4 ms per token (25 per
/// answer): 0.14 s an answer, ~57 answers/s at capacity.
async fn model_server(priority_scheduling: bool) -> GatewayHandle {
    Gateway::start(
        "127.0.0.1:0".parse().unwrap(),
        GatewayConfig {
            latency_fixed: Duration::from_millis(40),
            latency_per_token: Duration::from_millis(4),
            default_max_tokens: 25,
            max_num_seqs: Some(8),
            itl_growth: 0.3,
            priority_scheduling,
            ..GatewayConfig::default()
        },
    )
    .await
    .unwrap()
}

/// What a phase measured.
#[derive(Debug)]
struct Phase {
    online_p95: Duration,
    online_sent: usize,
    online_failed: usize,
    batch_done: usize,
}

/// Online traffic (Poisson, `rate` per second) for `span`, beside a batch sent through
/// `dispatcher` as fast as it lets it.
async fn run_phase(
    gateway: &GatewayHandle,
    dispatcher: Option<SyncDispatcher>,
    rate: f64,
    span: Duration,
) -> Phase {
    let done = Arc::new(AtomicUsize::new(0));
    let batch = dispatcher.map(|d| {
        let done = done.clone();
        tokio::spawn(async move {
            let body = Bytes::from_static(br#"{"model":"m","prompt":"batch"}"#);
            let mut n = 0u64;
            let mut calls = tokio::task::JoinSet::new();
            loop {
                // More waiting than any limit lets through: the dispatcher decides the pace.
                while calls.len() < 64 {
                    let (d, body, done) = (d.clone(), body.clone(), done.clone());
                    n += 1;
                    calls.spawn(async move {
                        let id = format!("batch-{n}");
                        let outcome = d
                            .dispatch(
                                "m",
                                SyncRequest {
                                    id: &id,
                                    path: "/v1/completions",
                                    body,
                                    slo_deadline: SystemTime::now() + Duration::from_secs(3600),
                                    headers: &[],
                                    flow: Default::default(),
                                },
                            )
                            .await;
                        if matches!(outcome, SyncOutcome::Http { status: 200, .. }) {
                            done.fetch_add(1, Ordering::SeqCst);
                        }
                    });
                }
                calls.join_next().await;
            }
        })
    });
    // Let the batch take what it takes before online traffic is measured.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let batch_before = done.load(Ordering::SeqCst);
    let url = format!("{}/v1/completions", gateway.base_url());
    let mut online = tokio::task::JoinSet::new();
    let started = Instant::now();
    let mut next = Duration::ZERO;
    while next < span {
        tokio::time::sleep_until((started + next).into()).await;
        let url = url.clone();
        online.spawn(async move {
            let sent = Instant::now();
            let answer =
                batch_testkit::http::post(&url, r#"{"model":"m","prompt":"online"}"#, &[]).await;
            (answer.map(|a| a.0).unwrap_or(0), sent.elapsed())
        });
        let gap: f64 = -(1.0 - rand::rng().random::<f64>()).ln() / rate;
        next += Duration::from_secs_f64(gap);
    }
    let batch_done = done.load(Ordering::SeqCst) - batch_before;
    let mut latencies = Vec::new();
    let mut failed = 0;
    while let Some(call) = online.join_next().await {
        let (status, took) = call.unwrap();
        if status == 200 {
            latencies.push(took);
        } else {
            failed += 1;
        }
    }
    if let Some(batch) = batch {
        batch.abort();
    }
    latencies.sort();
    let p95 = latencies[(latencies.len() * 95 / 100).min(latencies.len() - 1)];
    Phase {
        online_p95: p95,
        online_sent: latencies.len() + failed,
        online_failed: failed,
        batch_done,
    }
}

/// The processor's default limits for one endpoint (the work limiter, 10 at first).
fn default_limits() -> LimitOptions {
    LimitOptions {
        algorithm: batch_sync_dispatch::Algorithm::Work,
        ..LimitOptions::default()
    }
}

fn dispatcher(gateway: &GatewayHandle, load: Option<LoadOptions>) -> SyncDispatcher {
    let d = SyncDispatcher::new(default_limits());
    let mut options = fast_options(&gateway.base_url());
    options.load = load;
    d.add_endpoint("m", options).unwrap();
    d
}

fn load_of(gateway: &GatewayHandle) -> LoadOptions {
    LoadOptions {
        metrics_urls: vec![format!("{}/metrics", gateway.base_url())],
        ..LoadOptions::default()
    }
}

/// Online at about half the server's capacity: without `load` the batch's limiter fills the
/// server and online requests wait behind it; with `load` (only `metrics_urls` set) online
/// p95 is clearly lower, and the batch still gets a good part of the spare capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_load_the_batch_leaves_online_traffic_its_room() {
    let _serial = TIMING.lock().await;
    let span = Duration::from_secs(8);
    let rate = 28.0;
    let gateway = model_server(false).await;
    let alone = run_phase(&gateway, None, rate, span).await;
    let without = run_phase(&gateway, Some(dispatcher(&gateway, None)), rate, span).await;
    let with = run_phase(
        &gateway,
        Some(dispatcher(&gateway, Some(load_of(&gateway)))),
        rate,
        span,
    )
    .await;
    eprintln!(
        "online alone: {alone:?}\nbatch without load: {without:?}\nbatch with load: {with:?}"
    );
    for phase in [&alone, &without, &with] {
        assert_eq!(phase.online_failed, 0, "{phase:?}");
        assert!(phase.online_sent > 100, "{phase:?}");
    }
    assert!(
        with.online_p95.as_secs_f64() < 0.75 * without.online_p95.as_secs_f64(),
        "online p95 with load {:?}, without {:?}",
        with.online_p95,
        without.online_p95
    );
    // The spare capacity is about half the server's (~28 answers/s): the batch must not
    // stop. 8 s at a tenth of it is 22 answers.
    assert!(with.batch_done > 22, "{with:?}");
}

/// Priority: with a server scheduling by priority, the batch's requests (sent with a higher
/// number) wait behind online ones, and the bodies carry it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_batch_sends_its_priority_and_a_priority_server_serves_online_first() {
    let _serial = TIMING.lock().await;
    let gateway = model_server(true).await;
    let load = LoadOptions {
        priority: Some(10),
        ..load_of(&gateway)
    };
    let with = run_phase(
        &gateway,
        Some(dispatcher(&gateway, Some(load))),
        28.0,
        Duration::from_secs(5),
    )
    .await;
    eprintln!("batch with load and priority: {with:?}");
    assert!(with.batch_done > 10, "{with:?}");
    let seen = gateway.recent_requests();
    assert!(seen.iter().any(|r| r.body_len > 0));
    // Batch bodies grew by the priority member; online ones did not.
    let batch_len = br#"{"priority":10,"model":"m","prompt":"batch"}"#.len();
    assert!(
        seen.iter().any(|r| r.body_len == batch_len),
        "no batch body with its priority"
    );
}

/// A load source that never answers leaves the limiter in charge: every request is
/// answered, and the endpoint's limit is the limiter's.
#[tokio::test]
async fn a_dead_load_source_leaves_the_limiter_in_charge() {
    let gateway = model_server(false).await;
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}/metrics", dead.local_addr().unwrap());
    drop(dead);
    let d = dispatcher(
        &gateway,
        Some(LoadOptions {
            metrics_urls: vec![dead_url],
            ..LoadOptions::default()
        }),
    );
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..200 {
        let d = d.clone();
        calls.spawn(async move {
            let id = format!("r{i}");
            d.dispatch("m", common::request(&id)).await
        });
    }
    let mut ok = 0;
    while let Some(outcome) = calls.join_next().await {
        if matches!(outcome.unwrap(), SyncOutcome::Http { status: 200, .. }) {
            ok += 1;
        }
    }
    assert_eq!(ok, 200);
    assert_eq!(gateway.stats().total, 200);
    // The limiter's bound (per_endpoint 10), not a limit a reading would give (up to 100).
    assert!(d.limit("m").unwrap() <= 10, "{:?}", d.limit("m"));
}

/// Fresh readings set the limit (here above the limiter's bound of 10: a pool of 40 with
/// nothing running); once the source stops answering, within a second or so the limiter's
/// limit is back; when it answers again, the readings take over again.
#[tokio::test]
async fn a_source_that_goes_away_hands_the_limit_back_to_the_limiter_and_back() {
    let gateway = model_server(false).await;
    let source = model_server(false).await;
    let addr = source.addr();
    let d = dispatcher(
        &gateway,
        Some(LoadOptions {
            max_running_per_pod: Some(40),
            headroom: 0.0,
            ..load_of(&source)
        }),
    );
    let followed = |d: &SyncDispatcher| d.limit("m").unwrap() == 40;
    assert!(
        common::eventually(Duration::from_secs(5), || followed(&d)).await,
        "{:?}",
        d.limit("m")
    );
    source.shutdown().await;
    let started = Instant::now();
    assert!(
        common::eventually(Duration::from_secs(5), || d.limit("m").unwrap() <= 10).await,
        "{:?}",
        d.limit("m")
    );
    let back = started.elapsed();
    assert!(
        back >= Duration::from_millis(900),
        "{back:?}: not stale yet"
    );
    // The source comes back on the same address.
    let _again = Gateway::start(
        addr,
        GatewayConfig {
            max_num_seqs: Some(8),
            ..GatewayConfig::default()
        },
    )
    .await
    .unwrap();
    assert!(
        common::eventually(Duration::from_secs(5), || followed(&d)).await,
        "{:?}",
        d.limit("m")
    );
}

/// The same through a real Prometheus scraping the server every 250 ms (`prometheus_url` with
/// `pool`, the `inference_pool` label): its counts are a scrape old, and the batch's own
/// requests are taken off as they were at the scrape. Online p95 is clearly lower than without
/// `load`, and the batch still progresses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_prometheus_too_the_batch_leaves_online_traffic_its_room() {
    let _serial = TIMING.lock().await;
    let span = Duration::from_secs(8);
    let rate = 28.0;
    let gateway = model_server(false).await;
    let prometheus = batch_testkit::PrometheusServer::start(
        &[gateway.addr().to_string()],
        "pool-a",
        Duration::from_millis(250),
    );
    let load = LoadOptions {
        metrics_urls: Vec::new(),
        prometheus_url: Some(prometheus.url()),
        pool: Some("pool-a".into()),
        ..LoadOptions::default()
    };
    let d = dispatcher(&gateway, Some(load));
    // Readings come through Prometheus: an idle pool of 8 with headroom 0.15 gives 6 at most,
    // above the limiter's start of 5 once the capacity is learnt; first the probe grows it.
    assert!(
        common::eventually(Duration::from_secs(10), || d.limit("m").unwrap() > 5).await,
        "{:?}",
        d.limit("m")
    );
    let without = run_phase(&gateway, Some(dispatcher(&gateway, None)), rate, span).await;
    let with = run_phase(&gateway, Some(d), rate, span).await;
    eprintln!("batch without load: {without:?}\nbatch with load through Prometheus: {with:?}");
    assert_eq!(with.online_failed, 0, "{with:?}");
    assert!(
        with.online_p95.as_secs_f64() < 0.8 * without.online_p95.as_secs_f64(),
        "online p95 with load {:?}, without {:?}",
        with.online_p95,
        without.online_p95
    );
    assert!(with.batch_done > 22, "{with:?}");
}

/// Three flows (batch jobs) side by side, each keeping 64 requests waiting at the endpoint,
/// far more than the room `load` leaves on a server of 8: the flows get the limit in turn, so
/// each one's answers keep up with the others' (each at least a third of the one furthest
/// ahead), where first come first served let one flow's 64 through before the next flow's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flows_side_by_side_share_the_room_the_load_leaves() {
    // Not timed, but its load would be latency for the tests that are.
    let _serial = TIMING.lock().await;
    const FLOWS: [&str; 3] = ["job-a", "job-b", "job-c"];
    let gateway = model_server(false).await;
    let d = dispatcher(&gateway, Some(load_of(&gateway)));
    let done: Arc<[AtomicUsize; 3]> = Arc::new(Default::default());
    let mut senders = Vec::new();
    for (k, flow) in FLOWS.into_iter().enumerate() {
        let (d, done) = (d.clone(), done.clone());
        senders.push(tokio::spawn(async move {
            let mut calls = tokio::task::JoinSet::new();
            for n in 0.. {
                while calls.len() >= 64 {
                    calls.join_next().await;
                }
                let (d, done) = (d.clone(), done.clone());
                calls.spawn(async move {
                    let id = format!("{flow}-{n}");
                    let request = SyncRequest {
                        flow: batch_sync_dispatch::Flow::alone(flow),
                        ..common::request(&id)
                    };
                    if let SyncOutcome::Http { status: 200, .. } = d.dispatch("m", request).await {
                        done[k].fetch_add(1, Ordering::SeqCst);
                    }
                });
            }
        }));
    }
    let mut samples = Vec::new();
    loop {
        let now: Vec<usize> = done.iter().map(|d| d.load(Ordering::SeqCst)).collect();
        let leader = *now.iter().max().unwrap();
        samples.push(now);
        if leader >= 60 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for sender in senders {
        sender.abort();
    }
    let checked: Vec<_> = samples
        .iter()
        .filter(|s| *s.iter().max().unwrap() >= 24)
        .collect();
    assert!(!checked.is_empty());
    for sample in checked {
        let leader = *sample.iter().max().unwrap();
        assert!(
            sample.iter().all(|&n| 3 * n >= leader),
            "a flow left behind at {sample:?}: {samples:?}"
        );
    }
}
