//! The dry-run mode: every request is answered here, at once, with a fixed body naming its
//! `custom_id` and model (status 200), and nothing goes over a network. It runs a batch's files
//! through validation, planning, result files and resume exactly as the other modes do.
//!
//! It is written against the public seam alone ([`Dispatch`], [`Job`], [`Stop`], [`End`]): it
//! is also the smallest example of a mode.

use std::sync::Arc;

use batch_plan::ModelPlan;
use batch_wire::Outcome;
use futures::future::BoxFuture;

use crate::{blocking, Dispatch, End, ExecError, Job, JobFailure, Stop};

/// Lines answered with one write and flush.
const CHUNK: usize = 1024;

/// The dry-run mode (`dispatch_mode: dry_run`): answers every request locally with
/// `{"object": "dry_run", "custom_id": ..., "model": ...}` and status 200.
#[derive(Debug, Default)]
pub struct DryRun;

impl DryRun {
    /// The body answering line `index` of `job`, a request for `model`.
    fn answer(job: &Job, index: u64, model: &str) -> String {
        let custom_id = job.custom_id(index).unwrap_or_default();
        serde_json::json!({"object": "dry_run", "custom_id": custom_id, "model": model}).to_string()
    }

    /// Answers `model`'s open lines, a chunk per write, until none is left or `stop` fires.
    async fn answer_model(job: &Arc<Job>, model: &ModelPlan, stop: &Stop) -> Result<(), ExecError> {
        let open = {
            let (j, m) = (job.clone(), model.clone());
            blocking(move || j.unresolved_records(&m)).await?
        };
        job.dispatched(open.len() as u64);
        for chunk in open.chunks(CHUNK) {
            if stop.halt().is_cancelled() {
                return Ok(());
            }
            let answers: Vec<(u64, String)> = chunk
                .iter()
                .map(|r| {
                    (
                        r.line as u64,
                        Self::answer(job, r.line as u64, &model.model),
                    )
                })
                .collect();
            let j = job.clone();
            blocking(move || {
                j.record_all(answers.iter().map(|(index, body)| {
                    let outcome = Outcome::Http { status: 200, body };
                    (*index, outcome)
                }))
            })
            .await?;
        }
        Ok(())
    }
}

impl Dispatch for DryRun {
    fn run<'a>(&'a self, job: &'a Arc<Job>, stop: &'a Stop) -> BoxFuture<'a, End> {
        Box::pin(async move {
            for model in job.plan().models() {
                if let Err(e) = Self::answer_model(job, model, stop).await {
                    return End::Failed(e.into());
                }
            }
            match job.remaining() {
                0 => End::Completed,
                left => stop
                    .end()
                    .unwrap_or(End::Failed(JobFailure::Unanswered(left))),
            }
        })
    }
}
