//! The executor's metrics, with the original processor's names.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::RwLock;

use batch_sink::Written;
use batch_wire::BatchStatus;

/// The label of every model a client names that no config of this process serves: an input
/// file chooses its model names, and each label value is a series kept for good.
pub(crate) const OTHER_MODEL: &str = "other";

/// The models of every executor of this process: the only `model` label values besides
/// [`OTHER_MODEL`].
static KNOWN_MODELS: RwLock<BTreeSet<String>> = RwLock::new(BTreeSet::new());

/// Adds configured models to the label values.
pub(crate) fn know_models<'a>(models: impl Iterator<Item = &'a String>) {
    let mut known = KNOWN_MODELS.write().unwrap_or_else(|e| e.into_inner());
    known.extend(models.cloned());
}

/// `model` as a label value: itself when configured, else [`OTHER_MODEL`].
pub(crate) fn model_label(model: &str) -> String {
    let known = KNOWN_MODELS.read().unwrap_or_else(|e| e.into_inner());
    match known.contains(model) {
        true => model.to_owned(),
        false => OTHER_MODEL.to_owned(),
    }
}

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
                    t.prompt_tokens += u.input_tokens;
                    t.completion_tokens += u.output_tokens;
                }
            }
            Written::Error => {
                t.written += 1;
                t.errors += 1;
            }
            Written::Duplicate => {}
        }
    }

    /// Emits the counts; with `settle_inflight`, lowers the job's `model_inflight_requests` by
    /// the lines written (results of requests that were counted in flight).
    pub(crate) fn emit(
        self,
        model_name: impl Fn(u16) -> String,
        settle_inflight: Option<&Inflight>,
    ) {
        for (model, t) in self.models {
            let model = model_label(&model_name(model));
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
            if let Some(inflight) = settle_inflight {
                inflight.remove_label(&model, t.written);
            }
        }
    }
}

/// One job's share of `model_inflight_requests`, per model label. The gauge is shared by every
/// job of the process, so each job takes back exactly what it added, and all of it when its
/// run ends however it ends (cancel, expiry, failure, a pause, a lost lease): otherwise
/// requests that were never answered here would stay counted for good. A result of a request
/// sent before a restart was never counted by this process, so a job never takes back more
/// than it holds.
#[derive(Debug, Default)]
pub(crate) struct Inflight {
    held: std::sync::Mutex<BTreeMap<String, u64>>,
}

impl Inflight {
    /// `n` more of `model`'s requests in flight.
    pub(crate) fn add(&self, model: &str, n: u64) {
        if n == 0 {
            return;
        }
        let label = model_label(model);
        *self.held().entry(label.clone()).or_default() += n;
        metrics::gauge!("model_inflight_requests", "model" => label).increment(n as f64);
    }

    /// `n` of `model`'s requests answered or taken back.
    pub(crate) fn remove(&self, model: &str, n: u64) {
        self.remove_label(&model_label(model), n);
    }

    fn remove_label(&self, label: &str, n: u64) {
        let mut held = self.held();
        let Some(count) = held.get_mut(label) else {
            return;
        };
        let n = n.min(*count);
        *count -= n;
        if *count == 0 {
            held.remove(label);
        }
        drop(held);
        if n > 0 {
            metrics::gauge!("model_inflight_requests", "model" => label.to_owned())
                .decrement(n as f64);
        }
    }

    /// Takes back everything the job still holds: its run ended.
    pub(crate) fn settle(&self) {
        let held = std::mem::take(&mut *self.held());
        for (label, n) in held {
            metrics::gauge!("model_inflight_requests", "model" => label).decrement(n as f64);
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, u64>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub(crate) fn pool_counter(name: &'static str, pool: &str, n: u64) {
    if n > 0 {
        metrics::counter!(name, "pool" => pool.to_owned()).increment(n);
    }
}
