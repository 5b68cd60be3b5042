//! `processor queues`: the queue names of each pool and what to give the real dispatcher.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use batch_config::DispatcherQueues;

use super::EXIT_INVALID;

/// Arguments of `queues`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The YAML config file; `PROCESSOR_…` environment variables override it.
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// Print only the JSON array for the dispatcher's `--redis.ss.queues-config-file` (v0.9).
    #[arg(long, conflicts_with = "transport_config")]
    pub json: bool,
    /// Print only the JSON object for the v0.10 dispatcher's `--transport-config-file`; it has no
    /// `url` (the Redis URL may hold a password): a note on stderr says so.
    #[arg(long)]
    pub transport_config: bool,
    /// Use this gateway URL as every queue's `igw_base_url` instead of the models' `url`.
    #[arg(long, value_name = "URL")]
    pub igw_base_url: Option<String>,
}

/// Prints the pools and the dispatcher settings; exit 2 when the config is invalid or has no pool.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config = match super::load_config(&args.config) {
        Ok(config) => config,
        Err(code) => return Ok(code),
    };
    let queues = match config.dispatcher_queues() {
        Ok(mut queues) => {
            if let Some(url) = &args.igw_base_url {
                for entry in &mut queues.queues_config {
                    entry.igw_base_url = url.trim_end_matches('/').to_owned();
                }
            }
            queues
        }
        Err(e) => {
            eprintln!("processor: {e}");
            return Ok(ExitCode::from(EXIT_INVALID));
        }
    };
    if queues.pools.is_empty() {
        eprintln!(
            "processor: no model in {} has an inference_pool_name: set one per model to use the dispatcher",
            args.config.display()
        );
        return Ok(ExitCode::from(EXIT_INVALID));
    }
    for warning in &queues.sizing.warnings {
        eprintln!("processor: warning: {warning}");
    }
    let text = if args.json {
        eprintln!("# start it with: {}", queues.command_v0_9("queues.json"));
        queues
            .prometheus_requirements()
            .iter()
            .for_each(|line| eprintln!("{line}"));
        format!("{}\n", queues.queues_config_json())
    } else if args.transport_config {
        eprintln!(
            "# `url` is left out so that no Redis password is printed: add \"url\": \"redis://...\" \
             (the URL in {}) before giving the file to the dispatcher's --transport-config-file, \
             or give it the address another way.",
            config.redis_url_file.display()
        );
        placeholder_note(&queues, |line| eprintln!("{line}"));
        eprintln!(
            "# start it with: {}",
            queues.command_v0_10("transport.json")
        );
        queues
            .prometheus_requirements()
            .iter()
            .for_each(|line| eprintln!("{line}"));
        format!("{}\n", queues.transport_config().to_json())
    } else {
        human(&queues)
    };
    std::io::stdout().write_all(text.as_bytes())?;
    Ok(ExitCode::SUCCESS)
}

fn human(queues: &DispatcherQueues) -> String {
    let mut out = String::new();
    for pool in &queues.pools {
        // Writing to a String cannot fail.
        let _ = writeln!(out, "pool {}", pool.pool);
        let _ = writeln!(out, "  models:        {}", pool.models.join(", "));
        let _ = writeln!(out, "  request queue: {}", pool.request_queue_name);
        let _ = writeln!(out, "  result queue:  {}", pool.result_queue_name);
        out.push('\n');
    }
    out.push_str(&sizing(queues));
    out.push_str(
        "# dispatcher --redis.ss.queues-config-file (write it with `processor queues --json`):\n",
    );
    out.push_str(&queues.queues_config_json());
    out.push_str("\n\n# dispatcher --redis.ss.result-queue-name:\n");
    if let Some(name) = &queues.result_queue_name {
        let _ = writeln!(out, "{name}");
    }
    out.push_str(
        "# This is only the dispatcher's fallback: every request this processor enqueues names its own\n\
         # result list (internal.result_queue_name), and the queue entries above set none, so each\n\
         # pool's results reach the result queue listed for it, whatever this flag says.\n",
    );
    out.push_str(
        "\n# v0.10 dispatcher --transport-config-file (write it with `processor queues --transport-config`):\n",
    );
    out.push_str(&queues.transport_config().to_json());
    out.push_str("\n# It has no `url`: the Redis URL may hold a password. Add it before use.\n");
    placeholder_note(queues, |line| {
        let _ = writeln!(out, "{line}");
    });
    out.push_str(&commands(queues));
    out
}

/// The gate and pacing the entries and commands carry, how each was chosen, and the warnings.
fn sizing(queues: &DispatcherQueues) -> String {
    let s = &queues.sizing;
    let mut out = String::from("# gate and pacing (async_dispatch.dispatcher in the config):\n");
    let gates: std::collections::BTreeSet<&str> = queues
        .queues_config
        .iter()
        .map(|q| q.gate_type.as_str())
        .collect();
    let gates: Vec<&str> = gates.into_iter().collect();
    let _ = writeln!(out, "#   gate_type:            {}", gates.join(", "));
    for (pool, p) in &s.pools {
        let _ = writeln!(
            out,
            "#   {:<21} {} pod(s), max_concurrency {} per pod, baseline {}: the gate closes once {:.0} requests run on a pod",
            format!("{pool}:"),
            p.pods,
            p.max_concurrency,
            p.baseline,
            p.closes_at()
        );
    }
    let _ = writeln!(
        out,
        "#   poll interval:        {} ms, batch size {}: a poll of a queue takes batch size × budget\n\
         #                         requests, budget = 1 − running / (pods × max_concurrency) − baseline",
        s.poll_interval_ms, s.batch_size
    );
    let _ = writeln!(
        out,
        "#   workers:              {} (--concurrency): the most batch requests in flight at once",
        s.concurrency
    );
    if queues.reads_load() {
        let _ = writeln!(
            out,
            "#   load readings:        at most {} old (--prometheus-cache-ttl)",
            s.prometheus_cache_ttl
        );
    }
    for warning in &s.warnings {
        let _ = writeln!(out, "# WARNING: {warning}");
    }
    out.push('\n');
    out
}

/// The dispatcher's command lines, with what each variable must hold.
fn commands(queues: &DispatcherQueues) -> String {
    let mut out = String::from(
        "\n# Start the dispatcher with every flag it needs (REDIS_URL holds the Redis URL):\n",
    );
    for line in queues.prometheus_requirements() {
        out.push_str(&line);
        out.push('\n');
    }
    if queues.needs_prometheus() {
        out.push_str("# Without --prometheus-url the dispatcher refuses to start.\n");
    }
    out.push_str("# v0.9, with the file `processor queues --json` writes:\n");
    out.push_str(&queues.command_v0_9("queues.json"));
    out.push_str(
        "\n# v0.10, with the file `processor queues --transport-config` writes (its url added):\n",
    );
    out.push_str(&queues.command_v0_10("transport.json"));
    out.push('\n');
    out
}

/// Says which placeholder to replace, when some queue entry has one.
fn placeholder_note(queues: &DispatcherQueues, mut say: impl FnMut(&str)) {
    if queues
        .queues_config
        .iter()
        .any(|entry| entry.igw_base_url == batch_config::PLACEHOLDER_GATEWAY_URL)
    {
        say(&format!(
            "# Replace {} with the pool's inference gateway URL (no model of that pool has a url).",
            batch_config::PLACEHOLDER_GATEWAY_URL
        ));
    }
}
