//! What the executor's end-to-end tests share beyond the rig of `batch_testkit::e2e`: the
//! config loaded, a job's spec, a job run to its end.

use std::path::Path;

use batch_config::ProcessorConfig;
use batch_executor::{Executor, JobSpec};
pub use batch_testkit::e2e::*;
use batch_wire::Batch;
use tokio_util::sync::CancellationToken;

/// The config at `config`, or a panic naming what is wrong with it.
pub fn load(config: &Path) -> ProcessorConfig {
    ProcessorConfig::load(config).unwrap_or_else(|e| panic!("config: {e}"))
}

/// The job of the env's file `input`, written into its directory `out`.
pub fn spec(env: &Env, input: &str, out: &str) -> JobSpec {
    JobSpec::new(env.path(input), env.path(out))
}

/// An executor on `config` and what it made of the env's `in.jsonl`, run to its end into `out`.
pub async fn run_job(env: &Env, config: &Path) -> (Executor, Batch) {
    let executor = Executor::new(load(config)).await.unwrap();
    let batch = executor
        .run(spec(env, "in.jsonl", "out"), CancellationToken::new())
        .await
        .unwrap();
    (executor, batch)
}
