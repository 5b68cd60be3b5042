//! `processor`: the batch processor's command line. Thin: parse arguments, call the libraries.

mod cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Exit codes shared by every subcommand, printed in `--help`.
const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  unexpected failure (I/O error, bug)
  2  invalid configuration or usage: every problem is listed on stderr";

/// Batch processor for OpenAI-style batch jobs (sync HTTP or the llm-d-async dispatcher).
#[derive(Debug, Parser)]
#[command(name = "processor", version, after_help = EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Validate a config file and print the resolved configuration (secrets redacted).
    #[command(after_help = EXIT_CODES)]
    CheckConfig(cmd::check_config::Args),
    /// Print each pool's queue names and the dispatcher's queues config.
    #[command(after_help = EXIT_CODES)]
    Queues(cmd::queues::Args),
    /// Run batch jobs to their end: output.jsonl, error.jsonl and batch.json in each output dir.
    #[command(after_help = cmd::run::RUN_EXIT_CODES)]
    Run(cmd::run::Args),
    /// Serve the OpenAI Files and Batches API and run its jobs (SIGTERM/SIGINT: stop, jobs resume later).
    #[command(after_help = EXIT_CODES)]
    Serve(cmd::serve::Args),
    /// Cancel a job that is not running: withdraw its requests, close it as cancelled.
    #[command(after_help = EXIT_CODES)]
    Cancel(cmd::cancel::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let bars = matches!(&cli.command, Command::Run(args) if args.shows_progress());
    if bars {
        cmd::progress::enable_bars();
    }
    // `serve` starts its logging once its config says whether spans also go out as traces.
    if !matches!(&cli.command, Command::Serve(_)) {
        cmd::observe::init_logging(bars, None);
    }
    let outcome = match cli.command {
        Command::CheckConfig(args) => cmd::check_config::run(args),
        Command::Queues(args) => cmd::queues::run(args),
        Command::Run(args) => cmd::run::run(args),
        Command::Cancel(args) => cmd::cancel::run(args),
        Command::Serve(args) => cmd::serve::run(args),
    };
    match outcome {
        Ok(code) => code,
        Err(error) => {
            eprintln!("processor: {error:#}");
            ExitCode::from(1)
        }
    }
}
