//! Concurrency limits and AIMD feedback, against real HTTP servers on 127.0.0.1.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use batch_sync_dispatch::{Algorithm, LimitOptions, SyncDispatcher, SyncOutcome};
use common::{eventually, fast_options, request, Counters, Gateway, Reply};
use futures::future::join_all;

fn limits(global: usize, per_endpoint: usize, aimd_min: usize) -> LimitOptions {
    LimitOptions {
        global,
        per_endpoint,
        aimd_enabled: true,
        aimd_min,
        backoff_factor: 0.5,
        additive_increase: 1,
        algorithm: Algorithm::Aimd,
    }
}

#[tokio::test]
async fn only_the_failing_endpoints_limit_drops() {
    let failing = Gateway::start(|_, _| Reply::status(429)).await;
    let healthy = Gateway::start(|_, _| Reply::ok()).await;
    let d = SyncDispatcher::new(limits(100, 8, 2));
    let mut options = fast_options(&failing.url);
    options.max_retries = 0;
    d.add_endpoint("failing", options).unwrap();
    d.add_endpoint("healthy", fast_options(&healthy.url))
        .unwrap();

    // One after the other, each 429 is an overload episode of its own.
    for i in 0..12 {
        let name = if i % 2 == 0 { "failing" } else { "healthy" };
        d.dispatch(name, request("r")).await;
    }
    assert_eq!(d.limit("failing"), Some(2), "8 → 4 → 2, then the floor");
    assert_eq!(d.limit("healthy"), Some(8));
}

#[tokio::test]
async fn requests_in_flight_together_cut_the_limit_once() {
    let failing = Gateway::start(|_, _| Reply::status(429)).await;
    let d = SyncDispatcher::new(limits(100, 8, 1));
    let mut options = fast_options(&failing.url);
    options.max_retries = 0;
    d.add_endpoint("m", options).unwrap();
    // Eight requests admitted under the same limit meet the same overload.
    join_all((0..8).map(|_| d.dispatch("m", request("r")))).await;
    assert_eq!(d.limit("m"), Some(4), "one cut, not 8 → 4 → 2 → 1");
}

#[tokio::test]
async fn the_limit_drops_on_backpressure_and_climbs_back_one_window_at_a_time() {
    // Answers: 429, 503, then OK forever.
    let gateway = Gateway::start(|n, _| match n {
        0 => Reply::status(429),
        1 => Reply::status(503),
        _ => Reply::ok(),
    })
    .await;
    let d = SyncDispatcher::new(limits(100, 8, 1));
    let mut options = fast_options(&gateway.url);
    options.max_retries = 0;
    d.add_endpoint("m", options).unwrap();

    d.dispatch("m", request("r")).await;
    assert_eq!(d.limit("m"), Some(4), "final 429");
    d.dispatch("m", request("r")).await;
    assert_eq!(d.limit("m"), Some(2), "final 5xx");
    d.dispatch("m", request("r")).await;
    assert_eq!(d.limit("m"), Some(2), "one success of a window of 2");
    d.dispatch("m", request("r")).await;
    assert_eq!(d.limit("m"), Some(3));
    for _ in 0..3 {
        d.dispatch("m", request("r")).await;
    }
    assert_eq!(d.limit("m"), Some(4));
}

#[tokio::test]
async fn a_success_that_needed_a_capacity_retry_lowers_the_limit() {
    let gateway = Gateway::start(|n, _| {
        if n == 0 {
            Reply::status(503)
        } else {
            Reply::ok()
        }
    })
    .await;
    let d = SyncDispatcher::new(limits(100, 8, 1));
    d.add_endpoint("m", fast_options(&gateway.url)).unwrap();
    let outcome = d.dispatch("m", request("r")).await;
    assert!(matches!(outcome, SyncOutcome::Http { status: 200, .. }));
    assert_eq!(d.limit("m"), Some(4));
}

#[tokio::test]
async fn other_4xx_count_as_success_and_aimd_can_be_off() {
    let gateway = Gateway::start(|_, _| Reply::status(404)).await;
    let d = SyncDispatcher::new(limits(100, 4, 1));
    d.add_endpoint("m", fast_options(&gateway.url)).unwrap();
    for _ in 0..4 {
        d.dispatch("m", request("r")).await;
    }
    assert_eq!(d.limit("m"), Some(4), "successes at max leave it at max");

    let failing = Gateway::start(|_, _| Reply::status(429)).await;
    let off = SyncDispatcher::new(LimitOptions {
        aimd_enabled: false,
        ..limits(100, 4, 1)
    });
    let mut options = fast_options(&failing.url);
    options.max_retries = 0;
    off.add_endpoint("m", options).unwrap();
    for _ in 0..4 {
        off.dispatch("m", request("r")).await;
    }
    assert_eq!(off.limit("m"), Some(4), "AIMD off: the limit stays fixed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_global_limit_holds_across_endpoints() {
    let counters = Arc::new(Counters::default());
    let slow = |_: usize, _: &common::Seen| Reply::ok().after(Duration::from_millis(20));
    let a = Gateway::start_shared(counters.clone(), slow).await;
    let b = Gateway::start_shared(counters.clone(), slow).await;
    let d = SyncDispatcher::new(limits(3, 4, 1));
    d.add_endpoint("a", fast_options(&a.url)).unwrap();
    d.add_endpoint("b", fast_options(&b.url)).unwrap();

    let calls = (0..40).map(|i| {
        let d = d.clone();
        tokio::spawn(async move {
            let name = if i % 2 == 0 { "a" } else { "b" };
            let outcome = d.dispatch(name, request("r")).await;
            assert!(d.global_in_use() <= 3);
            outcome
        })
    });
    for outcome in join_all(calls).await {
        assert!(matches!(
            outcome.unwrap(),
            SyncOutcome::Http { status: 200, .. }
        ));
    }
    assert_eq!(counters.requests(), 40);
    assert_eq!(
        counters.peak(),
        3,
        "the global limit is reached and never passed"
    );
    assert_eq!(d.global_in_use(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_limit_holds_and_one_dispatcher_serves_many_jobs() {
    let gateway = Gateway::start(|_, _| Reply::ok().after(Duration::from_millis(20))).await;
    let d = SyncDispatcher::new(limits(100, 2, 1));
    d.add_endpoint("m", fast_options(&gateway.url)).unwrap();
    // Two "jobs" sharing the process-wide dispatcher.
    let job = |d: SyncDispatcher| async move {
        join_all((0..10).map(|_| d.dispatch("m", request("r")))).await
    };
    let (one, two) = tokio::join!(tokio::spawn(job(d.clone())), tokio::spawn(job(d.clone())));
    assert_eq!(one.unwrap().len() + two.unwrap().len(), 20);
    assert_eq!(gateway.counters.peak(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_dispatch_releases_its_permits_and_aborts_the_request() {
    let gateway = Gateway::start(|n, _| {
        if n == 0 {
            Reply::ok().after(Duration::from_secs(30))
        } else {
            Reply::ok()
        }
    })
    .await;
    let d = SyncDispatcher::new(limits(1, 1, 1));
    d.add_endpoint("m", fast_options(&gateway.url)).unwrap();

    let call = tokio::spawn({
        let d = d.clone();
        async move { d.dispatch("m", request("r1")).await }
    });
    assert!(eventually(Duration::from_secs(5), || gateway.counters.requests() == 1).await);
    assert_eq!(d.in_use("m"), Some(1));
    assert_eq!(d.global_in_use(), 1);

    // What the executor's select! does when the job's SLO passes or it is cancelled.
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    assert_eq!(d.in_use("m"), Some(0));
    assert_eq!(d.global_in_use(), 0);
    assert!(
        eventually(Duration::from_secs(5), || {
            gateway.counters.aborted.load(Ordering::SeqCst) == 1
        })
        .await,
        "the gateway saw the client go away"
    );

    // Both permits (limit 1 each) are free again.
    let outcome = tokio::time::timeout(Duration::from_secs(5), d.dispatch("m", request("r2")))
        .await
        .expect("permits were released");
    assert!(matches!(outcome, SyncOutcome::Http { status: 200, .. }));
}

#[tokio::test]
async fn dropping_a_dispatch_during_backoff_releases_its_permits() {
    let gateway = Gateway::start(|_, _| Reply::status(429).header("retry-after", "20")).await;
    let d = SyncDispatcher::new(limits(1, 1, 1));
    let mut options = fast_options(&gateway.url);
    options.max_backoff = Duration::from_secs(30);
    d.add_endpoint("m", options).unwrap();
    let result =
        tokio::time::timeout(Duration::from_millis(300), d.dispatch("m", request("r"))).await;
    assert!(result.is_err(), "still backing off");
    assert_eq!(gateway.counters.requests(), 1);
    assert_eq!(d.in_use("m"), Some(0));
    assert_eq!(d.global_in_use(), 0);
}

/// The tests that read a limiter's limit off a gateway of known capacity run one at a time:
/// side by side on two cores, each one's CPU time is latency, and refusals, for the others.
static TIMING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs `work` while sampling endpoint "m"'s limit every 5 ms.
async fn sampling_limit<T>(
    d: &SyncDispatcher,
    work: impl std::future::Future<Output = T>,
) -> (T, Vec<usize>) {
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watch = tokio::spawn({
        let (d, done) = (d.clone(), done.clone());
        async move {
            let mut samples = Vec::new();
            while !done.load(Ordering::SeqCst) {
                samples.push(d.limit("m").unwrap());
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            samples
        }
    });
    let out = work.await;
    done.store(true, Ordering::SeqCst);
    (out, watch.await.unwrap())
}

fn gradient(global: usize, per_endpoint: usize, aimd_min: usize) -> LimitOptions {
    LimitOptions {
        algorithm: Algorithm::Gradient,
        ..limits(global, per_endpoint, aimd_min)
    }
}

/// A gateway serving at most `capacity` at once, each answer after `latency`, and 429
/// (`Retry-After: 0`) past it; with its counters.
async fn hard_limit(capacity: usize, latency: Duration) -> (Gateway, Arc<Counters>) {
    let counters = Arc::new(Counters::default());
    let seen = counters.clone();
    let gateway = Gateway::start_shared(counters.clone(), move |_, _| {
        if seen.inflight.load(Ordering::SeqCst) > capacity {
            Reply::status(429).header("retry-after", "0")
        } else {
            Reply::ok().after(latency)
        }
    })
    .await;
    (gateway, counters)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gradient_limiter_finds_a_hard_limit_from_below() {
    let _serial = TIMING.lock().await;
    const CAPACITY: usize = 4;
    // Long enough that a loaded machine's scheduling delays stay within the limiter's
    // tolerance of its latency floor.
    let (gateway, counters) = hard_limit(CAPACITY, Duration::from_millis(40)).await;
    let d = SyncDispatcher::new(gradient(100, 32, 1));
    let mut options = fast_options(&gateway.url);
    options.max_retries = 1000;
    d.add_endpoint("m", options).unwrap();
    assert_eq!(d.limit("m"), Some(1), "it slow-starts from aimd.min");

    let (calls, mut samples) = sampling_limit(
        &d,
        join_all((0..400).map(|_| d.dispatch("m", request("r")))),
    )
    .await;
    let ok = calls
        .iter()
        .filter(|o| matches!(o, SyncOutcome::Http { status: 200, .. }))
        .count();
    assert_eq!(ok, 400);
    samples.sort_unstable();
    let median = samples[samples.len() / 2];
    assert!(
        (CAPACITY - 1..=CAPACITY + 3).contains(&median),
        "the limit sits near the capacity, not at 32 nor at 1: median {median} of {samples:?}"
    );
    let refused = counters.requests() - 400;
    assert!(
        refused < 100,
        "{refused} 429s for 400 requests: each cut goes to the refused concurrency"
    );
    assert!(d.cuts("m").unwrap() >= 1);
}

/// A burst past the gateway's capacity: every refusal of the burst reaches the limiter, not
/// only the first one answered, so the limit goes to what the burst's last refusals saw
/// rather than down one cut at a time through further refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_of_an_overshoot_lowers_the_limit_toward_the_capacity() {
    let _serial = TIMING.lock().await;
    const CAPACITY: usize = 4;
    // Admitted ones outlast every refusal of the burst.
    let (gateway, _) = hard_limit(CAPACITY, Duration::from_millis(500)).await;
    // Slow start from 1 doubles per round trip: 1, 2 and 4 are served, then a burst of 8
    // meets a gateway of 4 and 4 of it are refused.
    let d = SyncDispatcher::new(gradient(100, 32, 1));
    let mut options = fast_options(&gateway.url);
    options.max_retries = 0;
    d.add_endpoint("m", options).unwrap();
    let calls = join_all((0..15).map(|_| d.dispatch("m", request("r")))).await;
    let served = calls
        .iter()
        .filter(|o| matches!(o, SyncOutcome::Http { status: 200, .. }))
        .count();
    assert_eq!(served, 11);
    // The first refusal answered met 8 in flight, the last ones about 5.
    let limit = d.limit("m").unwrap();
    assert!(limit <= 5, "the burst's refusals took the limit to {limit}");
    assert_eq!(d.cuts("m"), Some(1), "one episode");
}

/// Answers of varied length (10 ms + 1 ms per output token, told in `usage`) under a hard
/// limit: the work limiter weighs each latency by the answer's tokens, so the spread of
/// lengths is not taken for queueing and the limit sits at the capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_work_limiter_reads_answer_lengths_and_fills_a_hard_limit() {
    let _serial = TIMING.lock().await;
    const CAPACITY: usize = 6;
    // A lognormal-like spread: most answers short, some ten times longer.
    const LENGTHS: [u64; 12] = [12, 40, 25, 160, 33, 8, 60, 18, 110, 45, 20, 240];
    let counters = Arc::new(Counters::default());
    let seen = counters.clone();
    let gateway = Gateway::start_shared(counters.clone(), move |n, _| {
        if seen.inflight.load(Ordering::SeqCst) > CAPACITY {
            return Reply::status(429).header("retry-after", "0");
        }
        let tokens = LENGTHS[n % LENGTHS.len()];
        Reply {
            body: format!(
                r#"{{"choices":[],"usage":{{"prompt_tokens":3,"completion_tokens":{tokens},"total_tokens":{}}}}}"#,
                tokens + 3
            ),
            ..Reply::ok()
        }
        .after(Duration::from_millis(10 + tokens))
    })
    .await;
    let d = SyncDispatcher::new(LimitOptions {
        algorithm: Algorithm::Work,
        ..limits(100, 32, 1)
    });
    let mut options = fast_options(&gateway.url);
    options.max_retries = 1000;
    d.add_endpoint("m", options).unwrap();

    let (calls, samples) = sampling_limit(
        &d,
        join_all((0..500).map(|_| d.dispatch("m", request("r")))),
    )
    .await;
    assert!(calls
        .iter()
        .all(|o| matches!(o, SyncOutcome::Http { status: 200, .. })));
    // The second half, after the slow start and the first cut.
    let mut settled = samples[samples.len() / 2..].to_vec();
    settled.sort_unstable();
    let low = settled[settled.len() / 10];
    assert!(
        low >= CAPACITY - 1,
        "the limit stays at the capacity, not cut by long answers: 10th percentile {low} of {settled:?}"
    );
    let refused = counters.requests() - 500;
    assert!(refused < 125, "{refused} 429s for 500 requests");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_gradient_limiter_a_request_gives_its_permit_back_while_it_backs_off() {
    // The first request meets a 429 asking for a long wait; the second one, sent while the
    // first backs off, gets the endpoint's only permit.
    for (limits, gives_back) in [(gradient(100, 1, 1), true), (limits(100, 1, 1), false)] {
        let gateway = Gateway::start(|n, _| {
            if n == 0 {
                Reply::status(429).header("retry-after", "30")
            } else {
                Reply::ok()
            }
        })
        .await;
        let d = SyncDispatcher::new(limits);
        let mut options = fast_options(&gateway.url);
        options.max_backoff = Duration::from_secs(3);
        d.add_endpoint("m", options).unwrap();
        let first = tokio::spawn({
            let d = d.clone();
            async move { d.dispatch("m", request("first")).await }
        });
        assert!(eventually(Duration::from_secs(10), || gateway.counters.requests() == 1).await);
        if gives_back {
            assert!(eventually(Duration::from_secs(10), || d.in_use("m") == Some(0)).await);
            let second = d.dispatch("m", request("second")).await;
            assert!(matches!(second, SyncOutcome::Http { status: 200, .. }));
            assert!(!first.is_finished(), "the first is still backing off");
        } else {
            // The 429 is answered at once; the request then sleeps on its permit.
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert_eq!(d.in_use("m"), Some(1), "the reference keeps the permit");
            assert!(!first.is_finished());
        }
        let first = first.await.unwrap();
        assert!(matches!(first, SyncOutcome::Http { status: 200, .. }));
        assert_eq!(d.in_use("m"), Some(0));
        assert_eq!(d.global_in_use(), 0);
    }
}
