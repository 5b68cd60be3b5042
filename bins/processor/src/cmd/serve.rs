//! `processor serve`: the OpenAI-compatible Batch API service.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use batch_config::ProcessorConfig;
use batch_service::{Service, ServiceError, ServiceOptions};
use tokio::signal::unix::{signal, SignalKind};

use super::report_invalid;

/// Arguments of `processor serve`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The processor config file (YAML) with its `serve` section.
    #[arg(long)]
    config: PathBuf,
    /// Listen here instead of `serve.listen` (port 0: any free port).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Rebuild the state in Redis (records, listings, queue) from storage before serving, even
    /// when Redis seems to hold it; prints what was found. Records Redis has are kept.
    #[arg(long)]
    rebuild_state: bool,
}

/// Serves until SIGTERM or SIGINT; either pauses the running jobs (they resume at the next
/// start) and exits 0.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config = match ProcessorConfig::load_service(&args.config) {
        Ok(c) => c,
        Err(errors) => return Ok(report_invalid(&errors)),
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        let options = ServiceOptions {
            listen: args.listen,
            rebuild_state: args.rebuild_state,
            ..Default::default()
        };
        let service = match Service::start(config, options).await {
            Ok(s) => s,
            Err(
                e @ (ServiceError::UnsafeRedis(_)
                | ServiceError::Executor(batch_executor::ExecError::UnsafeRedis(_))),
            ) => {
                eprintln!("processor: {e}");
                return Ok(ExitCode::from(super::EXIT_INVALID));
            }
            Err(e) => return Err(anyhow::Error::new(e).context("starting the service")),
        };
        let mut out = std::io::stdout();
        writeln!(out, "listening on http://{}", service.local_addr())?;
        if let Some(report) = service.rebuild_report() {
            writeln!(
                out,
                "rebuilt the state from storage: {}",
                serde_json::to_string(report)?
            )?;
        }
        out.flush()?;
        let which = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(signal = which, "stopping");
        service.shutdown().await;
        Ok(ExitCode::SUCCESS)
    })
}
