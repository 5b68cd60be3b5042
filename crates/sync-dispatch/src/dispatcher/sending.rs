//! One endpoint's side of a request: preparing it, sending it with retries, and feeding what
//! each answer says back to the limiter.

use std::ops::ControlFlow;

use super::*;
use batch_http_client::error_chain;

/// A request checked and turned into its URI and fixed headers, before any permit is taken.
pub(super) struct Prepared {
    uri: Uri,
    headers: HeaderMap,
}

impl Endpoint {
    pub(super) fn prepare(&self, request: &SyncRequest<'_>) -> Result<Prepared, String> {
        if !request.path.starts_with('/') {
            return Err(format!("url {:?} must start with '/'", request.path));
        }
        let uri: Uri = format!("{}{}", self.base_url, request.path)
            .parse()
            .map_err(|e| format!("url {:?}: {e}", request.path))?;

        let mut headers = HeaderMap::new();
        for (name, value) in request.headers {
            let name = HeaderName::try_from(name.as_str())
                .map_err(|_| format!("header name {name:?} is not valid"))?;
            if TRANSPORT_HEADERS.contains(&name.as_str()) {
                continue;
            }
            let value = HeaderValue::try_from(value.as_str())
                .map_err(|_| format!("header {name}: the value is not valid"))?;
            headers.append(name, value);
        }
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let id = HeaderValue::try_from(request.id)
            .map_err(|_| format!("request id {:?} is not a valid header value", request.id))?;
        headers.insert(REQUEST_ID_HEADER, id);
        for (name, value) in &self.own_headers {
            headers.insert(name, value.clone());
        }
        Ok(Prepared { uri, headers })
    }

    pub(super) async fn send_with_retries(
        &self,
        prepared: &Prepared,
        request: &SyncRequest<'_>,
        permits: &mut Permits<'_>,
    ) -> (SyncOutcome, Feedback) {
        let mut capacity_retry = false;
        let mut retry = 0u32;
        loop {
            if let Err(outcome) = permits.take(self).await {
                return (outcome, Feedback::Silent);
            }
            let Some(slo_left) = time_left(request.slo_deadline) else {
                return (
                    expired("the SLO deadline passed before the request was sent"),
                    Feedback::Silent,
                );
            };
            let judged = match self.observed_attempt(prepared, request, slo_left).await {
                Ok(answer) => self.judge_answer(answer, request, retry, &mut capacity_retry),
                Err(failure) => self.judge_failure(&failure, request, retry),
            };
            let (cause, retry_after) = match judged {
                ControlFlow::Break(done) => return done,
                ControlFlow::Continue(again) => again,
            };
            self.wait_to_retry(request, permits, retry, cause, retry_after)
                .await;
            retry += 1;
        }
    }

    /// One attempt, its answer fed to a per-attempt limiter.
    async fn observed_attempt(
        &self,
        prepared: &Prepared,
        request: &SyncRequest<'_>,
        slo_left: Duration,
    ) -> Result<Answer, NoAnswer> {
        let epoch = self.epoch();
        let (attempt_guard, in_flight) = AttemptGuard::enter(&self.attempts);
        let sent = Instant::now();
        let answer = self.attempt(prepared, &request.body, slo_left).await;
        // Requests sent after this one may have reached the gateway before it: the count
        // when the answer came is the better measure of what a refusal met.
        let in_flight_at_answer = attempt_guard.leave();
        if self.per_attempt {
            if let Ok(answer) = &answer {
                let seen = (in_flight, in_flight_at_answer);
                let tokens = completion_tokens(&answer.body);
                self.observe(answer.status, sent.elapsed(), tokens, seen, epoch);
            }
        }
        answer
    }

    /// The request's outcome when `answer` ends it, else why and after how long to retry;
    /// notes in `capacity_retry` that a retry was for the gateway's capacity.
    fn judge_answer(
        &self,
        answer: Answer,
        request: &SyncRequest<'_>,
        retry: u32,
        capacity_retry: &mut bool,
    ) -> ControlFlow<(SyncOutcome, Feedback), (RetryCause, Option<Duration>)> {
        let status = answer.status;
        if (status == 429 || status == 503) && ttl_expired(&answer.headers) {
            tracing::debug!(endpoint = %self.name, id = request.id, status, "gateway dropped the request: TTL expired");
            let message =
                format!("the inference gateway dropped the request ({status}, {TTL_EXPIRED})");
            return ControlFlow::Break((
                expired(&message),
                final_feedback(status, *capacity_retry),
            ));
        }
        if !retry::is_retryable_status(status) || retry >= self.max_retries {
            let feedback = final_feedback(status, *capacity_retry);
            return ControlFlow::Break((
                SyncOutcome::Http {
                    status,
                    body: answer.body,
                },
                feedback,
            ));
        }
        *capacity_retry = true;
        let retry_after = answer
            .headers
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| retry::parse_retry_after(v, SystemTime::now()));
        ControlFlow::Continue((RetryCause::Status(status), retry_after))
    }

    /// The request's outcome when no retry is left after `failure`, else the cause to retry.
    fn judge_failure(
        &self,
        failure: &NoAnswer,
        request: &SyncRequest<'_>,
        retry: u32,
    ) -> ControlFlow<(SyncOutcome, Feedback), (RetryCause, Option<Duration>)> {
        let message = match failure {
            NoAnswer::Timeout(after) => format!("no answer within {after:?}"),
            NoAnswer::Network(error) => error.clone(),
        };
        if retry >= self.max_retries {
            tracing::warn!(endpoint = %self.name, id = request.id, attempts = retry + 1, error = %message, "inference request failed");
            let message = format!(
                "inference request failed after {} attempt(s): {message}",
                retry + 1
            );
            return ControlFlow::Break((
                SyncOutcome::failed(dispatcher_error_codes::INFERENCE_ERROR, message),
                Feedback::Silent,
            ));
        }
        tracing::debug!(endpoint = %self.name, id = request.id, error = %message, "attempt failed");
        ControlFlow::Continue((RetryCause::Network, None))
    }

    /// Sleeps the backoff before retry `retry + 1`, giving back a per-attempt permit meanwhile.
    async fn wait_to_retry(
        &self,
        request: &SyncRequest<'_>,
        permits: &mut Permits<'_>,
        retry: u32,
        cause: RetryCause,
        retry_after: Option<Duration>,
    ) {
        let delay = self
            .backoff
            .delay(retry, cause, retry_after, retry::jitter());
        tracing::debug!(endpoint = %self.name, id = request.id, ?cause, retry = retry + 1, delay_ms = delay.as_millis() as u64, "retrying");
        if self.per_attempt {
            permits.held = None;
        }
        // No point sleeping past the SLO: the next turn reports the expiry.
        let slo_left = time_left(request.slo_deadline).unwrap_or(Duration::ZERO);
        tokio::time::sleep(delay.min(slo_left)).await;
    }

    async fn attempt(
        &self,
        prepared: &Prepared,
        body: &Bytes,
        slo_left: Duration,
    ) -> Result<Answer, NoAnswer> {
        let mut request = Request::new(Full::new(body.clone()));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = prepared.uri.clone();
        *request.headers_mut() = prepared.headers.clone();
        request.headers_mut().insert(
            SLO_TTFT_HEADER,
            HeaderValue::from(slo_left.as_millis() as u64),
        );

        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| NoAnswer::Network(error_chain(&e)))?;
            let (parts, body) = response.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| {
                    NoAnswer::Network(format!("reading the response: {}", error_chain(&e)))
                })?
                .to_bytes();
            Ok(Answer {
                status: parts.status.as_u16(),
                headers: parts.headers,
                body,
            })
        };
        match tokio::time::timeout(self.request_timeout, exchange).await {
            Ok(result) => result,
            Err(_) => Err(NoAnswer::Timeout(self.request_timeout)),
        }
    }

    /// The limiter's overload epoch now, noted by each request when admitted (per attempt
    /// with a per-attempt limiter).
    pub(super) fn epoch(&self) -> u64 {
        self.limiter.as_ref().map_or(0, |limiter| {
            limiter.lock().unwrap_or_else(|p| p.into_inner()).epoch()
        })
    }

    /// Feeds one attempt's answer to a per-attempt limiter: a 2xx is a latency sample (with
    /// its output tokens and the attempts in flight when it was sent), a 429 or 5xx an
    /// overload (with the most in flight from its send to its answer); other statuses say
    /// nothing about capacity (and their quick answers must not lower the latency floor).
    fn observe(
        &self,
        status: u16,
        latency: Duration,
        tokens: Option<u64>,
        in_flight: (usize, usize),
        epoch: u64,
    ) {
        let feedback = match status {
            200..=299 => Feedback::Success,
            429 => Feedback::Overload(signals::RATE_LIMITED),
            500..=599 => Feedback::Overload(signals::SERVER_ERROR),
            _ => return,
        };
        let sample = Sample {
            latency,
            overloaded: false,
            in_flight: in_flight.0,
            in_flight_at_answer: in_flight.1,
            epoch,
            tokens,
        };
        self.apply(feedback, sample);
    }

    /// Feeds the controller and copies its limit into the semaphore under the controller's
    /// lock, so the semaphore goes through the controller's limits in order. An overload met
    /// by a request admitted before the last cut belongs to that cut's episode: the limiter
    /// decides what it still says (the reference ignores it; the gradient limiters lower the
    /// limit to a lower concurrency the same burst was refused at), and it is not counted as
    /// a decrease of its own.
    pub(super) fn feed(&self, feedback: Feedback, epoch: u64) {
        let sample = Sample {
            latency: Duration::ZERO,
            overloaded: false,
            in_flight: 0,
            in_flight_at_answer: 0,
            epoch,
            tokens: None,
        };
        self.apply(feedback, sample);
    }

    /// `sample` with `overloaded` set from `feedback`.
    fn apply(&self, feedback: Feedback, mut sample: Sample) {
        let Some(limiter) = &self.limiter else {
            return;
        };
        let mut controller: MutexGuard<'_, Box<dyn Limiter>> =
            limiter.lock().unwrap_or_else(|p| p.into_inner());
        let overloaded = match feedback {
            Feedback::Silent => return,
            Feedback::Success => false,
            Feedback::Overload(_) if controller.epoch() != sample.epoch => true,
            Feedback::Overload(signal) => {
                metrics::counter!(names::AIMD_DECREASES_TOTAL, "endpoint" => self.name.clone(), "signal" => signal)
                    .increment(1);
                true
            }
        };
        sample.overloaded = overloaded;
        let (sent_with, at_answer) = (sample.in_flight, sample.in_flight_at_answer);
        let change = controller.on_result(sample);
        if let Some(change) = change {
            if let Change::Increased { .. } = change {
                metrics::counter!(names::AIMD_INCREASES_TOTAL, "endpoint" => self.name.clone())
                    .increment(1);
            }
            tracing::debug!(
                endpoint = %self.name, ?change, overloaded, sent_with, at_answer,
                "AIMD limit moved"
            );
            if !self.load_fresh.load(Ordering::SeqCst) {
                self.semaphore.set_limit(change.new_limit());
            }
        }
        if !self.load_fresh.load(Ordering::SeqCst) {
            metrics::gauge!(names::AIMD_CONCURRENCY_LIMIT, "endpoint" => self.name.clone())
                .set(controller.limit() as f64);
        }
    }
}
