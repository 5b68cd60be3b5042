#![doc = include_str!("../README.md")]

mod finalize;
mod http;
mod reaper;
mod recover;
mod runner;
mod tls;
mod webhooks;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use batch_api::{Api, ApiError, Hooks, Keys, LineStream};
use batch_config::{ProcessorConfig, ServeConfig};
use batch_executor::Executor;
use batch_state::Store;
use batch_storage::Storage;
use futures::future::BoxFuture;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use recover::StateGuard;
use runner::{Runner, RunnerConfig};

/// How long a shutdown waits for running jobs to pause.
const PAUSE_PATIENCE: Duration = Duration::from_secs(7);

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The configuration cannot be served.
    #[error("{0}")]
    Config(String),
    /// Storage cannot be used.
    #[error(transparent)]
    Storage(#[from] batch_storage::StorageError),
    /// Redis could not be reached.
    #[error(transparent)]
    Connect(#[from] batch_redis::ConnectError),
    /// The executor could not be set up.
    #[error(transparent)]
    Executor(#[from] batch_executor::ExecError),
    /// Redis may evict the service's keys, and the config does not accept it.
    #[error(transparent)]
    UnsafeRedis(#[from] batch_redis::EvictionRefused),
    /// The state could not be checked or rebuilt from storage at start.
    #[error("rebuilding the state from storage: {0}")]
    State(#[from] batch_state::StoreError),
    /// The listen address cannot be bound.
    #[error("cannot listen on {addr}: {error}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        error: std::io::Error,
    },
}

/// How long a `/metrics` scrape waits for Redis's job counts (Prometheus times out at 10 s).
const SCRAPE_REDIS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Choices of the embedder beyond the config.
#[derive(Debug, Clone, Default)]
pub struct ServiceOptions {
    /// Listen here instead of `serve.listen`.
    pub listen: Option<SocketAddr>,
    /// This replica's name in the job records, instead of `serve.replica_id`.
    pub replica_id: Option<String>,
    /// The metrics recorder to render on `/metrics` (default: installs the process's one).
    pub metrics: Option<batch_observability::MetricsHandle>,
    /// Rebuild Redis's state from storage at start even when Redis seems to hold it
    /// (`processor serve --rebuild-state`); records Redis has are kept.
    pub rebuild_state: bool,
}

/// A running service.
pub struct Service {
    addr: SocketAddr,
    https: bool,
    probes_addr: Option<SocketAddr>,
    runner: Arc<Runner>,
    executor: Arc<Executor>,
    stop_http: CancellationToken,
    stop_reaper: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    rebuilt: Option<batch_state::RebuildReport>,
}

/// `serve.s3` as the storage crate takes it.
fn s3_options(s3: &batch_config::S3Config) -> batch_storage::S3Options {
    batch_storage::S3Options {
        endpoint: s3.endpoint.clone(),
        region: s3.region.clone(),
        access_key_id: s3.access_key_id.as_ref().map(|k| k.expose().to_owned()),
        secret_access_key: s3.secret_access_key.as_ref().map(|k| k.expose().to_owned()),
        session_token: None,
        allow_http: s3.allow_http,
        profile: s3.profile.clone(),
    }
}

/// Step of the start: refuses keyless access off loopback, and warns of how callers are named.
fn check_access(serve: &ServeConfig, listen: SocketAddr) -> Result<(), ServiceError> {
    if let Some(header) = &serve.tenant_header {
        tracing::warn!(%listen, header, "serve.tenant_header is set: the service trusts the {header} header to name the caller; it must only be reachable through the authenticating proxy that sets it");
    } else if serve.api_keys.is_empty() {
        if !listen.ip().is_loopback() {
            return Err(ServiceError::Config(format!(
                "serve.api_keys_file is not set: without API keys the service only listens on a loopback address, not {listen}"
            )));
        }
        tracing::warn!(%listen, "serve.api_keys_file is not set: every request is tenant `default`, with no key");
    }
    Ok(())
}

/// What [`open_backends`] opened.
struct Backends {
    storage: Storage,
    store: Store,
    metrics: Option<batch_observability::MetricsHandle>,
}

/// Step of the start: opens storage and Redis, installs the metrics recorder (unless given one)
/// and checks that Redis keeps the service's keys.
async fn open_backends(
    config: &ProcessorConfig,
    metrics: Option<batch_observability::MetricsHandle>,
) -> Result<Backends, ServiceError> {
    let serve = &config.serve;
    let Some(redis_url) = config.redis_url.clone() else {
        return Err(ServiceError::Config(
            "the service needs Redis: set redis_url_file (and load the config with load_service)"
                .into(),
        ));
    };
    // A missing bucket or unreachable store stops the start, naming both.
    let storage = Storage::open(&serve.storage, &s3_options(&serve.s3)).await?;
    let connect = batch_redis::ConnectOptions {
        tls: config.redis_tls_options(),
        command_timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let client = batch_redis::connect(redis_url.expose(), &connect).await?;
    // Every record change also goes to storage, from which a Redis that lost it is rebuilt.
    let store = Store::new(client.clone(), &serve.state_prefix).with_mirror(storage.clone());
    let metrics = match metrics {
        Some(m) => Some(m),
        None => batch_observability::install_recorder()
            .map_err(|e| tracing::warn!(error = %e, "no /metrics: {e}"))
            .ok(),
    };
    batch_redis::check_durability(&client, config.redis_allow_eviction).await?;
    Ok(Backends {
        storage,
        store,
        metrics,
    })
}

/// Step of the start: the job runner's settings from `serve`.
fn runner_config(serve: &ServeConfig, replica: String, work_dir: PathBuf) -> RunnerConfig {
    RunnerConfig {
        replica,
        work_dir,
        max_active_jobs: serve.max_active_jobs,
        lease_ttl: serve.lease_ttl,
        checkpoint_interval: serve.checkpoint_interval,
        tenant_share: batch_state::SlotShare {
            cap: serve.tenant_max_running_batches,
            weights: serve.tenant_weights.clone(),
        },
        tenant_requests: serve.tenant_max_requests_in_flight,
        preemption: serve
            .tenant_preemption
            .then_some(serve.tenant_preemption_min_run),
    }
}

/// The API's listener and, with `observability.addr`, the probes' one, each with its address.
struct Listeners {
    api: TcpListener,
    addr: SocketAddr,
    probes: Option<(TcpListener, SocketAddr)>,
}

impl Listeners {
    /// Step of the start: binds the API's address, then `observability.addr` if set.
    fn bind(listen: SocketAddr, probes_addr: Option<SocketAddr>) -> Result<Self, ServiceError> {
        let listener = http::bind(listen).map_err(|error| ServiceError::Listen {
            addr: listen,
            error,
        })?;
        let addr = listener
            .local_addr()
            .map_err(|error| ServiceError::Listen {
                addr: listen,
                error,
            })?;
        // `observability.addr`: the probes and metrics on a port of their own too (a scrape
        // or kubelet port apart from the API's), bound before anything runs.
        let probes = match probes_addr {
            Some(at) => {
                let listener =
                    http::bind(at).map_err(|error| ServiceError::Listen { addr: at, error })?;
                let bound = listener
                    .local_addr()
                    .map_err(|error| ServiceError::Listen { addr: at, error })?;
                Some((listener, bound))
            }
            None => None,
        };
        Ok(Self {
            api: listener,
            addr,
            probes,
        })
    }

    /// The bound address of the probes' listener, if any.
    fn probes_addr(&self) -> Option<SocketAddr> {
        self.probes.as_ref().map(|(_, a)| *a)
    }
}

/// Step of the start: loads `serve.tls` and starts watching its files (pushed onto `tasks`).
fn tls_acceptor(
    serve: &ServeConfig,
    stop_reaper: &CancellationToken,
    tasks: &mut Vec<JoinHandle<()>>,
) -> Result<Option<TlsAcceptor>, ServiceError> {
    // `serve.tls`: a bad certificate or key stops the start, naming the file.
    Ok(match &serve.tls {
        Some(files) => {
            let certificates = tls::Certificates::load(files).map_err(ServiceError::Config)?;
            let acceptor = certificates.acceptor().map_err(ServiceError::Config)?;
            tasks.push(tokio::spawn(certificates.watch(stop_reaper.clone())));
            Some(acceptor)
        }
        None => None,
    })
}

/// Step of the start: the HTTP API over the store, storage and hooks, with `serve`'s limits.
fn build_api(
    serve: &ServeConfig,
    store: &Store,
    storage: &Storage,
    executor: &Executor,
    hooks: Arc<ServiceHooks>,
) -> Result<Api, ServiceError> {
    Ok(Api {
        store: store.clone(),
        storage: storage.clone(),
        keys: match &serve.tenant_header {
            Some(header) => Keys::from_header(header).ok_or_else(|| {
                ServiceError::Config(format!(
                    "serve.tenant_header {header:?} is not a header name"
                ))
            })?,
            None => Keys::new(&serve.api_keys),
        },
        limits: executor.config().input.clone(),
        edge: batch_api::EdgeLimits {
            max_json_body_bytes: serve.max_json_body_bytes,
            max_form_field_bytes: serve.max_form_field_bytes,
            max_filename_bytes: serve.max_filename_bytes,
            max_id_bytes: serve.max_id_bytes,
        },
        quotas: batch_api::Quotas {
            max_unfinished_batches: serve.tenant_max_batches,
            max_stored_bytes: serve.tenant_max_stored_bytes,
            max_files: serve.tenant_max_files,
        },
        pass_through_headers: Arc::from(serve.pass_through_headers.clone()),
        webhooks: serve.webhooks.clone(),
        hooks,
    })
}

/// Step of the start: serves the API (and the probes, on their own listener) until `stop_http`.
fn serve_http(
    listeners: Listeners,
    api: Api,
    tls: Option<TlsAcceptor>,
    serve: &ServeConfig,
    stop_http: &CancellationToken,
) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    let open_files = http::open_file_limit();
    let limits = http::EdgeLimits {
        first_request_timeout: serve.first_request_timeout,
        header_read_timeout: serve.header_read_timeout,
        idle_timeout: serve.idle_timeout,
        max_connections: serve.connection_ceiling(open_files),
        per_peer: serve.connections_per_peer(),
    };
    tracing::info!(
        max_connections = limits.max_connections,
        max_connections_per_peer = limits.per_peer,
        open_files,
        "connection limits"
    );
    let (app, probe_app) = batch_api::routers(api);
    tasks.push(tokio::spawn(http::serve(
        listeners.api,
        app,
        limits,
        tls,
        stop_http.clone(),
    )));
    if let Some((listener, bound)) = listeners.probes {
        tracing::info!(addr = %bound, "serving /health, /ready and /metrics on observability.addr");
        // Plain HTTP: kubelet probes and scrapes inside the cluster.
        tasks.push(tokio::spawn(http::serve(
            listener,
            probe_app,
            limits,
            None,
            stop_http.clone(),
        )));
    }
    tasks
}

/// Step of the start: spawns the job runner, the webhook sender, the state watch and the reaper.
fn spawn_workers(
    runner: &Arc<Runner>,
    state: Arc<StateGuard>,
    store: Store,
    storage: Storage,
    webhook_sender: Arc<webhooks::Sender>,
    reaper_interval: Duration,
    stop_reaper: &CancellationToken,
) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    tasks.push(tokio::spawn(runner.clone().run()));
    tasks.push(tokio::spawn(webhooks::run(
        store.clone(),
        webhook_sender,
        stop_reaper.clone(),
    )));
    {
        let (runner, stop) = (runner.clone(), stop_reaper.clone());
        tasks.push(tokio::spawn(async move {
            state.watch(stop, || runner.wake.notify_waiters()).await
        }));
    }
    tasks.push(tokio::spawn(reaper::run(
        store,
        storage,
        reaper_interval,
        stop_reaper.clone(),
    )));
    tasks
}

impl Service {
    /// Connects to Redis and storage, binds the listen address, resumes this replica's jobs and
    /// starts serving.
    pub async fn start(
        config: ProcessorConfig,
        options: ServiceOptions,
    ) -> Result<Self, ServiceError> {
        let serve = config.serve.clone();
        let listen = options.listen.unwrap_or(serve.listen);
        let probes_addr = config.observability.addr;
        check_access(&serve, listen)?;
        let backends = open_backends(&config, options.metrics).await?;
        let (storage, store) = (backends.storage, backends.store);
        let work_dir: PathBuf = config.work_dir.clone();
        let executor = Arc::new(Executor::new(config).await?);
        let replica = options
            .replica_id
            .unwrap_or_else(|| serve.replica_id.clone());
        let state = Arc::new(StateGuard::new(store.clone(), storage.clone(), &replica));
        let stop_reaper = CancellationToken::new();
        // Before any job is taken: an empty Redis over a storage holding batches is rebuilt.
        let rebuilt = state.ensure(options.rebuild_state, &stop_reaper).await?;
        let runner = Runner::new(
            state.clone(),
            store.clone(),
            storage.clone(),
            executor.clone(),
            runner_config(&serve, replica.clone(), work_dir),
        );
        let listeners = Listeners::bind(listen, probes_addr)?;
        let (addr, probes_addr) = (listeners.addr, listeners.probes_addr());
        let mut tasks = Vec::new();
        let tls = tls_acceptor(&serve, &stop_reaper, &mut tasks)?;
        let webhook_sender =
            Arc::new(webhooks::Sender::new(serve.webhooks.clone()).map_err(ServiceError::Config)?);
        let hooks = Arc::new(ServiceHooks {
            runner: runner.clone(),
            store: store.clone(),
            metrics: backends.metrics,
            webhooks: webhook_sender.clone(),
            state: state.clone(),
        });
        let api = build_api(&serve, &store, &storage, &executor, hooks)?;
        let stop_http = CancellationToken::new();
        tasks.extend(serve_http(listeners, api, tls, &serve, &stop_http));
        tasks.extend(spawn_workers(
            &runner,
            state,
            store,
            storage,
            webhook_sender,
            serve.reaper_interval,
            &stop_reaper,
        ));
        tracing::info!(%addr, replica, max_active_jobs = serve.max_active_jobs, "service started");
        Ok(Self {
            addr,
            https: serve.tls.is_some(),
            probes_addr,
            runner,
            executor,
            stop_http,
            stop_reaper,
            tasks,
            rebuilt,
        })
    }

    /// What the rebuild at start found, when this replica rebuilt the state from storage.
    pub fn rebuild_report(&self) -> Option<&batch_state::RebuildReport> {
        self.rebuilt.as_ref()
    }

    /// The address the API listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether the API speaks HTTPS (`serve.tls`).
    pub fn https(&self) -> bool {
        self.https
    }

    /// The address `/health`, `/ready` and `/metrics` are also served on
    /// (`observability.addr`), if set.
    pub fn probes_addr(&self) -> Option<SocketAddr> {
        self.probes_addr
    }

    /// Stops taking requests and jobs, pauses running jobs (they resume at the next start) and
    /// lets go of Redis: within 7 s (`PAUSE_PATIENCE`) plus a few seconds.
    pub async fn shutdown(self) {
        tracing::info!(
            jobs = self.runner.active_jobs(),
            "stopping: running jobs pause and resume at the next start"
        );
        self.stop_http.cancel();
        self.stop_reaper.cancel();
        self.runner.stop.cancel();
        self.executor.pause();
        self.runner.tasks.close();
        if tokio::time::timeout(PAUSE_PATIENCE, self.runner.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!("some jobs did not pause in time; they resume at the next start");
        }
        self.executor.shutdown().await;
        for task in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
        }
        tracing::info!("stopped");
    }
}

struct ServiceHooks {
    runner: Arc<Runner>,
    store: Store,
    metrics: Option<batch_observability::MetricsHandle>,
    webhooks: Arc<webhooks::Sender>,
    state: Arc<StateGuard>,
}

impl Hooks for ServiceHooks {
    fn test_webhook<'a>(
        &'a self,
        endpoint: &'a batch_state::WebhookEndpoint,
        secret: &'a str,
        event_type: &'a str,
    ) -> BoxFuture<'a, Option<u16>> {
        Box::pin(self.webhooks.test(endpoint, secret, event_type))
    }

    fn not_ready(&self) -> Option<String> {
        self.state.not_ready()
    }

    fn wake(&self) {
        self.runner.wake.notify_waiters();
        self.runner.preempt_wake.notify_one();
    }

    fn lines_so_far<'a>(
        &'a self,
        batch_id: &'a str,
        file: &'a str,
    ) -> BoxFuture<'a, Result<Option<LineStream>, ApiError>> {
        Box::pin(self.runner.lines_so_far(batch_id, file))
    }

    fn render_metrics(&self) -> BoxFuture<'_, String> {
        Box::pin(async move {
            // A scrape does not wait out a reconnection: the gauges keep their last values.
            if self.store.is_connected() {
                let read = async { (self.store.status_counts().await, self.store.queued().await) };
                match tokio::time::timeout(SCRAPE_REDIS_TIMEOUT, read).await {
                    Ok((counts, queued)) => {
                        match counts {
                            Ok(counts) => {
                                for (status, n) in counts {
                                    metrics::gauge!("batch_service_jobs", "status" => status)
                                        .set(n as f64);
                                }
                            }
                            Err(e) => tracing::debug!(error = %e, "no job counts for /metrics"),
                        }
                        if let Ok(n) = queued {
                            metrics::gauge!("batch_service_queued_jobs").set(n as f64);
                        }
                    }
                    Err(_) => tracing::debug!("no job counts for /metrics: Redis is slow"),
                }
            }
            metrics::gauge!("batch_service_active_jobs").set(self.runner.active_jobs() as f64);
            self.metrics
                .as_ref()
                .map(|m| m.render())
                .unwrap_or_default()
        })
    }
}
