//! `processor cancel`: cancels a job that is not running.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use batch_executor::Executor;

use super::load_config;

/// Arguments of `processor cancel`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The processor config file (YAML) the job ran with.
    #[arg(long)]
    config: PathBuf,
    /// The job's output directory (where its batch.json is).
    #[arg(long)]
    output_dir: PathBuf,
}

/// Withdraws the job's pending requests, closes its open lines as `batch_cancelled` and ends it
/// `cancelled`; prints the Batch object. A job that already ended is left as it is.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config = match load_config(&args.config) {
        Ok(c) => c,
        Err(code) => return Ok(code),
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        let executor = Executor::new(config).await?;
        let result = executor.cancel_stopped(&args.output_dir).await;
        executor.shutdown().await;
        let batch = result.with_context(|| format!("cancelling the job in {}", args.output_dir.display()))?;
        let c = batch.request_counts;
        eprintln!(
            "job {} {}: {} requests, {} completed, {} failed",
            batch.id,
            batch.status.as_str(),
            c.total,
            c.completed,
            c.failed
        );
        println!("{}", serde_json::to_string(&batch).expect("a batch serialises"));
        Ok(ExitCode::SUCCESS)
    })
}
