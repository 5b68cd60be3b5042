//! What every long-running subcommand sets up around its work: metrics, `/health`, `/ready`,
//! `/metrics`, and signal handling.

use batch_config::ProcessorConfig;
use batch_observability::{install_recorder, serve, Readiness, ServerHandle, TraceLayer, Traces};
use tokio_util::sync::CancellationToken;

/// Logs go to stderr, above the progress bars if any, so stdout stays machine-readable.
/// `RUST_LOG` filters them; by default `info`, or `warn` under progress bars, where a person
/// reads the screen and the bars say what the info lines would. With `traces`, the spans the
/// filter lets through are also exported.
pub fn init_logging(bars: bool, traces: Option<TraceLayer>) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let default = if bars { "warn" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // The trace layer sits right on the registry, the one subscriber it can work on.
    tracing_subscriber::registry()
        .with(traces)
        .with(filter)
        .with(
            tracing_subscriber::fmt::layer()
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_writer(super::progress::LogWriter),
        )
        .init();
}

/// Starts the logging, with traces when `observability.otlp_endpoint` or the
/// `OTEL_EXPORTER_OTLP_*` variables name a collector. Call it before the async runtime starts,
/// and [`Traces::shutdown`] after it ended, so the last spans are sent.
pub fn init_logging_and_traces(config: &ProcessorConfig) -> anyhow::Result<Option<Traces>> {
    let (layer, traces) =
        match batch_observability::trace_layer(config.observability.otlp_endpoint.as_deref()) {
            Ok(Some((layer, traces))) => (Some(layer), Some(traces)),
            Ok(None) => (None, None),
            Err(e) => {
                init_logging(false, None);
                return Err(e.into());
            }
        };
    init_logging(false, layer);
    if let Some(t) = &traces {
        tracing::info!(endpoint = t.endpoint(), "sending traces (OTLP over HTTP)");
    }
    Ok(traces)
}

/// The metrics recorder and, when `observability.addr` is set, the HTTP endpoint.
pub struct Observability {
    readiness: Readiness,
    server: Option<(ServerHandle, CancellationToken)>,
}

/// Installs the recorder and serves the endpoint if configured.
pub async fn start(config: &ProcessorConfig) -> anyhow::Result<Observability> {
    let metrics = install_recorder()?;
    let readiness = Readiness::default();
    let server = match config.observability.addr {
        Some(addr) => {
            let shutdown = CancellationToken::new();
            let handle = serve(addr, metrics, readiness.clone(), shutdown.clone()).await?;
            tracing::info!(addr = %handle.local_addr(), "serving /health, /ready and /metrics");
            Some((handle, shutdown))
        }
        None => None,
    };
    Ok(Observability { readiness, server })
}

impl Observability {
    /// Flips `/ready`.
    pub fn set_ready(&self, ready: bool) {
        self.readiness.set_ready(ready);
    }

    /// Stops the endpoint.
    pub async fn stop(self) {
        if let Some((handle, shutdown)) = self.server {
            shutdown.cancel();
            if let Err(e) = handle.join().await {
                tracing::warn!(error = %e, "observability endpoint stopped with an error");
            }
        }
    }
}

/// SIGTERM (Kubernetes stopping the pod) fires `pause`: the jobs stop within seconds and stay
/// resumable. SIGINT (Ctrl-C) fires `cancel`: the jobs are cancelled cleanly. A second signal of
/// the same kind exits at once, leaving the jobs to be resumed.
pub async fn handle_signals(cancel: CancellationToken, pause: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!(
            "cannot listen for signals; jobs can only be stopped by killing the process"
        );
        return;
    };
    let (mut terms, mut ints) = (0, 0);
    loop {
        tokio::select! {
            _ = term.recv() => terms += 1,
            _ = int.recv() => ints += 1,
        }
        if terms > 1 || ints > 1 {
            eprintln!("processor: exiting at once; run the same command again to resume the jobs");
            std::process::exit(130);
        }
        if terms == 1 && !pause.is_cancelled() {
            tracing::warn!(
                "SIGTERM: stopping; the jobs stay resumable (run the same command again)"
            );
            pause.cancel();
        } else if ints == 1 && !cancel.is_cancelled() {
            tracing::warn!("cancelling the jobs (press Ctrl-C again to exit at once)");
            cancel.cancel();
        }
    }
}
