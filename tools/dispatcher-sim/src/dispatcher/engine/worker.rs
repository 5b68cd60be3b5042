//! A worker's part: the checks just before sending, the HTTP exchange, and what becomes of
//! the response (a result, or a retry through the retry sorted set).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use fred::prelude::{ListInterface, SortedSetsInterface};
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Request, Uri};
use rand::Rng;
use tokio::sync::OwnedSemaphorePermit;

use super::{non_empty, normalize_path, Queue, Shared, Taken};
use crate::dispatcher::backoff;
use crate::dispatcher::config::DispatcherVersion;
use crate::dispatcher::stats::Counters;
use crate::dispatcher::wire::{codes, Envelope, ResultMessage};
use crate::http::error_chain;

impl Shared {
    /// Sends one message and turns the response into a result or a retry.
    pub(super) async fn work(
        self: Arc<Self>,
        q: Arc<Queue>,
        taken: Taken,
        _permit: OwnedSemaphorePermit,
    ) {
        if self.is_cancelled(&taken.env).await {
            self.deliver_cancelled(&q, taken);
            return;
        }
        // The worker's own check: a deadline that passed while the message waited for a
        // worker gets a result, in v0.9 too (only the dequeue side drops silently).
        if super::expired(taken.env.data.deadline) {
            let id = taken.env.data.id.clone();
            let result = ResultMessage::failed(&id, codes::DEADLINE_EXCEEDED, "deadline exceeded");
            self.deliver(&q, taken, result);
            return;
        }
        let env = &taken.env;
        let path = env
            .data
            .endpoint
            .as_deref()
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(normalize_path)
            .unwrap_or_else(|| q.path.clone());
        let request = match build_request(&q, env, &path) {
            Ok(r) => r,
            Err(why) => {
                let result = ResultMessage::failed(&env.data.id, codes::INVALID_REQUEST, &why);
                self.deliver(&q, taken, result);
                return;
            }
        };
        Counters::bump(&self.counters.dispatched);
        match self.send(request).await {
            Err(why) => {
                let result = ResultMessage::failed(&env.data.id, codes::INFERENCE_ERROR, &why);
                self.deliver(&q, taken, result);
            }
            Ok((status, retry_after, body)) if status == 429 || status >= 500 => {
                self.retry_or_finish(&q, taken, status, retry_after, body)
                    .await
            }
            Ok((status, _, body)) => {
                let result = ResultMessage::http(&env.data.id, status, body);
                self.deliver(&q, taken, result);
            }
        }
    }

    /// The gate refused the message: back into the queue at its bare deadline score (below
    /// any fractional score of its job), re-serialised as Go does (so the member's bytes differ
    /// from what the producer wrote: `queue_id` and `request_queue_name` are filled in and the
    /// payload is re-encoded).
    pub(super) async fn refuse(&self, q: &Queue, taken: Taken) {
        let Taken {
            mut env,
            claim,
            release,
        } = taken;
        drop(release);
        mark_queue(&mut env, q);
        let member = env.to_member();
        let score = env.score();
        let added = self
            .redis_write("ZADD (gate refusal)", || {
                self.redis.zadd::<i64, _, _>(
                    q.name.as_str(),
                    None,
                    None,
                    false,
                    false,
                    (score, member.as_str()),
                )
            })
            .await;
        if added.is_some() {
            Counters::bump(&self.counters.gate_refused);
            tracing::debug!(queue = %q.name, id = %env.data.id, "gate closed; message put back");
        }
        if let Some(claim) = claim {
            self.release(&claim).await;
        }
    }

    async fn send(
        &self,
        request: Request<Full<Bytes>>,
    ) -> Result<(u16, Option<Duration>, String), String> {
        let exchange = async {
            let resp = self
                .http
                .request(request)
                .await
                .map_err(|e| format!("request failed: {}", error_chain(&e)))?;
            let status = resp.status().as_u16();
            let retry_after = resp
                .headers()
                .get(RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| backoff::parse_retry_after(v, SystemTime::now()));
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("reading the response failed: {}", error_chain(&e)))?
                .to_bytes();
            Ok((
                status,
                retry_after,
                String::from_utf8_lossy(&body).into_owned(),
            ))
        };
        match tokio::time::timeout(self.request_timeout, exchange).await {
            Ok(outcome) => outcome,
            Err(_) => Err(format!(
                "request timed out after {}",
                humantime::format_duration(self.request_timeout)
            )),
        }
    }

    /// 429/5xx: schedule a retry, unless its wait reaches the deadline, in which case the last
    /// response is the result. v0.9.0 puts the retry back into its request queue at
    /// now + backoff (far below every deadline score, so it is taken again at once: the
    /// backoff is not enforced); v0.10 (main after #390) puts it into the retry set at that
    /// score, and the mover brings it back to the request queue when due.
    async fn retry_or_finish(
        self: &Arc<Self>,
        q: &Queue,
        mut taken: Taken,
        status: u16,
        retry_after: Option<Duration>,
        body: String,
    ) {
        let env = &mut taken.env;
        let attempt = env.internal.retry_count.unwrap_or(0);
        let wait = {
            let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
            backoff::delay(attempt, retry_after, &mut *rng)
        };
        let wait = wait.as_secs_f64() * self.sim.time_scale;
        // As the real worker: seconds to the deadline counted from whole seconds now, and a
        // wait that reaches them ends the request.
        let now = super::now_secs();
        let due = now as f64 + wait;
        if !due.is_finite() || wait >= (env.data.deadline - now) as f64 {
            let result = ResultMessage::http(&env.data.id, status, body);
            self.deliver(q, taken, result);
            return;
        }
        env.internal.retry_count = Some(attempt.saturating_add(1));
        mark_queue(env, q);
        let member = env.to_member();
        let target = match self.version {
            DispatcherVersion::V0_9 => non_empty(&env.internal.request_queue_name)
                .unwrap_or(q.name.as_str())
                .to_owned(),
            DispatcherVersion::V0_10 => self.retry_queue.clone(),
        };
        let added = self
            .redis_write("ZADD (retry)", || {
                self.redis.zadd::<i64, _, _>(
                    target.as_str(),
                    None,
                    None,
                    false,
                    false,
                    (due, member.as_str()),
                )
            })
            .await;
        if added.is_some() {
            Counters::bump(&self.counters.retried);
            tracing::debug!(id = %env.data.id, status, retry_count = attempt + 1, wait_secs = wait, "retry scheduled");
        }
        drop(taken.release.take());
        if let Some(claim) = &taken.claim {
            self.release(claim).await;
        }
    }

    /// Writes a result in the background: routed, maybe delayed, maybe duplicated. In v0.10 it
    /// carries the request token, is written only while the claim is still ours, and the claim
    /// is released once it is.
    pub(super) fn deliver(self: &Arc<Self>, q: &Queue, taken: Taken, mut result: ResultMessage) {
        let Taken {
            env,
            claim,
            release,
        } = taken;
        if self.version == DispatcherVersion::V0_10 {
            result.request_token = env.token().map(str::to_owned);
        }
        // The real one looks the entry up by the member's own `internal.queue_id` when it has
        // one (else by the queue it was taken from): an id naming no entry skips the entries'
        // `result_queue_name` altogether.
        let entry_list = match non_empty(&env.internal.queue_id) {
            Some(id) => self
                .queues
                .iter()
                .find(|e| e.id == id)
                .and_then(|e| e.result_queue.clone()),
            None => q.result_queue.clone(),
        };
        let list = entry_list
            .or_else(|| non_empty(&env.internal.result_queue_name).map(str::to_owned))
            .unwrap_or_else(|| self.default_result_queue.clone());
        let copies = if self.sim.duplicate_rate > 0.0
            && self
                .rng
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .random::<f64>()
                < self.sim.duplicate_rate
        {
            2
        } else {
            1
        };
        let outcome = result.outcome();
        let json = result.to_json();
        let delay = self.sim.result_delay;
        let this = self.clone();
        self.workers.spawn(self.guarded(async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            if let Some(claim) = &claim {
                if !this.still_ours(claim).await {
                    this.forget(claim);
                    Counters::bump(&this.counters.claims_lost);
                    tracing::warn!(queue = %claim.keys.queue, "result dropped: the claim was reclaimed, the request will be answered again");
                    return;
                }
            }
            let values = vec![json; copies];
            let pushed = this
                .redis_write("LPUSH (result)", || {
                    this.redis.lpush::<i64, _, _>(list.as_str(), values.clone())
                })
                .await;
            // The gate's slot is freed once the result is written, as the real one does.
            drop(release);
            if pushed.is_some() {
                this.counters.result(&outcome);
                if copies == 2 {
                    Counters::bump(&this.counters.duplicated);
                }
                this.clear_request_state(&env).await;
            }
            if let Some(claim) = &claim {
                this.release(claim).await;
            }
        }));
    }
}

/// Records which queue a re-added member belongs to: the real poller fills `queue_id` and
/// `request_queue_name` only where the member had none.
fn mark_queue(env: &mut Envelope, q: &Queue) {
    if non_empty(&env.internal.queue_id).is_none() {
        env.internal.queue_id = Some(q.id.clone());
    }
    if non_empty(&env.internal.request_queue_name).is_none() {
        env.internal.request_queue_name = Some(q.name.clone());
    }
}

fn build_request(q: &Queue, env: &Envelope, path: &str) -> Result<Request<Full<Bytes>>, String> {
    let url = format!("{}{}", q.base_url, path);
    let uri: Uri = url
        .parse()
        .map_err(|e| format!("invalid request URL {url:?}: {e}"))?;
    // Not the producer's bytes: the real one decodes the payload and encodes it again.
    let payload = env
        .go_payload()
        .ok_or_else(|| "the payload cannot be decoded".to_owned())?;
    let body = Full::new(Bytes::from(payload));
    let mut request = Request::post(uri)
        .body(body)
        .map_err(|e| format!("cannot build the request: {e}"))?;
    let headers = request.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(objective) = &q.objective {
        let value = HeaderValue::from_str(objective)
            .map_err(|_| format!("invalid inference objective {objective:?}"))?;
        headers.insert(
            HeaderName::from_static("x-gateway-inference-objective"),
            value,
        );
    }
    for (name, value) in &env.data.headers {
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("invalid header name {name:?}"))?;
        let value =
            HeaderValue::from_str(value).map_err(|_| format!("invalid value for header {name}"))?;
        headers.insert(name, value);
    }
    Ok(request)
}
