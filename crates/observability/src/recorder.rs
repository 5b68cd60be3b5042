//! The process-wide Prometheus recorder and the metrics it describes.

use std::sync::Mutex;
use std::time::Duration;

use metrics::Unit;
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

use crate::ObservabilityError;

/// Metric names the processor emits: the reference processor's (kept for its dashboards) and ours.
///
/// Crates that emit them may keep their own copies; these are what [`install_recorder`](crate::install_recorder)
/// describes and buckets.
pub mod names {
    /// Counter `{result, reason}`: jobs that reached a final state.
    pub const JOBS_PROCESSED_TOTAL: &str = "jobs_processed_total";
    /// Histogram: seconds from a job's start to its final state.
    pub const JOB_PROCESSING_DURATION_SECONDS: &str = "job_processing_duration_seconds";
    /// Gauge: requests being sent to the gateway right now (sync mode).
    pub const PROCESSOR_INFLIGHT_REQUESTS: &str = "processor_inflight_requests";
    /// Gauge `{model}`: requests of a model that are sent and not yet answered.
    pub const MODEL_INFLIGHT_REQUESTS: &str = "model_inflight_requests";
    /// Histogram `{model}`: seconds from sending a request to its final answer.
    pub const MODEL_REQUEST_EXECUTION_DURATION_SECONDS: &str =
        "model_request_execution_duration_seconds";
    /// Counter `{model}`: requests whose final outcome is not a 2xx answer.
    pub const REQUEST_ERRORS_BY_MODEL_TOTAL: &str = "request_errors_by_model_total";
    /// Counter `{model}`: prompt tokens reported by successful answers.
    pub const BATCH_REQUEST_PROMPT_TOKENS_TOTAL: &str = "batch_request_prompt_tokens_total";
    /// Counter `{model}`: generated tokens reported by successful answers.
    pub const BATCH_REQUEST_GENERATION_TOKENS_TOTAL: &str = "batch_request_generation_tokens_total";
    /// Gauge `{endpoint}`: the AIMD concurrency limit of a gateway endpoint.
    pub const AIMD_CONCURRENCY_LIMIT: &str = "batch_processor_aimd_concurrency_limit";
    /// Counter `{endpoint, signal}`: backpressure signals that lowered (or would lower) the limit.
    pub const AIMD_DECREASES_TOTAL: &str = "batch_processor_aimd_decreases_total";
    /// Counter `{endpoint}`: windows of successes that raised the limit.
    pub const AIMD_INCREASES_TOTAL: &str = "batch_processor_aimd_increases_total";
    /// Counter `{outcome}`: results popped from the dispatcher's result list, by what became of them.
    pub const CONSUMER_RESULTS_TOTAL: &str = "batch_consumer_results_total";
    /// Counter `{pool}`: requests added to a pool's dispatcher request queue.
    pub const REQUESTS_ENQUEUED_TOTAL: &str = "batch_requests_enqueued_total";
    /// Counter `{pool}`: requests put back on a pool's request queue (e.g. after a crash).
    pub const REQUESTS_REQUEUED_TOTAL: &str = "batch_requests_requeued_total";
    /// Counter `{pool}`: requests taken off a pool's request queue before dispatch (cancel, expiry).
    pub const REQUESTS_REMOVED_TOTAL: &str = "batch_requests_removed_total";
}

/// Upper bounds (seconds) for one inference request: 5 ms up to the 10 min a slow generation may take.
const REQUEST_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Upper bounds (seconds) for a whole job: 5 ms (an empty job) up to the 24 h completion window.
const JOB_BUCKETS: &[f64] = &[
    0.005, 0.05, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0,
    43200.0, 86400.0,
];

/// How often histogram samples are folded into buckets when nobody scrapes.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// A handle on the installed recorder; cheap to clone.
#[derive(Clone, Debug)]
pub struct MetricsHandle {
    inner: PrometheusHandle,
}

impl MetricsHandle {
    /// The current values of every metric, in the Prometheus text exposition format (0.0.4).
    pub fn render(&self) -> String {
        self.inner.render()
    }
}

/// Our recorder's handle, once installed; the mutex also serialises concurrent first calls.
static INSTALLED: Mutex<Option<MetricsHandle>> = Mutex::new(None);

/// Installs the global `metrics` recorder (Prometheus, without an HTTP listener of its own) once per
/// process; later calls return the same handle.
///
/// Also describes every metric in [`names`] (the `# HELP` lines), gives the request and job duration
/// histograms real buckets instead of summaries, and starts a thread that keeps histogram memory
/// bounded between scrapes.
///
/// # Errors
///
/// [`ObservabilityError::RecorderTaken`] if another recorder was installed globally first.
pub fn install_recorder() -> Result<MetricsHandle, ObservabilityError> {
    // A panic while holding the lock cannot leave a half-installed state behind.
    let mut installed = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(handle) = installed.as_ref() {
        return Ok(handle.clone());
    }
    let recorder = build_recorder()?;
    let handle = MetricsHandle {
        inner: recorder.handle(),
    };
    metrics::set_global_recorder(recorder).map_err(|_| ObservabilityError::RecorderTaken)?;
    describe_all();
    *installed = Some(handle.clone());
    let upkeep = handle.inner.clone();
    let spawned = std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || loop {
            std::thread::sleep(UPKEEP_INTERVAL);
            upkeep.run_upkeep();
        });
    // Not fatal: every scrape also drains the histograms; without scrapes memory grows slowly.
    if let Err(error) = spawned {
        tracing::warn!(%error, "metrics upkeep thread not started");
    }
    Ok(handle)
}

fn build_recorder() -> Result<PrometheusRecorder, ObservabilityError> {
    let builder = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(names::MODEL_REQUEST_EXECUTION_DURATION_SECONDS.into()),
            REQUEST_BUCKETS,
        )
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(names::JOB_PROCESSING_DURATION_SECONDS.into()),
                JOB_BUCKETS,
            )
        })
        .map_err(ObservabilityError::Recorder)?;
    Ok(builder.build_recorder())
}

/// Describes every metric to the current recorder (the global one, or a local one in tests).
fn describe_all() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    use names::*;

    describe_counter!(
        JOBS_PROCESSED_TOTAL,
        "Batch jobs that reached a final state, by result and reason."
    );
    describe_histogram!(
        JOB_PROCESSING_DURATION_SECONDS,
        Unit::Seconds,
        "Time from a batch job's start to its final state."
    );
    describe_gauge!(
        PROCESSOR_INFLIGHT_REQUESTS,
        "Requests being sent to the inference gateway right now."
    );
    describe_gauge!(
        MODEL_INFLIGHT_REQUESTS,
        "Requests of a model that are sent and not yet answered."
    );
    describe_histogram!(
        MODEL_REQUEST_EXECUTION_DURATION_SECONDS,
        Unit::Seconds,
        "Time from sending a request to its final answer, by model."
    );
    describe_counter!(
        REQUEST_ERRORS_BY_MODEL_TOTAL,
        "Requests whose final outcome is not a 2xx answer, by model."
    );
    describe_counter!(
        BATCH_REQUEST_PROMPT_TOKENS_TOTAL,
        "Prompt tokens reported by successful answers, by model."
    );
    describe_counter!(
        BATCH_REQUEST_GENERATION_TOKENS_TOTAL,
        "Generated tokens reported by successful answers, by model."
    );
    describe_gauge!(
        AIMD_CONCURRENCY_LIMIT,
        "Current AIMD concurrency limit of a gateway endpoint."
    );
    describe_counter!(
        AIMD_DECREASES_TOTAL,
        "Backpressure signals seen by the AIMD controller, by endpoint and signal."
    );
    describe_counter!(
        AIMD_INCREASES_TOTAL,
        "Times the AIMD controller raised an endpoint's concurrency limit."
    );
    describe_counter!(
        CONSUMER_RESULTS_TOTAL,
        "Results popped from the dispatcher's result list, by outcome."
    );
    describe_counter!(
        REQUESTS_ENQUEUED_TOTAL,
        "Requests added to a pool's dispatcher request queue."
    );
    describe_counter!(
        REQUESTS_REQUEUED_TOTAL,
        "Requests put back on a pool's dispatcher request queue."
    );
    describe_counter!(
        REQUESTS_REMOVED_TOTAL,
        "Requests taken off a pool's dispatcher request queue before dispatch."
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Renders what `emit` records into a fresh recorder built like the global one.
    fn render_local(emit: impl FnOnce()) -> String {
        let recorder = build_recorder().expect("valid buckets");
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe_all();
            emit();
        });
        handle.render()
    }

    #[test]
    fn request_durations_are_bucketed_histograms() {
        let text = render_local(|| {
            metrics::histogram!(names::MODEL_REQUEST_EXECUTION_DURATION_SECONDS, "model" => "m")
                .record(0.2);
        });
        let name = names::MODEL_REQUEST_EXECUTION_DURATION_SECONDS;
        assert!(
            text.contains(&format!("{name}_bucket{{model=\"m\",le=\"0.005\"}} 0")),
            "{text}"
        );
        assert!(
            text.contains(&format!("{name}_bucket{{model=\"m\",le=\"0.25\"}} 1")),
            "{text}"
        );
        assert!(
            text.contains(&format!("{name}_bucket{{model=\"m\",le=\"600\"}} 1")),
            "{text}"
        );
        assert!(
            text.contains(&format!("{name}_count{{model=\"m\"}} 1")),
            "{text}"
        );
        assert!(!text.contains("quantile="), "no summary expected: {text}");
    }

    #[test]
    fn job_durations_are_bucketed_up_to_a_day() {
        let text = render_local(|| {
            metrics::histogram!(names::JOB_PROCESSING_DURATION_SECONDS).record(4000.0);
        });
        let name = names::JOB_PROCESSING_DURATION_SECONDS;
        assert!(
            text.contains(&format!("{name}_bucket{{le=\"3600\"}} 0")),
            "{text}"
        );
        assert!(
            text.contains(&format!("{name}_bucket{{le=\"7200\"}} 1")),
            "{text}"
        );
        assert!(
            text.contains(&format!("{name}_bucket{{le=\"86400\"}} 1")),
            "{text}"
        );
    }

    #[test]
    fn every_name_is_described() {
        use names::*;
        let counters = [
            JOBS_PROCESSED_TOTAL,
            REQUEST_ERRORS_BY_MODEL_TOTAL,
            BATCH_REQUEST_PROMPT_TOKENS_TOTAL,
            BATCH_REQUEST_GENERATION_TOKENS_TOTAL,
            AIMD_DECREASES_TOTAL,
            AIMD_INCREASES_TOTAL,
            CONSUMER_RESULTS_TOTAL,
            REQUESTS_ENQUEUED_TOTAL,
            REQUESTS_REQUEUED_TOTAL,
            REQUESTS_REMOVED_TOTAL,
        ];
        let gauges = [
            PROCESSOR_INFLIGHT_REQUESTS,
            MODEL_INFLIGHT_REQUESTS,
            AIMD_CONCURRENCY_LIMIT,
        ];
        let histograms = [
            JOB_PROCESSING_DURATION_SECONDS,
            MODEL_REQUEST_EXECUTION_DURATION_SECONDS,
        ];
        let text = render_local(|| {
            for name in counters {
                metrics::counter!(name).increment(1);
            }
            for name in gauges {
                metrics::gauge!(name).set(1.0);
            }
            for name in histograms {
                metrics::histogram!(name).record(1.0);
            }
        });
        for (name, kind) in counters
            .iter()
            .map(|n| (n, "counter"))
            .chain(gauges.iter().map(|n| (n, "gauge")))
            .chain(histograms.iter().map(|n| (n, "histogram")))
        {
            assert!(
                text.contains(&format!("# HELP {name} ")),
                "{name} undescribed: {text}"
            );
            assert!(
                text.contains(&format!("# TYPE {name} {kind}\n")),
                "{name}: {text}"
            );
        }
    }
}
