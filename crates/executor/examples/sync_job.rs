//! Runs a batch job in sync mode from Rust: the executor reads a JSONL input file, calls an
//! OpenAI-compatible gateway itself, and writes `output.jsonl`, `error.jsonl` and `batch.json`.
//!
//! The gateway here is the simulator of `tools/gateway-sim`, on a loopback port; point the
//! model's `url` at a real gateway and the code is the same.
//!
//! ```text
//! cargo run -p batch-executor --example sync_job
//! ```

use batch_config::figment::providers::{Format, Yaml};
use batch_config::figment::Figment;
use batch_config::ProcessorConfig;
use batch_executor::{Executor, JobSpec};
use batch_wire::BatchStatus;
use gateway_sim::{Gateway, GatewayConfig};
use tokio_util::sync::CancellationToken;

type Error = Box<dyn std::error::Error>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let gateway = Gateway::start("127.0.0.1:0".parse()?, GatewayConfig::default()).await?;
    let dir = tempfile::tempdir()?;

    // The configuration as `processor.yaml` would hold it; `ProcessorConfig::load` reads the
    // same from a file, with `PROCESSOR_…` environment overrides.
    let yaml = format!(
        "dispatch_mode: sync\nwork_dir: {}\nmodel_gateways:\n  llama-3:\n    url: {url}\n  mistral:\n    url: {url}\n",
        dir.path().join("work").display(),
        url = gateway.base_url(),
    );
    let config = ProcessorConfig::from_figment(Figment::from(Yaml::string(&yaml)))?;

    // The demo's input: 40 chat requests to `llama-3` and `mistral`.
    let input = batch_testkit::demo_input();
    let lines = std::fs::read_to_string(&input)?.lines().count() as u64;
    let out = dir.path().join("out");

    let executor = Executor::new(config).await?;
    let batch = executor
        .run(JobSpec::new(&input, &out), CancellationToken::new())
        .await?;
    executor.shutdown().await;
    gateway.shutdown().await;

    println!(
        "{}: {:?}, {} of {} requests completed",
        batch.id, batch.status, batch.request_counts.completed, batch.request_counts.total
    );
    let output = std::fs::read_to_string(out.join("output.jsonl"))?;
    if batch.status != BatchStatus::Completed
        || batch.request_counts.completed != lines
        || output.lines().count() as u64 != lines
    {
        return Err(format!("expected {lines} completed lines, got {batch:?}").into());
    }
    if let Some(first) = output.lines().next() {
        println!("first line of output.jsonl: {first}");
    }
    Ok(())
}
