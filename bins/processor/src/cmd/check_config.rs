//! `processor check-config`: validate a config and print it resolved.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `check-config`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The YAML config file; `PROCESSOR_…` environment variables override it.
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
}

/// Prints the resolved config as YAML on stdout (exit 0), or every problem on stderr (exit 2).
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config = match super::load_config(&args.config) {
        Ok(config) => config,
        Err(code) => return Ok(code),
    };
    tracing::debug!(config = %args.config.display(), "configuration is valid");
    std::io::stdout().write_all(config.to_redacted_yaml().as_bytes())?;
    Ok(ExitCode::SUCCESS)
}
