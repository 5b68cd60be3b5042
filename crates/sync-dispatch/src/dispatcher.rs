//! The process-wide dispatcher: endpoints, permits, the retry loop and AIMD feedback.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant, SystemTime};

#[cfg(doc)]
use batch_limiter::Algorithm;
use batch_limiter::{AdaptivePermit, AdaptiveSemaphore, Change, Flow, Limiter, Sample};
use batch_wire::{dispatcher_error_codes, error_codes};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Uri};
use tokio::sync::{Semaphore, SemaphorePermit};

use crate::client::{self, HttpClient};
use crate::metrics::{self as names, signals, InflightGuard};
use crate::retry::{self, Backoff, RetryCause};
use crate::{DispatchError, EndpointOptions, LimitOptions, SyncOutcome, SyncRequest, TlsOptions};

mod sending;
mod yielding;

/// Milliseconds left to the job's SLO when the attempt is sent.
const SLO_TTFT_HEADER: &str = "x-slo-ttft-ms";
const REQUEST_ID_HEADER: &str = "x-request-id";
const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
const DROPPED_REASON_HEADER: &str = "x-llm-d-request-dropped-reason";
const TTL_EXPIRED: &str = "rejected-ttl-expired";

/// Pass-through headers that describe the connection or the body, which the client owns.
const TRANSPORT_HEADERS: [&str; 8] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
];

/// Sends requests to inference gateways under the process-wide limits.
///
/// One per process, shared by every job (clone it: clones share everything). It holds ONE
/// global semaphore (`concurrency.global`), and per endpoint an [`AdaptiveSemaphore`] whose
/// limit a [`Limiter`] of the configured [`Algorithm`] moves.
///
/// Decisions:
/// - The requests waiting for an endpoint's permit are served by flow
///   ([`SyncRequest::flow`]: a job, in a group such as its tenant): the group with requests
///   waiting that had the fewest permits lately first (so groups side by side take turns, one
///   request each, and a group that arrives beside a busy one goes first until it catches up),
///   its jobs in turn within it, not first come first served: a job with a hundred requests
///   waiting
///   would otherwise take the next hundred permits before a job beside it got one, and jobs
///   side by side would run one after another whenever the limit is below what each has
///   waiting (a small pool's room under `load`, a limit cut by overload).
/// - AIMD state is per endpoint *name* (the model gateway key), even when names share a
///   `base_url`: an llm-d gateway fronts one pool per model, and a saturated pool must not
///   throttle the others. Names with the same TLS settings share one keep-alive pool.
/// - With [`Algorithm::Aimd`], the reference: both permits stay held during backoff sleeps (a
///   request waiting to retry still counts against an endpoint that is pushing back), and the
///   controller hears the final answer of each dispatch.
/// - With [`Algorithm::Gradient`] and [`Algorithm::Work`]: the limiter hears every attempt
///   (its latency and `usage.completion_tokens` when 2xx, an overload when 429/5xx, with the
///   number of attempts in flight when it was sent), and a
///   request gives both permits back while it backs off and queues for them again before
///   retrying. A 429'd request holding its permit keeps one more attempt from the gateway
///   than the limit says, and would retry past a cut the limiter just made.
#[derive(Debug, Clone)]
pub struct SyncDispatcher {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    limits: LimitOptions,
    global: Semaphore,
    endpoints: RwLock<HashMap<String, Arc<Endpoint>>>,
    clients: Mutex<HashMap<TlsOptions, HttpClient>>,
}

#[derive(Debug)]
struct Endpoint {
    name: String,
    base_url: String,
    request_timeout: Duration,
    max_retries: u32,
    backoff: Backoff,
    client: HttpClient,
    /// Authorization and objective, set after the pass-through headers so they win.
    own_headers: HeaderMap,
    semaphore: AdaptiveSemaphore,
    limiter: Option<Mutex<Box<dyn Limiter>>>,
    /// Hear every attempt and release the permits during backoff (all but the reference).
    per_attempt: bool,
    /// Attempts of this endpoint waiting for their HTTP answer.
    attempts: AtomicUsize,
    /// While true, the pool's load sets the limit and the limiter's changes are not applied.
    load_fresh: AtomicBool,
    /// The `priority` put into bodies that have none.
    priority: Option<i64>,
}

/// The permits a dispatch holds, taken again after a backoff that gave them up.
struct Permits<'a> {
    global: &'a Semaphore,
    /// The request's [`SyncRequest::flow`] at the endpoint's semaphore.
    flow: Flow<'a>,
    held: Option<(AdaptivePermit, SemaphorePermit<'a>)>,
}

/// Counts an attempt in [`Endpoint::attempts`] while alive, also when the dispatch is dropped.
struct AttemptGuard<'a>(&'a AtomicUsize);

impl<'a> AttemptGuard<'a> {
    /// Enters and returns the attempts in flight, this one included.
    fn enter(counter: &'a AtomicUsize) -> (Self, usize) {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        (Self(counter), n)
    }

    /// Leaves and returns the attempts that were in flight, this one included, in one atomic
    /// step: answers that come together (a burst's refusals) count each other once, in some
    /// order, not each all the others.
    fn leave(self) -> usize {
        let n = self.0.fetch_sub(1, Ordering::SeqCst);
        // Its count is taken off above, not again on drop.
        std::mem::forget(self);
        n
    }
}

impl Drop for AttemptGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What a finished dispatch tells the endpoint's AIMD controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Feedback {
    Success,
    Overload(&'static str),
    /// No HTTP answer (network error, timeout, expiry): no signal.
    Silent,
}

/// One attempt's HTTP answer.
struct Answer {
    status: u16,
    headers: HeaderMap,
    body: Bytes,
}

/// Why an attempt got no HTTP answer.
enum NoAnswer {
    Timeout(Duration),
    Network(String),
}

/// Options of the endpoint `name` that cannot be used.
fn invalid(name: &str, message: String) -> DispatchError {
    DispatchError::InvalidOptions {
        endpoint: name.to_owned(),
        message,
    }
}

/// `base_url` without its trailing slashes, when it is an http:// or https:// URL with a host
/// and no query.
fn checked_base_url(name: &str, base_url: &str) -> Result<String, DispatchError> {
    let base_url = base_url.trim_end_matches('/').to_owned();
    let uri: Uri = base_url
        .parse()
        .map_err(|e| invalid(name, format!("base_url {base_url:?}: {e}")))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
        return Err(invalid(
            name,
            format!("base_url {base_url:?} must be an http:// or https:// URL with a host"),
        ));
    }
    if uri.query().is_some() {
        return Err(invalid(
            name,
            format!("base_url {base_url:?} must not have a query"),
        ));
    }
    Ok(base_url)
}

/// The headers the endpoint adds to every request: its API key and inference objective.
fn own_headers(name: &str, options: &EndpointOptions) -> Result<HeaderMap, DispatchError> {
    let mut own_headers = HeaderMap::new();
    if let Some(key) = &options.api_key {
        let mut value = HeaderValue::try_from(format!("Bearer {key}")).map_err(|_| {
            invalid(
                name,
                "api_key contains characters not allowed in a header".into(),
            )
        })?;
        value.set_sensitive(true);
        own_headers.insert(header::AUTHORIZATION, value);
    }
    if let Some(objective) = &options.inference_objective {
        let value = HeaderValue::try_from(objective.as_str()).map_err(|_| {
            invalid(
                name,
                format!("inference_objective {objective:?} is not a valid header value"),
            )
        })?;
        own_headers.insert(OBJECTIVE_HEADER, value);
    }
    Ok(own_headers)
}

/// The endpoint's adaptive limiter when AIMD is on.
fn build_limiter(limits: &LimitOptions) -> Result<Option<Box<dyn Limiter>>, DispatchError> {
    if !limits.aimd_enabled {
        return Ok(None);
    }
    let limiter = limits
        .algorithm
        .build(limits.aimd_config())
        .map_err(|e| DispatchError::InvalidLimits(e.to_string()))?;
    Ok(Some(limiter))
}

impl SyncDispatcher {
    /// A dispatcher with no endpoint yet. `limits` is checked by [`add_endpoint`](Self::add_endpoint).
    pub fn new(limits: LimitOptions) -> Self {
        Self {
            inner: Arc::new(Inner {
                limits,
                global: Semaphore::new(limits.global.min(Semaphore::MAX_PERMITS)),
                endpoints: RwLock::new(HashMap::new()),
                clients: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The limits this dispatcher was built with.
    pub fn limits(&self) -> &LimitOptions {
        &self.inner.limits
    }

    /// Registers an endpoint under `name` (the model gateway key).
    ///
    /// Fails on invalid limits or options, an unreadable TLS file, or a name already taken.
    pub fn add_endpoint(&self, name: &str, options: EndpointOptions) -> Result<(), DispatchError> {
        let limits = &self.inner.limits;
        limits.validate()?;
        options.validate(name)?;
        let base_url = checked_base_url(name, &options.base_url)?;
        let own_headers = own_headers(name, &options)?;
        let client = self.client_for(&options.tls)?;
        let limiter = build_limiter(limits)?;
        let initial = limiter.as_ref().map_or(limits.per_endpoint, |l| l.limit());
        let per_attempt = limiter
            .as_ref()
            .is_some_and(|l| l.algorithm().per_attempt());
        let endpoint = Arc::new(Endpoint {
            name: name.to_owned(),
            base_url,
            request_timeout: options.request_timeout,
            max_retries: options.max_retries,
            backoff: Backoff {
                initial: options.initial_backoff,
                max: options.max_backoff,
            },
            client,
            own_headers,
            semaphore: AdaptiveSemaphore::new(initial),
            limiter: limiter.map(Mutex::new),
            per_attempt,
            attempts: AtomicUsize::new(0),
            load_fresh: AtomicBool::new(false),
            priority: options.load.as_ref().and_then(|l| l.priority),
        });
        self.register(name, endpoint, options)
    }

    /// Adds `endpoint` under a name not yet taken, with the task that follows its pool's load
    /// when `options` ask for one, and publishes its starting limit.
    fn register(
        &self,
        name: &str,
        endpoint: Arc<Endpoint>,
        options: EndpointOptions,
    ) -> Result<(), DispatchError> {
        let mut endpoints = self
            .inner
            .endpoints
            .write()
            .unwrap_or_else(|p| p.into_inner());
        if endpoints.contains_key(name) {
            return Err(DispatchError::DuplicateEndpoint(name.to_owned()));
        }
        let initial = endpoint.semaphore.limit();
        if let Some(load) = options.load {
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                return Err(invalid(
                    name,
                    "load is read by a task: add the endpoint within a Tokio runtime".into(),
                ));
            };
            let limits = self.inner.limits;
            runtime.spawn(yielding::follow(Arc::downgrade(&endpoint), load, limits));
        }
        endpoints.insert(name.to_owned(), endpoint);
        metrics::gauge!(names::AIMD_CONCURRENCY_LIMIT, "endpoint" => name.to_owned())
            .set(initial as f64);
        tracing::debug!(endpoint = name, base_url = %options.base_url, "sync endpoint added");
        Ok(())
    }

    /// The endpoint's current concurrency limit, or `None` for an unknown name.
    pub fn limit(&self, endpoint: &str) -> Option<usize> {
        self.endpoint(endpoint).map(|e| e.semaphore.limit())
    }

    /// How many times this endpoint's AIMD limit was cut (one per overload episode; 0 when AIMD
    /// is off).
    pub fn cuts(&self, endpoint: &str) -> Option<u64> {
        self.endpoint(endpoint).map(|e| e.epoch())
    }

    /// Requests of this endpoint holding its permit (waiting for the global one, or in flight).
    pub fn in_use(&self, endpoint: &str) -> Option<usize> {
        self.endpoint(endpoint).map(|e| e.semaphore.in_use())
    }

    /// Requests holding a global permit, across all endpoints.
    pub fn global_in_use(&self) -> usize {
        let limit = self.inner.limits.global.min(Semaphore::MAX_PERMITS);
        limit.saturating_sub(self.inner.global.available_permits())
    }

    /// Sends one request and returns its final outcome, after retries.
    ///
    /// Acquires the endpoint permit first (the flows waiting for it, [`SyncRequest::flow`], get it
    /// in turn), then the global one, and holds both until the final
    /// answer (with a per-attempt limiter, [`Algorithm::per_attempt`]: gives both up during each backoff and takes them
    /// again, in the same order, before the retry). Cancel-safe: dropping the future releases both permits and aborts the HTTP
    /// request (its connection is closed, not reused). Never panics on network errors.
    ///
    /// Outcomes without an HTTP answer carry these codes: `model_not_found` (unknown
    /// endpoint), `INVALID_REQUEST` (the id, path or a header cannot be sent), `batch_expired`
    /// (the SLO passed before an attempt, or the gateway dropped it with
    /// `x-llm-d-request-dropped-reason: rejected-ttl-expired`), and `INFERENCE_ERROR` (network
    /// error or timeout on the last attempt: the same code the async dispatcher writes).
    pub async fn dispatch(&self, endpoint: &str, request: SyncRequest<'_>) -> SyncOutcome {
        let never = std::future::pending();
        let sent = self.dispatch_unless(endpoint, request, never).await;
        sent.expect("a request never withdrawn is sent")
    }

    /// Like [`Dispatcher::dispatch`], but withdrawn, unsent, when `withdrawn` completes while
    /// the request still waits for the endpoint's permits: `None` then. Once sent, it is seen
    /// through to its final outcome (a job giving its slot back lets its requests in flight end,
    /// and sends no new one).
    pub async fn dispatch_unless(
        &self,
        endpoint: &str,
        request: SyncRequest<'_>,
        withdrawn: impl std::future::Future<Output = ()>,
    ) -> Option<SyncOutcome> {
        let Some(endpoint) = self.endpoint(endpoint) else {
            // The name is the input's: counted under one label, not one series per name.
            metrics::counter!(names::REQUEST_ERRORS_TOTAL, "model" => "other").increment(1);
            return Some(SyncOutcome::failed(
                error_codes::MODEL_NOT_FOUND,
                format!("no inference gateway is configured for {endpoint:?}"),
            ));
        };
        let model = endpoint.name.clone();
        let mut request = request;
        if let Some(priority) = endpoint.priority {
            request.body = crate::load::with_priority(&request.body, priority);
        }
        let prepared = match endpoint.prepare(&request) {
            Ok(prepared) => prepared,
            Err(message) => {
                metrics::counter!(names::REQUEST_ERRORS_TOTAL, "model" => model).increment(1);
                return Some(SyncOutcome::failed(
                    dispatcher_error_codes::INVALID_REQUEST,
                    message,
                ));
            }
        };

        let mut permits = Permits {
            global: &self.inner.global,
            flow: request.flow,
            held: None,
        };
        let taken = tokio::select! {
            biased;
            taken = permits.take(&endpoint) => taken,
            () = withdrawn => return None,
        };
        if let Err(outcome) = taken {
            return Some(outcome);
        }
        let _inflight = InflightGuard::enter();

        let epoch = endpoint.epoch();
        let started = Instant::now();
        let (outcome, feedback) = endpoint
            .send_with_retries(&prepared, &request, &mut permits)
            .await;
        metrics::histogram!(names::REQUEST_DURATION_SECONDS, "model" => model.clone())
            .record(started.elapsed().as_secs_f64());
        if !matches!(
            outcome,
            SyncOutcome::Http {
                status: 200..=299,
                ..
            }
        ) {
            metrics::counter!(names::REQUEST_ERRORS_TOTAL, "model" => model).increment(1);
        }
        if !endpoint.per_attempt {
            endpoint.feed(feedback, epoch);
        }
        Some(outcome)
    }

    fn endpoint(&self, name: &str) -> Option<Arc<Endpoint>> {
        let endpoints = self
            .inner
            .endpoints
            .read()
            .unwrap_or_else(|p| p.into_inner());
        endpoints.get(name).cloned()
    }

    fn client_for(&self, tls: &TlsOptions) -> Result<HttpClient, DispatchError> {
        let mut clients = self.inner.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(client) = clients.get(tls) {
            return Ok(client.clone());
        }
        let client = client::build(tls)?;
        clients.insert(tls.clone(), client.clone());
        Ok(client)
    }
}

impl Permits<'_> {
    /// Takes the endpoint permit (in its flow's turn), then the global one, unless held
    /// already.
    async fn take(&mut self, endpoint: &Endpoint) -> Result<(), SyncOutcome> {
        if self.held.is_some() {
            return Ok(());
        }
        let Ok(endpoint_permit) = endpoint.semaphore.acquire_in(self.flow).await else {
            return Err(SyncOutcome::failed(
                error_codes::BATCH_FAILED,
                "the endpoint is closed",
            ));
        };
        let Ok(global_permit) = self.global.acquire().await else {
            return Err(SyncOutcome::failed(
                error_codes::BATCH_FAILED,
                "the dispatcher is closed",
            ));
        };
        self.held = Some((endpoint_permit, global_permit));
        Ok(())
    }
}

/// The AIMD reading of a final HTTP answer.
fn final_feedback(status: u16, capacity_retry: bool) -> Feedback {
    match status {
        429 => Feedback::Overload(signals::RATE_LIMITED),
        500..=599 => Feedback::Overload(signals::SERVER_ERROR),
        _ if capacity_retry => Feedback::Overload(signals::CAPACITY_RETRY),
        _ => Feedback::Success,
    }
}

/// The answer's `usage.completion_tokens`: the number after the last `"completion_tokens"` key
/// of the body, found by a byte search from the end (where OpenAI replies put `usage`)
/// rather than a JSON parse of every answer. `None` when absent or not a whole number.
fn completion_tokens(body: &[u8]) -> Option<u64> {
    const KEY: &[u8] = b"\"completion_tokens\"";
    let at = memchr::memmem::rfind(body, KEY)? + KEY.len();
    let rest = body[at..]
        .trim_ascii_start()
        .strip_prefix(b":")?
        .trim_ascii_start();
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits > 19 {
        return None;
    }
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

/// Whole milliseconds left before `deadline`, or `None` when less than one is left.
fn time_left(deadline: SystemTime) -> Option<Duration> {
    deadline
        .duration_since(SystemTime::now())
        .ok()
        .filter(|left| left.as_millis() > 0)
}

fn ttl_expired(headers: &HeaderMap) -> bool {
    headers
        .get_all(DROPPED_REASON_HEADER)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.trim().eq_ignore_ascii_case(TTL_EXPIRED))
}

fn expired(detail: &str) -> SyncOutcome {
    SyncOutcome::failed(
        error_codes::BATCH_EXPIRED,
        format!("{} ({detail})", error_codes::BATCH_EXPIRED_MESSAGE),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_answers_map_to_aimd_signals() {
        assert_eq!(final_feedback(200, false), Feedback::Success);
        assert_eq!(final_feedback(400, false), Feedback::Success);
        assert_eq!(final_feedback(404, false), Feedback::Success);
        assert_eq!(final_feedback(429, false), Feedback::Overload("429"));
        assert_eq!(final_feedback(429, true), Feedback::Overload("429"));
        assert_eq!(final_feedback(500, false), Feedback::Overload("5xx"));
        assert_eq!(final_feedback(503, true), Feedback::Overload("5xx"));
        assert_eq!(
            final_feedback(200, true),
            Feedback::Overload("capacity_retry")
        );
        assert_eq!(
            final_feedback(400, true),
            Feedback::Overload("capacity_retry")
        );
    }

    #[test]
    fn completion_tokens_are_read_from_the_usage_of_the_answer() {
        let chat = br#"{"id":"x","choices":[{"message":{"content":"\"completion_tokens\": 9"}}],"usage":{"prompt_tokens":5,"completion_tokens":42,"total_tokens":47}}"#;
        assert_eq!(completion_tokens(chat), Some(42));
        assert_eq!(completion_tokens(b"{\"completion_tokens\" :\n 7}"), Some(7));
        for none in [
            &b"{\"usage\":{\"prompt_tokens\":5}}"[..],
            b"{\"completion_tokens\":null}",
            b"{\"completion_tokens\":-3}",
            b"{\"completion_tokens\"",
            b"",
        ] {
            assert_eq!(
                completion_tokens(none),
                None,
                "{}",
                String::from_utf8_lossy(none)
            );
        }
    }

    #[test]
    fn time_left_is_none_once_the_deadline_is_reached() {
        assert!(time_left(SystemTime::now() - Duration::from_secs(1)).is_none());
        assert!(time_left(SystemTime::now()).is_none());
        let left = time_left(SystemTime::now() + Duration::from_secs(10)).unwrap();
        assert!(left > Duration::from_secs(9) && left <= Duration::from_secs(10));
    }

    #[test]
    fn ttl_expiry_is_read_from_the_dropped_reason_header() {
        let mut headers = HeaderMap::new();
        assert!(!ttl_expired(&headers));
        headers.insert(
            DROPPED_REASON_HEADER,
            HeaderValue::from_static("rejected-saturated"),
        );
        assert!(!ttl_expired(&headers));
        headers.insert(
            DROPPED_REASON_HEADER,
            HeaderValue::from_static(" Rejected-TTL-Expired"),
        );
        assert!(ttl_expired(&headers));
    }
}
