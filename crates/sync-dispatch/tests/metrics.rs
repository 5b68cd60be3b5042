//! The metrics the dispatcher emits, read back through a real Prometheus recorder.
//!
//! One test in this binary: the recorder is process-global.

mod common;

use std::time::Duration;

use batch_sync_dispatch::{LimitOptions, SyncDispatcher};
use common::{eventually, fast_options, request, Gateway, Reply};
use metrics_exporter_prometheus::PrometheusHandle;

/// The value of the sample whose line starts with `series` (name and labels, as rendered).
fn sample(handle: &PrometheusHandle, series: &str) -> Option<f64> {
    let text = handle.render();
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aimd_inflight_latency_and_error_metrics() {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .unwrap();
    let limits = LimitOptions {
        global: 100,
        per_endpoint: 4,
        aimd_enabled: true,
        aimd_min: 2,
        backoff_factor: 0.5,
        additive_increase: 1,
        algorithm: batch_sync_dispatch::Algorithm::Aimd,
    };
    let d = SyncDispatcher::new(limits);

    let always_429 = Gateway::start(|_, _| Reply::status(429)).await;
    let mut options = fast_options(&always_429.url);
    options.max_retries = 0;
    d.add_endpoint("m429", options).unwrap();
    assert_eq!(
        sample(
            &handle,
            r#"batch_processor_aimd_concurrency_limit{endpoint="m429"}"#
        ),
        Some(4.0),
        "the gauge is set when the endpoint is added"
    );
    for _ in 0..3 {
        d.dispatch("m429", request("r")).await;
    }
    // 4 → 2, then at the floor: every signal still counts.
    assert_eq!(
        sample(
            &handle,
            r#"batch_processor_aimd_decreases_total{endpoint="m429",signal="429"}"#
        ),
        Some(3.0)
    );
    assert_eq!(
        sample(
            &handle,
            r#"batch_processor_aimd_concurrency_limit{endpoint="m429"}"#
        ),
        Some(2.0)
    );
    assert_eq!(
        sample(&handle, r#"request_errors_by_model_total{model="m429"}"#),
        Some(3.0)
    );

    let flaky = Gateway::start(|n, _| match n {
        0 => Reply::status(502),
        1 => Reply::status(500),
        _ => Reply::ok(),
    })
    .await;
    d.add_endpoint("flaky", fast_options(&flaky.url)).unwrap();
    d.dispatch("flaky", request("r")).await; // 502, then 500, then 200
    assert_eq!(
        sample(
            &handle,
            r#"batch_processor_aimd_decreases_total{endpoint="flaky",signal="capacity_retry"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&handle, r#"request_errors_by_model_total{model="flaky"}"#),
        None
    );
    // Limit 2 now: two plain successes complete a window.
    d.dispatch("flaky", request("r")).await;
    d.dispatch("flaky", request("r")).await;
    assert_eq!(
        sample(
            &handle,
            r#"batch_processor_aimd_increases_total{endpoint="flaky"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &handle,
            r#"batch_processor_aimd_concurrency_limit{endpoint="flaky"}"#
        ),
        Some(3.0)
    );
    assert_eq!(
        sample(
            &handle,
            r#"model_request_execution_duration_seconds_count{model="flaky"}"#
        ),
        Some(3.0)
    );

    let slow = Gateway::start(|_, _| Reply::ok().after(Duration::from_millis(500))).await;
    d.add_endpoint("slow", fast_options(&slow.url)).unwrap();
    let call = tokio::spawn({
        let d = d.clone();
        async move { d.dispatch("slow", request("r")).await }
    });
    assert!(
        eventually(Duration::from_secs(5), || {
            sample(&handle, "processor_inflight_requests") == Some(1.0)
        })
        .await
    );
    call.await.unwrap();
    assert_eq!(sample(&handle, "processor_inflight_requests"), Some(0.0));
}
