//! The executor's metrics, with the original processor's names.

use batch_sink::Written;
use batch_wire::BatchStatus;

pub(crate) fn job_processed(status: BatchStatus, reason: &'static str, duration: Option<f64>) {
    metrics::counter!("jobs_processed_total", "result" => status.as_str(), "reason" => reason)
        .increment(1);
    if let Some(secs) = duration {
        metrics::histogram!("job_processing_duration_seconds").record(secs);
    }
}

pub(crate) fn result_written(model: &str, written: &Written) {
    let model = model.to_owned();
    match written {
        Written::Output { status, usage } => {
            if *status != 200 {
                metrics::counter!("request_errors_by_model_total", "model" => model.clone())
                    .increment(1);
            }
            if let Some(u) = usage {
                metrics::counter!("batch_request_prompt_tokens_total", "model" => model.clone())
                    .increment(u.prompt_tokens);
                metrics::counter!("batch_request_generation_tokens_total", "model" => model)
                    .increment(u.completion_tokens);
            }
        }
        Written::Error => {
            metrics::counter!("request_errors_by_model_total", "model" => model).increment(1)
        }
        Written::Duplicate => {}
    }
}

pub(crate) fn model_inflight(model: &str, delta: f64) {
    metrics::gauge!("model_inflight_requests", "model" => model.to_owned()).increment(delta);
}

pub(crate) fn pool_counter(name: &'static str, pool: &str, n: u64) {
    if n > 0 {
        metrics::counter!(name, "pool" => pool.to_owned()).increment(n);
    }
}
