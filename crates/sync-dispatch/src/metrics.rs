//! Metric names (the reference processor's, kept for its dashboards) and the AIMD signal labels.
//!
//! Emitted through the `metrics` facade; installing a recorder is the binary's job.

/// Gauge `{endpoint}`: the endpoint's current concurrency limit.
pub const AIMD_CONCURRENCY_LIMIT: &str = "batch_processor_aimd_concurrency_limit";
/// Counter `{endpoint, signal}`: backpressure signals, counted even when the limit is at its floor.
pub const AIMD_DECREASES_TOTAL: &str = "batch_processor_aimd_decreases_total";
/// Counter `{endpoint}`: windows of successes that raised the limit.
pub const AIMD_INCREASES_TOTAL: &str = "batch_processor_aimd_increases_total";
/// Gauge `{endpoint}`: the pool's requests that are not the batch's (running plus waiting,
/// less the batch's own in flight), at the last load reading.
pub const POOL_ONLINE_REQUESTS: &str = "batch_processor_pool_online_requests";
/// Gauge `{endpoint}`: 1 while the pool's load sets the endpoint's limit, 0 while the limiter
/// does (no load configured, or no fresh reading).
pub const LOAD_FOLLOWED: &str = "batch_processor_load_followed";
/// Gauge: requests holding both permits (sending, waiting for an answer, or backing off).
pub const INFLIGHT_REQUESTS: &str = "processor_inflight_requests";
/// Histogram `{model}`: seconds from sending the first attempt to the final answer.
pub const REQUEST_DURATION_SECONDS: &str = "model_request_execution_duration_seconds";
/// Counter `{model}`: dispatches whose final outcome is not a 2xx answer.
pub const REQUEST_ERRORS_TOTAL: &str = "request_errors_by_model_total";

/// Values of the `signal` label of [`AIMD_DECREASES_TOTAL`].
pub mod signals {
    /// The final answer was 429.
    pub const RATE_LIMITED: &str = "429";
    /// The final answer was a 5xx.
    pub const SERVER_ERROR: &str = "5xx";
    /// Any other final answer that needed a retry caused by a 429 or 5xx.
    pub const CAPACITY_RETRY: &str = "capacity_retry";
}

/// Keeps [`INFLIGHT_REQUESTS`] up while alive, also when the dispatch future is dropped.
pub(crate) struct InflightGuard;

impl InflightGuard {
    pub(crate) fn enter() -> Self {
        metrics::gauge!(INFLIGHT_REQUESTS).increment(1.0);
        InflightGuard
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        metrics::gauge!(INFLIGHT_REQUESTS).decrement(1.0);
    }
}
