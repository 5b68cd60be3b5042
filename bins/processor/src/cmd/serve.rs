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
        Err(errors) => {
            super::observe::init_logging(false, None);
            return Ok(report_invalid(&errors));
        }
    };
    let traces = super::observe::init_logging_and_traces(&config)?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let outcome = runtime.block_on(async {
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
                | ServiceError::Executor(batch_executor::ExecError::Async(
                    batch_executor::AsyncError::UnsafeRedis(_),
                ))),
            ) => {
                eprintln!("processor: {e}");
                return Ok(ExitCode::from(super::EXIT_INVALID));
            }
            Err(e) => return Err(anyhow::Error::new(e).context("starting the service")),
        };
        // One write: a caller that reads the first line and closes the pipe must not make a
        // second write fail, and a closed stdout does not stop a running service.
        let scheme = if service.https() { "https" } else { "http" };
        let mut banner = format!("listening on {scheme}://{}\n", service.local_addr());
        if let Some(addr) = service.probes_addr() {
            banner.push_str(&format!("probes and metrics on http://{addr}\n"));
        }
        if let Some(report) = service.rebuild_report() {
            banner.push_str(&format!(
                "rebuilt the state from storage: {}\n",
                serde_json::to_string(report)?
            ));
        }
        let mut out = std::io::stdout().lock();
        if let Err(e) = out.write_all(banner.as_bytes()).and_then(|()| out.flush()) {
            tracing::warn!(error = %e, "could not write the address to stdout");
        }
        drop(out);
        let which = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(signal = which, "stopping");
        service.shutdown().await;
        Ok(ExitCode::SUCCESS)
    });
    drop(runtime);
    if let Some(traces) = traces {
        traces.shutdown();
    }
    outcome
}
