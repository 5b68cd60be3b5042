//! `async-dispatcher-sim`: the simulated llm-d-async dispatcher (same flags as the real one's
//! sorted-set transport, v0.9's `--redis.ss.*` and v0.10's `--transport-config*`) and, with the
//! `gateway` subcommand, the fake inference gateway alone. All behaviour lives in the
//! `dispatcher-sim` library; this is argument parsing and wiring.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use dispatcher_sim::{
    check_listen_addr, Dispatcher, DispatcherConfig, DispatcherVersion, ExpiredPolicy, FailureRule,
    Gateway, GatewayConfig, QueueEntry, SimOptions, TransportConfig, DEFAULT_RESULT_QUEUE,
    DEFAULT_RETRY_QUEUE,
};

/// The exit code after `--sim.crash-after` fires, as a shell reports a SIGKILLed process.
const CRASH_EXIT: i32 = 137;

#[derive(Parser)]
#[command(
    name = "async-dispatcher-sim",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    dispatcher: DispatcherArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Runs only the fake OpenAI-compatible inference gateway.
    Gateway(GatewayArgs),
}

fn duration(s: &str) -> Result<Duration, humantime::DurationError> {
    humantime::parse_duration(s)
}

/// The gateway's latency, capacity and failure model.
#[derive(Args)]
struct GatewayModel {
    /// Fixed latency of every reply, e.g. 20ms.
    #[arg(long = "latency", value_parser = duration, default_value = "0s")]
    latency: Duration,
    /// Extra latency per output token (of usage.completion_tokens: max_tokens, default 16,
    /// or the drawn length with --length-median).
    #[arg(long = "per-token", value_parser = duration, default_value = "0s")]
    per_token: Duration,
    /// Draw each answer's length (tokens) from a lognormal of this median, whatever the
    /// request's max_tokens (seeded by --seed).
    #[arg(long = "length-median")]
    length_median: Option<u64>,
    /// The lognormal's sigma (of ln tokens).
    #[arg(long = "length-sigma", default_value_t = 0.8)]
    length_sigma: f64,
    /// Heavy tail: this share of answers (0 to 1) is --tail-factor times longer.
    #[arg(long = "tail-share", default_value_t = 0.0)]
    tail_share: f64,
    /// How much longer a tail answer is.
    #[arg(long = "tail-factor", default_value_t = 20.0)]
    tail_factor: f64,
    /// Model-server mode (needs --capacity C and --queue-limit): past C in flight the time per
    /// output token grows by in-flight / C (continuous batching), 429 only past the queue limit.
    #[arg(long = "batching")]
    batching: bool,
    /// At most this many requests at once; more get 429 with Retry-After.
    #[arg(long = "capacity")]
    capacity: Option<usize>,
    /// Queueing mode: admit up to this many (>= capacity); past the capacity latency grows
    /// with the load, and only past this limit the answer is 429.
    #[arg(long = "queue-limit")]
    queue_limit: Option<usize>,
    /// Retry-After seconds on 429s.
    #[arg(long = "retry-after", default_value_t = 1)]
    retry_after: u64,
    /// Failure rule KIND:RATE[:LIMIT], KIND one of 429, 500, 503, 400, ttl-expired,
    /// connection-reset. Repeatable.
    #[arg(long = "fail")]
    fail: Vec<FailureRule>,
    /// Seed for the failure dice and the answer lengths.
    #[arg(long = "seed")]
    seed: Option<u64>,
    /// Prompt prefixes each endpoint keeps cached (LRU); 0 = no prefix-cache model.
    #[arg(long = "prefix-cache-size", default_value_t = 0)]
    prefix_cache_size: usize,
    /// Extra latency of a request whose prompt prefix is not cached.
    #[arg(long = "prefix-miss-latency", value_parser = duration, default_value = "0s")]
    prefix_miss_latency: Duration,
    /// vLLM mode: this many requests run at once, the rest wait in arrival order, and
    /// `/metrics` shows `vllm:num_requests_running` and `vllm:num_requests_waiting`.
    #[arg(long = "max-num-seqs", conflicts_with_all = ["capacity", "queue_limit", "batching"])]
    max_num_seqs: Option<usize>,
}

impl GatewayModel {
    fn config(&self) -> GatewayConfig {
        GatewayConfig {
            latency_fixed: self.latency,
            latency_per_token: self.per_token,
            length_median: self.length_median,
            length_sigma: self.length_sigma,
            tail_share: self.tail_share,
            tail_factor: self.tail_factor,
            batching: self.batching,
            capacity: self.capacity,
            queue_limit: self.queue_limit,
            failures: self.fail.clone(),
            retry_after_secs: self.retry_after,
            seed: self.seed,
            prefix_cache_size: self.prefix_cache_size,
            prefix_miss_latency: self.prefix_miss_latency,
            max_num_seqs: self.max_num_seqs,
            ..GatewayConfig::default()
        }
    }
}

#[derive(Args)]
struct GatewayArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Accept a listen address outside 127.0.0.0/8 and ::1.
    #[arg(long = "allow-non-loopback")]
    allow_non_loopback: bool,
    #[command(flatten)]
    model: GatewayModel,
}

#[derive(Args)]
struct DispatcherArgs {
    /// Message queue implementation (v0.10 calls it --transport); only redis-sortedset is
    /// simulated.
    #[arg(
        long = "message-queue-impl",
        visible_alias = "transport",
        default_value = "redis-sortedset"
    )]
    message_queue_impl: String,
    /// Redis URL: redis://, rediss:// (TLS), redis-cluster://host:port?node=host:port,
    /// redis-sentinel://host:port?sentinelServiceName=NAME&node=host:port (rediss-… for TLS).
    #[arg(long = "redis.url", env = "REDIS_URL", hide_env_values = true)]
    redis_url: Option<String>,
    /// TLS: CA bundle to trust instead of the system roots (rediss… URLs only).
    #[arg(long = "redis.tls-ca-file")]
    redis_tls_ca_file: Option<PathBuf>,
    /// TLS: client certificate for mutual TLS (with --redis.tls-key-file).
    #[arg(long = "redis.tls-cert-file", requires = "redis_tls_key_file")]
    redis_tls_cert_file: Option<PathBuf>,
    /// TLS: the client certificate's private key (with --redis.tls-cert-file).
    #[arg(long = "redis.tls-key-file", requires = "redis_tls_cert_file")]
    redis_tls_key_file: Option<PathBuf>,
    /// TLS: the name the server certificate must carry, when it is not the URL's host.
    #[arg(long = "redis.tls-server-name")]
    redis_tls_server_name: Option<String>,
    /// A JSON file holding the array of queue entries.
    #[arg(long = "redis.ss.queues-config-file", conflicts_with = "queues_config")]
    queues_config_file: Option<PathBuf>,
    /// The array of queue entries as inline JSON.
    #[arg(long = "redis.ss.queues-config")]
    queues_config: Option<String>,
    /// v0.10: a JSON file holding {url, retry_queue_name, result_queue_name, poll_interval_ms,
    /// batch_size, enable_tracing, queues}; its fields win over the --redis.ss.* flags.
    #[arg(
        long = "transport-config-file",
        conflicts_with_all = ["transport_config", "queues_config_file", "queues_config"]
    )]
    transport_config_file: Option<PathBuf>,
    /// v0.10: the transport config object as inline JSON.
    #[arg(
        long = "transport-config",
        conflicts_with_all = ["queues_config_file", "queues_config"]
    )]
    transport_config: Option<String>,
    /// The release to behave like: 0.9 (ZPOPMIN, expired dropped) or 0.10 (leased claims,
    /// DEADLINE_EXCEEDED, request_token in results).
    #[arg(long = "dispatcher-version", default_value = "0.10")]
    dispatcher_version: DispatcherVersion,
    /// The result list used when neither the queue entry nor the message names one.
    #[arg(long = "redis.ss.result-queue-name", default_value = DEFAULT_RESULT_QUEUE)]
    result_queue_name: String,
    /// The retry sorted set.
    #[arg(long = "redis.ss.retry-queue-name", default_value = DEFAULT_RETRY_QUEUE)]
    retry_queue_name: String,
    /// Poll interval in milliseconds.
    #[arg(long = "redis.ss.poll-interval-ms", default_value_t = 1000)]
    poll_interval_ms: u64,
    /// Messages taken per poll at budget 1.
    #[arg(long = "redis.ss.batch-size", default_value_t = 10)]
    batch_size: usize,
    /// HTTP workers.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// How long a `prometheus-budget` gate reuses a load reading (0s: never).
    #[arg(long = "prometheus-cache-ttl", value_parser = duration, default_value = "5s")]
    prometheus_cache_ttl: Duration,
    /// Timeout of one HTTP request to the gateway.
    #[arg(long = "request-timeout", value_parser = duration, default_value = "5m")]
    request_timeout: Duration,
    /// v0.9 only: expired messages dropped, or answered with DEADLINE_EXCEEDED (result);
    /// v0.10 always answers them.
    #[arg(
        long = "sim.expired",
        visible_alias = "sim.expired-policy",
        default_value = "drop"
    )]
    expired: ExpiredPolicy,
    /// v0.10: claim lease (scaled by --sim.time-scale).
    #[arg(long = "sim.claim-lease", value_parser = duration, default_value = "300s")]
    claim_lease: Duration,
    /// v0.10: how often expired claims are put back (scaled by --sim.time-scale).
    #[arg(long = "sim.reclaim-interval", value_parser = duration, default_value = "15s")]
    reclaim_interval: Duration,
    /// Multiplies every retry backoff.
    #[arg(long = "sim.time-scale", default_value_t = 1.0)]
    time_scale: f64,
    /// Probability that a result is pushed twice.
    #[arg(long = "sim.duplicate-rate", default_value_t = 0.0)]
    duplicate_rate: f64,
    /// Exit abruptly after taking this many messages, losing those in hand.
    #[arg(long = "sim.crash-after")]
    crash_after: Option<u64>,
    /// Delay before each result is pushed.
    #[arg(long = "sim.result-delay", value_parser = duration, default_value = "0s")]
    result_delay: Duration,
    /// Seed for jitter and duplicate dice.
    #[arg(long = "sim.seed")]
    seed: Option<u64>,
    /// Run a gateway in process; queues without igw_base_url use it.
    #[arg(long = "embedded-gateway")]
    embedded_gateway: bool,
    /// Where the embedded gateway listens.
    #[arg(long = "embedded-gateway-listen", default_value = "127.0.0.1:0")]
    embedded_gateway_listen: SocketAddr,
    /// Embedded gateway: fixed latency.
    #[arg(long = "gateway.latency", value_parser = duration, default_value = "0s")]
    gateway_latency: Duration,
    /// Embedded gateway: latency per output token.
    #[arg(long = "gateway.per-token", value_parser = duration, default_value = "0s")]
    gateway_per_token: Duration,
    /// Embedded gateway: capacity.
    #[arg(long = "gateway.capacity")]
    gateway_capacity: Option<usize>,
    /// Embedded gateway: failure rule KIND:RATE[:LIMIT]. Repeatable.
    #[arg(long = "gateway.fail")]
    gateway_fail: Vec<FailureRule>,
    /// Embedded gateway: prompt prefixes cached per endpoint (0 = off).
    #[arg(long = "gateway.prefix-cache-size", default_value_t = 0)]
    gateway_prefix_cache_size: usize,
    /// Embedded gateway: extra latency of a prefix-cache miss.
    #[arg(long = "gateway.prefix-miss-latency", value_parser = duration, default_value = "0s")]
    gateway_prefix_miss_latency: Duration,
    /// The Prometheus a `prometheus-*` gate queries. The real dispatcher refuses to start
    /// without it when a queue has such a gate, and so does the simulator; its simulated gate
    /// reads the pool's load from the metrics page itself (`gate_params.metrics_url`, else the
    /// queue's gateway `/metrics`), not through this Prometheus.
    #[arg(long = "prometheus-url", value_name = "URL")]
    prometheus_url: Option<String>,
    /// Where the dispatcher serves /metrics.
    #[arg(long = "metrics-listen", default_value = "127.0.0.1:0")]
    metrics_listen: SocketAddr,
    /// Accept listen addresses outside 127.0.0.0/8 and ::1.
    #[arg(long = "allow-non-loopback")]
    allow_non_loopback: bool,
}

impl DispatcherArgs {
    /// The `--redis.tls-*` flags; `None` when none is given.
    fn redis_tls(&self) -> Option<batch_redis::RedisTls> {
        let tls = batch_redis::RedisTls {
            ca_file: self.redis_tls_ca_file.clone(),
            cert_file: self.redis_tls_cert_file.clone(),
            key_file: self.redis_tls_key_file.clone(),
            server_name: self.redis_tls_server_name.clone(),
        };
        (tls != batch_redis::RedisTls::default()).then_some(tls)
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("async-dispatcher-sim: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        match cli.command {
            Some(Command::Gateway(args)) => run_gateway(args).await,
            None => run_dispatcher(cli.dispatcher).await,
        }
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("async-dispatcher-sim: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// The line tests and scripts parse to find the servers.
fn announce(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

async fn run_gateway(args: GatewayArgs) -> anyhow::Result<()> {
    check_listen_addr(args.listen, args.allow_non_loopback)?;
    let gateway = Gateway::start(args.listen, args.model.config()).await?;
    announce(format!("listening gateway={}", gateway.base_url()));
    shutdown_signal().await;
    gateway.shutdown().await;
    Ok(())
}

async fn run_dispatcher(args: DispatcherArgs) -> anyhow::Result<()> {
    if args.message_queue_impl != "redis-sortedset" {
        bail!(
            "--message-queue-impl {:?} is not simulated; only redis-sortedset is",
            args.message_queue_impl
        );
    }
    let transport = transport_config(&args)?;
    let queues = match (&args.queues_config_file, &args.queues_config, &transport) {
        (Some(path), _, _) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            QueueEntry::parse_list(&text).with_context(|| path.display().to_string())?
        }
        (None, Some(json), _) => QueueEntry::parse_list(json)?,
        (None, None, Some(t)) if !t.queues.is_empty() => t.queues.clone(),
        (None, None, _) => {
            bail!("the queue entries are required: --transport-config-file, --transport-config (with queues), --redis.ss.queues-config-file or --redis.ss.queues-config")
        }
    };
    if args.prometheus_url.is_none() {
        if let Some(q) = queues.iter().find(|q| {
            q.gate_type
                .as_deref()
                .is_some_and(|g| g.starts_with("prometheus"))
        }) {
            bail!(
                "the gate of {} ({}) reads Prometheus: --prometheus-url is required",
                q.queue_name,
                q.gate_type.as_deref().unwrap_or_default()
            );
        }
    }
    let redis_url = transport
        .as_ref()
        .and_then(|t| t.url.clone())
        .or_else(|| args.redis_url.clone());
    let Some(redis_url) = redis_url else {
        bail!("--redis.url (or REDIS_URL, or url in the transport config) is required");
    };
    check_listen_addr(args.metrics_listen, args.allow_non_loopback)?;

    let gateway = if args.embedded_gateway {
        check_listen_addr(args.embedded_gateway_listen, args.allow_non_loopback)?;
        let config = GatewayConfig {
            latency_fixed: args.gateway_latency,
            latency_per_token: args.gateway_per_token,
            capacity: args.gateway_capacity,
            failures: args.gateway_fail.clone(),
            prefix_cache_size: args.gateway_prefix_cache_size,
            prefix_miss_latency: args.gateway_prefix_miss_latency,
            ..GatewayConfig::default()
        };
        Some(Gateway::start(args.embedded_gateway_listen, config).await?)
    } else {
        None
    };

    let mut config = DispatcherConfig::new(redis_url, queues);
    config.redis_tls = args.redis_tls();
    config.default_result_queue = args.result_queue_name;
    config.retry_queue = args.retry_queue_name;
    config.poll_interval = Duration::from_millis(args.poll_interval_ms);
    config.batch_size = args.batch_size;
    config.concurrency = args.concurrency;
    config.prometheus_cache_ttl = args.prometheus_cache_ttl;
    config.request_timeout = args.request_timeout;
    config.metrics_listen = Some(args.metrics_listen);
    config.version = args.dispatcher_version;
    config.sim = SimOptions {
        expired: args.expired,
        time_scale: args.time_scale,
        duplicate_rate: args.duplicate_rate,
        crash_after: args.crash_after,
        result_delay: args.result_delay,
        seed: args.seed,
        claim_lease: args.claim_lease,
        reclaim_interval: args.reclaim_interval,
    };
    if let Some(t) = &transport {
        t.apply(&mut config);
    }
    let dispatcher = Dispatcher::start(config, gateway.as_ref()).await?;
    let metrics = dispatcher
        .metrics_addr()
        .map(|a| format!("http://{a}"))
        .unwrap_or_else(|| "none".into());
    let gateway_url = gateway
        .as_ref()
        .map(|g| g.base_url())
        .unwrap_or_else(|| "none".into());
    announce(format!("listening gateway={gateway_url} metrics={metrics}"));

    tokio::select! {
        _ = dispatcher.crashed() => {
            // As abrupt as a kill: no cleanup, no flushing of what is in hand.
            std::process::exit(CRASH_EXIT);
        }
        _ = shutdown_signal() => {
            tracing::info!("shutting down");
        }
    }
    dispatcher.shutdown().await;
    if let Some(g) = gateway {
        g.shutdown().await;
    }
    Ok(())
}

/// The v0.10 transport config, from its file or inline, when given.
fn transport_config(args: &DispatcherArgs) -> anyhow::Result<Option<TransportConfig>> {
    match (&args.transport_config_file, &args.transport_config) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let parsed =
                TransportConfig::parse(&text).with_context(|| path.display().to_string())?;
            Ok(Some(parsed))
        }
        (None, Some(json)) => Ok(Some(
            TransportConfig::parse(json).context("--transport-config")?,
        )),
        (None, None) => Ok(None),
    }
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
