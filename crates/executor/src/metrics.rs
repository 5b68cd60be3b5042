//! The executor's metrics, with the original processor's names.

use std::collections::BTreeMap;

use batch_sink::Written;
use batch_wire::BatchStatus;

pub(crate) fn job_processed(status: BatchStatus, reason: &'static str, duration: Option<f64>) {
    metrics::counter!("jobs_processed_total", "result" => status.as_str(), "reason" => reason)
        .increment(1);
    if let Some(secs) = duration {
        metrics::histogram!("job_processing_duration_seconds").record(secs);
    }
}

/// Per-model counts of written lines, emitted once per batch of results: the metrics registry
/// is looked up per model, not per line.
#[derive(Default)]
pub(crate) struct Tally {
    models: BTreeMap<u16, ModelTally>,
}

#[derive(Default)]
struct ModelTally {
    written: u64,
    errors: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
}

impl Tally {
    pub(crate) fn add(&mut self, model: u16, written: &Written) {
        let t = self.models.entry(model).or_default();
        match written {
            Written::Output { status, usage } => {
                t.written += 1;
                t.errors += (*status != 200) as u64;
                if let Some(u) = usage {
                    t.prompt_tokens += u.prompt_tokens;
                    t.completion_tokens += u.completion_tokens;
                }
            }
            Written::Error => {
                t.written += 1;
                t.errors += 1;
            }
            Written::Duplicate => {}
        }
    }

    /// Emits the counts; `settle_inflight` lowers `model_inflight_requests` by the lines
    /// written (results of requests that were counted in flight).
    pub(crate) fn emit(self, model_name: impl Fn(u16) -> String, settle_inflight: bool) {
        for (model, t) in self.models {
            let model = model_name(model);
            if t.errors > 0 {
                metrics::counter!("request_errors_by_model_total", "model" => model.clone())
                    .increment(t.errors);
            }
            if t.prompt_tokens + t.completion_tokens > 0 {
                metrics::counter!("batch_request_prompt_tokens_total", "model" => model.clone())
                    .increment(t.prompt_tokens);
                metrics::counter!("batch_request_generation_tokens_total", "model" => model.clone())
                    .increment(t.completion_tokens);
            }
            if settle_inflight && t.written > 0 {
                model_inflight(&model, -(t.written as f64));
            }
        }
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
