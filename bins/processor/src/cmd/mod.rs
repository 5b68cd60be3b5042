//! One module per subcommand: its `Args` (clap) and a `run` returning the exit code.

pub mod cancel;
pub mod check_config;
pub mod observe;
pub mod progress;
pub mod queues;
pub mod run;
pub mod serve;

use std::path::Path;
use std::process::ExitCode;

use batch_config::{ConfigErrors, ProcessorConfig};

/// Exit code for an invalid configuration (and clap's code for bad usage).
pub const EXIT_INVALID: u8 = 2;

/// Loads the config, or prints every problem on stderr and gives the exit code to return.
pub fn load_config(path: &Path) -> Result<ProcessorConfig, ExitCode> {
    ProcessorConfig::load(path).map_err(|errors| report_invalid(&errors))
}

pub(crate) fn report_invalid(errors: &ConfigErrors) -> ExitCode {
    for error in &errors.errors {
        eprintln!("{error}");
    }
    let plural = if errors.len() == 1 { "" } else { "s" };
    eprintln!(
        "processor: invalid configuration ({} problem{plural})",
        errors.len()
    );
    ExitCode::from(EXIT_INVALID)
}
