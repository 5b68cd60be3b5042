//! Sync dispatch: the processor calls each model's gateway itself, held back by the AIMD
//! limiter, the adaptive per-endpoint semaphore and the process-wide global semaphore.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tracing::Instrument;

use batch_config::ProcessorConfig;
use batch_limiter::{AdaptiveSemaphore, Flow};
use batch_plan::Record;
use batch_redis::Backoff;
use batch_sync_dispatch::{
    EndpointOptions, LimitOptions, LoadOptions, SyncDispatcher, SyncOutcome, SyncRequest,
    TlsOptions,
};
use batch_wire::{InputLine, Outcome};
use futures::future::{self, BoxFuture};
use futures::stream::{self, BoxStream, StreamExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{blocking, Dispatch, End, ExecError, Job, JobFailure, Stop};

/// Input lines read in one blocking call, ahead of the calls that send them.
const READ_AHEAD: usize = 64;
/// Answers written with one flush, at most.
const WRITE_BATCH: usize = 256;

/// Why the sync mode could not start.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// A gateway could not be set up.
    #[error(transparent)]
    Gateway(#[from] batch_sync_dispatch::DispatchError),
}

/// The sync mode: the processor calls each model's gateway over HTTP itself, one
/// [`SyncDispatcher`] (and its limits) shared by every job of the executor.
pub struct SyncMode {
    dispatcher: SyncDispatcher,
    config: Arc<ProcessorConfig>,
    /// The calls each share (a tenant, [`crate::JobSpec::share`]) may have pending per model,
    /// given to its jobs in turn.
    shares: Mutex<HashMap<(String, String), Arc<AdaptiveSemaphore>>>,
}

impl SyncMode {
    /// The mode for `config`: one endpoint for each model with a `url`.
    pub fn new(config: Arc<ProcessorConfig>) -> Result<Self, SyncError> {
        let c = &config.concurrency;
        let dispatcher = SyncDispatcher::new(LimitOptions {
            global: c.global,
            per_endpoint: c.per_endpoint,
            aimd_enabled: c.aimd.enabled,
            aimd_min: c.aimd.min,
            backoff_factor: c.aimd.backoff_factor,
            additive_increase: c.aimd.additive_increase,
            algorithm: c.aimd.algorithm,
        });
        for (model, gw) in &config.model_gateways {
            let Some(url) = &gw.url else { continue };
            let options = EndpointOptions {
                base_url: url.clone(),
                request_timeout: gw.request_timeout,
                max_retries: gw.max_retries,
                initial_backoff: gw.initial_backoff,
                max_backoff: gw.max_backoff,
                api_key: gw.api_key.as_ref().map(|k| k.expose().to_owned()),
                inference_objective: gw.inference_objective.clone(),
                tls: TlsOptions {
                    ca_cert_file: gw.tls.ca_cert_file.clone(),
                    client_cert_file: gw.tls.client_cert_file.clone(),
                    client_key_file: gw.tls.client_key_file.clone(),
                    insecure_skip_verify: gw.tls.insecure_skip_verify,
                },
                load: gw.load.as_ref().map(|l| LoadOptions {
                    metrics_urls: l.metrics_urls.clone(),
                    prometheus_url: l.prometheus_url.clone(),
                    pool: l.pool.clone(),
                    max_running_per_pod: l.max_running_per_pod,
                    interval: l.interval,
                    headroom: l.headroom,
                    priority: l.priority,
                }),
            };
            dispatcher.add_endpoint(model, options)?;
        }
        Ok(Self {
            dispatcher,
            config,
            shares: Mutex::new(HashMap::new()),
        })
    }

    /// The current limit of `model`'s endpoint (its AIMD or gradient limiter), `None` for a
    /// model without one.
    pub fn endpoint_limit(&self, model: &str) -> Option<usize> {
        self.dispatcher.limit(model)
    }

    /// How many times the limit of `model`'s endpoint was cut, `None` for a model without one.
    pub fn endpoint_cuts(&self, model: &str) -> Option<u64> {
        self.dispatcher.cuts(model)
    }

    /// The permits `job`'s share has for `model`'s calls, `width` of them, when it names one.
    fn share_slots(&self, job: &Job, model: &str, width: usize) -> Option<Arc<AdaptiveSemaphore>> {
        let share = job.share.as_ref()?;
        let mut shares = self.shares.lock().expect("shares lock");
        // Shares no job holds any more are dropped, so the map follows the running jobs.
        shares.retain(|_, slots| Arc::strong_count(slots) > 1);
        Some(
            shares
                .entry((share.clone(), model.to_owned()))
                .or_insert_with(|| Arc::new(AdaptiveSemaphore::new(width)))
                .clone(),
        )
    }

    /// Sends every unresolved line, models side by side; the deadline, a cancel or a pause
    /// drops every call in flight at once.
    async fn run_job(&self, job: &Arc<Job>, stop: &Stop) -> End {
        if stop.halt().is_cancelled() {
            return stop.end().unwrap_or(End::Expired);
        }
        tokio::select! {
            sent = self.send_all(job, stop) => match sent {
                Err(e) => End::Failed(e.into()),
                Ok(()) if job.remaining() == 0 => End::Completed,
                Ok(()) => stop.end().unwrap_or_else(|| End::Failed(JobFailure::Unanswered(job.remaining()))),
            },
            _ = stop.halt().cancelled() => stop.end().unwrap_or(End::Expired),
        }
    }

    async fn send_all(&self, job: &Arc<Job>, stop: &Stop) -> Result<(), ExecError> {
        let headers: Vec<(String, String)> = job
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let sends = Sends {
            job,
            slo: UNIX_EPOCH + Duration::from_secs(job.expires_at().max(0) as u64),
            headers: &headers,
            drain: stop.drain().clone(),
        };
        // Answers go to one writer, which writes whatever has come in one blocking call and one
        // flush, instead of a thread hand-off and a write per answer.
        let (answers, mut written) = mpsc::channel::<(u64, Owned)>(
            self.config.concurrency.per_endpoint.max(1) + WRITE_BATCH,
        );
        let mut per_model = Vec::new();
        for model in job.plan.models() {
            if !self.config.model_gateways.contains_key(&model.model) {
                continue;
            }
            let records = {
                let (j, model) = (job.clone(), model.clone());
                blocking(move || j.unresolved_records(&model)).await?
            };
            job.dispatched(records.len() as u64);
            per_model.push(self.model_calls(&sends, &model.model, records, answers.clone()));
        }
        drop(answers);
        let send = async move {
            let mut all = stream::select_all(per_model);
            while let Some(done) = all.next().await {
                done?;
            }
            Ok(())
        };
        let write = async {
            let mut batch = Vec::with_capacity(WRITE_BATCH);
            while written.recv_many(&mut batch, WRITE_BATCH).await > 0 {
                write_outcomes(job, std::mem::take(&mut batch), stop).await;
            }
        };
        let (sent, ()) = tokio::join!(send, write);
        sent
    }

    /// The most calls `model`'s endpoint may let through: its limiter's bound, or the global
    /// limit when the pool's load sets it. Each job may have that many waiting at the
    /// endpoint: the jobs waiting there are served in turn (`SyncRequest::flow`), so a small
    /// limit is still shared among them.
    fn endpoint_width(&self, model: &str) -> usize {
        let concurrency = &self.config.concurrency;
        match self.config.model_gateways.get(model) {
            Some(gw) if gw.load.is_some() => concurrency.global,
            _ => concurrency.per_endpoint,
        }
        .max(1)
    }

    /// `model`'s unresolved `records`, read ahead in blocks and sent as many at a time as its
    /// endpoint may take, each outcome handed to `answers`; a yield takes no new line, and the
    /// calls in flight end and are written.
    fn model_calls<'a>(
        &'a self,
        sends: &Sends<'a>,
        model: &'a str,
        records: Vec<Record>,
        answers: mpsc::Sender<(u64, Owned)>,
    ) -> BoxStream<'a, Result<(), ExecError>> {
        let width = self.endpoint_width(model);
        let share = self.share_slots(sends.job, model, width);
        let sends = sends.clone();
        let job = sends.job;
        stream::iter(records)
            .take_until(sends.drain.clone().cancelled_owned())
            .chunks(READ_AHEAD)
            .then(move |chunk| {
                let j = job.clone();
                blocking(move || j.read_lines(chunk))
            })
            .flat_map(|read| match read {
                Ok(lines) => stream::iter(lines.into_iter().map(Ok)).left_stream(),
                Err(e) => stream::once(future::ready(Err(e))).right_stream(),
            })
            .map(move |read| {
                let (answers, share, sends) = (answers.clone(), share.clone(), sends.clone());
                async move {
                    let (record, line) = read?;
                    self.send_line(&sends, model, record.line as u64, &line, share, answers)
                        .await;
                    Ok::<_, ExecError>(())
                }
            })
            .buffer_unordered(width)
            .boxed()
    }

    /// Sends line `index` of the job once its share lets it, and hands the outcome to
    /// `answers`; a line a yield withdraws before it is sent is left for the next run.
    async fn send_line(
        &self,
        sends: &Sends<'_>,
        model: &str,
        index: u64,
        line: &[u8],
        share: Option<Arc<AdaptiveSemaphore>>,
        answers: mpsc::Sender<(u64, Owned)>,
    ) {
        let job = sends.job;
        // Never closed: a permit always comes, unless a yield leaves the line (read ahead,
        // not sent) for the next run. The share's jobs take turns, as the shares do at the
        // endpoint.
        let _share = match &share {
            Some(slots) => tokio::select! {
                permit = slots.acquire_in(Flow::alone(&job.id)) => permit.ok(),
                () = sends.drain.cancelled() => return,
            },
            None => None,
        };
        if sends.drain.is_cancelled() {
            return;
        }
        let call = self.call(model, index, line, sends.slo, sends.headers, job);
        // Withdrawn unsent by a yield: left for the next run.
        let Some(outcome) = call.await else {
            return;
        };
        // Closed only when the job stops writing: the answer is not kept.
        let _ = answers.send((index, outcome)).await;
    }

    async fn call(
        &self,
        model: &str,
        index: u64,
        line: &[u8],
        slo: SystemTime,
        headers: &[(String, String)],
        job: &Job,
    ) -> Option<Owned> {
        let input: InputLine = match serde_json::from_slice(line) {
            Ok(input) => input,
            Err(e) => {
                return Some(Owned::Failed(
                    batch_wire::error_codes::BATCH_FAILED.into(),
                    e.to_string(),
                ))
            }
        };
        let id = batch_wire::request_id(&job.id, index);
        // Never closed: a permit always comes.
        let _slot = match &job.request_slots {
            Some(slots) => slots.clone().acquire_owned().await.ok(),
            None => None,
        };
        let span = request_span(index, model);
        let own_headers: Vec<(String, String)>;
        let headers = match batch_observability::traceparent(&span) {
            Some(traceparent) => {
                own_headers = with_traceparent(headers, traceparent);
                &own_headers[..]
            }
            None => headers,
        };
        job.inflight.add(model, 1);
        // A yield withdraws the request while it waits for the endpoint's limit, unsent.
        let withdrawn = job.yielding.cancelled();
        let outcome = self
            .dispatcher
            .dispatch_unless(
                model,
                SyncRequest {
                    id: &id,
                    path: &input.url,
                    body: bytes::Bytes::copy_from_slice(input.body.get().as_bytes()),
                    slo_deadline: slo,
                    headers,
                    // Jobs side by side get the endpoint's limit in turn; the jobs of a share
                    // (a tenant's) take one turn together, in turn among themselves.
                    flow: Flow {
                        group: job.share.as_deref().unwrap_or(&job.id),
                        name: &job.id,
                    },
                },
                withdrawn,
            )
            .instrument(span.clone())
            .await;
        job.inflight.remove(model, 1);
        let outcome = outcome?;
        if let SyncOutcome::Http { status, .. } = &outcome {
            span.record("status", status);
        }
        Some(match outcome {
            SyncOutcome::Http { status, body } => Owned::Http(status, body),
            SyncOutcome::Failed { code, message } => Owned::Failed(code, message),
        })
    }
}

/// One request in this many of a batch (by line index, from the first) gets a span in sync
/// mode: enough to see the gateway's time in the trace without a span per line.
const REQUEST_SPAN_EVERY: u64 = 100;

/// What every line of one job's run is sent with.
#[derive(Clone)]
struct Sends<'a> {
    job: &'a Arc<Job>,
    /// The job's deadline, sent as each request's SLO.
    slo: SystemTime,
    /// The job's headers, sent with each request.
    headers: &'a [(String, String)],
    /// Cancelled by a yield: no new line is taken.
    drain: CancellationToken,
}

/// Line `index`'s span: one of its own for a sample of the requests (the gateway then sees it
/// as the request's parent), none for the others, which carry the batch's.
fn request_span(index: u64, model: &str) -> tracing::Span {
    match index % REQUEST_SPAN_EVERY {
        0 => tracing::info_span!(
            "inference",
            line = index,
            model,
            status = tracing::field::Empty
        ),
        _ => tracing::Span::none(),
    }
}

/// `headers` with `traceparent` in place of any the job sent.
fn with_traceparent(headers: &[(String, String)], traceparent: String) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(name, _)| name != batch_observability::TRACEPARENT)
        .cloned()
        .chain([(batch_observability::TRACEPARENT.to_owned(), traceparent)])
        .collect()
}

/// Writes answers, retrying a failed write (a full disk) until it succeeds or the job stops.
async fn write_outcomes(job: &Arc<Job>, outcomes: Vec<(u64, Owned)>, stop: &Stop) {
    let outcomes = Arc::new(outcomes);
    let mut backoff = Backoff::default();
    loop {
        let (j, o) = (job.clone(), outcomes.clone());
        let write = move || j.record_all(o.iter().map(|(index, o)| (*index, o.as_outcome())));
        match blocking(write).await {
            Ok(()) => return,
            Err(e) => {
                tracing::error!(job = %job.id, error = %e, "could not write answers; retrying");
                if !backoff.wait(stop.halt()).await {
                    return;
                }
            }
        }
    }
}

impl Dispatch for SyncMode {
    fn run<'a>(&'a self, job: &'a Arc<Job>, stop: &'a Stop) -> BoxFuture<'a, End> {
        Box::pin(self.run_job(job, stop))
    }

    /// A yield lets the calls in flight end: each line is sent once across the two runs.
    fn drains(&self) -> bool {
        true
    }
}

/// A call's outcome, owning its body.
enum Owned {
    Http(u16, bytes::Bytes),
    Failed(String, String),
}

impl Owned {
    fn as_outcome(&self) -> Outcome<'_> {
        match self {
            Owned::Http(status, body) => Outcome::Http {
                status: *status,
                body: std::str::from_utf8(body).unwrap_or("<the response body is not UTF-8>"),
            },
            Owned::Failed(code, message) => Outcome::Failed { code, message },
        }
    }
}
