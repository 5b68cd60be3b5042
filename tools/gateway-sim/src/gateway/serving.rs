//! What the gateway does with one request: routing, admission, the answer's timing and its
//! injected failures.

use super::*;

fn openai_error(
    status: StatusCode,
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Resp {
    http::json(status, reply::error(message, kind, param, code))
}

pub(super) async fn handle(state: Arc<GatewayState>, req: Request<Incoming>) -> Reply {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    match (method, path.as_str()) {
        (Method::GET, "/health") => {
            Reply::Response(http::response(StatusCode::OK, "text/plain", "ok\n"))
        }
        (Method::GET, "/metrics") => Reply::Response(http::response(
            StatusCode::OK,
            "text/plain; version=0.0.4",
            state.metrics_page(),
        )),
        (Method::GET, "/admin/config") => Reply::Response(http::json(
            StatusCode::OK,
            serde_json::to_string(&state.active().config).unwrap_or_default(),
        )),
        (Method::POST, "/admin/config") => Reply::Response(admin_set_config(&state, req).await),
        (Method::GET, "/admin/stats") => Reply::Response(http::json(
            StatusCode::OK,
            serde_json::to_string(&state.stats()).unwrap_or_default(),
        )),
        (Method::GET, "/admin/requests") => {
            let recent: Vec<SeenRequest> = lock(&state.recent).iter().cloned().collect();
            Reply::Response(http::json(
                StatusCode::OK,
                serde_json::to_string(&recent).unwrap_or_default(),
            ))
        }
        (Method::POST, p) => match Endpoint::from_path(p) {
            Some(endpoint) => infer(state, endpoint, req).await,
            None => Reply::Response(openai_error(
                StatusCode::NOT_FOUND,
                &format!("unknown endpoint {p}"),
                "invalid_request_error",
                None,
                Some("unknown_url"),
            )),
        },
        (m, p) => {
            let known = Endpoint::from_path(p).is_some()
                || matches!(
                    p,
                    "/health" | "/metrics" | "/admin/config" | "/admin/stats" | "/admin/requests"
                );
            let status = if known {
                StatusCode::METHOD_NOT_ALLOWED
            } else {
                StatusCode::NOT_FOUND
            };
            Reply::Response(openai_error(
                status,
                &format!("{m} {p} is not served"),
                "invalid_request_error",
                None,
                None,
            ))
        }
    }
}

async fn admin_set_config(state: &GatewayState, req: Request<Incoming>) -> Resp {
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return openai_error(
                StatusCode::BAD_REQUEST,
                &e.to_string(),
                "invalid_request_error",
                None,
                None,
            )
        }
    };
    let config = match serde_json::from_slice::<GatewayConfig>(&body) {
        Ok(c) => c,
        Err(e) => {
            return openai_error(
                StatusCode::BAD_REQUEST,
                &format!("invalid gateway config: {e}"),
                "invalid_request_error",
                None,
                None,
            )
        }
    };
    match state.set_config(config) {
        Ok(()) => http::json(
            StatusCode::OK,
            serde_json::to_string(&state.active().config).unwrap_or_default(),
        ),
        Err(e) => openai_error(
            StatusCode::BAD_REQUEST,
            &e.to_string(),
            "invalid_request_error",
            None,
            None,
        ),
    }
}

async fn infer(state: Arc<GatewayState>, endpoint: Endpoint, req: Request<Incoming>) -> Reply {
    state.total.fetch_add(1, Ordering::SeqCst);
    let (parts, body) = req.into_parts();
    state.waiting.fetch_add(1, Ordering::SeqCst);
    let body = body.collect().await;
    state.waiting.fetch_sub(1, Ordering::SeqCst);
    let body: Bytes = match body {
        Ok(b) => b.to_bytes(),
        // The client went away mid-body; there is nobody to answer.
        Err(_) => return Reply::Reset,
    };

    let mut headers = BTreeMap::<String, String>::new();
    for (name, value) in &parts.headers {
        let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
        headers
            .entry(name.as_str().to_owned())
            .and_modify(|v| {
                v.push_str(", ");
                v.push_str(&value);
            })
            .or_insert(value);
    }
    let digest = batch_wire::hash::body_digest(&body);
    state.record(SeenRequest {
        method: parts.method.to_string(),
        path: parts.uri.path().to_owned(),
        headers,
        body_digest: digest.clone(),
        body_len: body.len(),
        received_unix_ms: unix_ms(),
    });

    let request: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return state.count(openai_error(
                StatusCode::BAD_REQUEST,
                &format!("malformed JSON body: {e}"),
                "invalid_request_error",
                None,
                Some("invalid_json"),
            ))
        }
    };
    let Some(request) = request.as_object() else {
        return state.count(openai_error(
            StatusCode::BAD_REQUEST,
            "the request body must be a JSON object",
            "invalid_request_error",
            None,
            Some("invalid_json"),
        ));
    };
    let Some(model) = request
        .get("model")
        .and_then(Value::as_str)
        .filter(|m| !m.is_empty())
    else {
        return state.count(openai_error(
            StatusCode::BAD_REQUEST,
            "you must provide a model parameter",
            "invalid_request_error",
            Some("model"),
            None,
        ));
    };

    let active = state.active();
    let config = &active.config;
    let Some((_slot, in_flight)) = state.admit(config.admission_limit()) else {
        return state.count(full(config));
    };
    if let Some(kind) = state.pick_failure(&active, parts.uri.path()) {
        return match kind {
            FailureKind::ConnectionReset => {
                state.resets.fetch_add(1, Ordering::SeqCst);
                Reply::Reset
            }
            kind => state.count(injected(config, kind)),
        };
    }

    let requested = reply::requested_tokens(request).unwrap_or(config.default_max_tokens);
    let tokens = config.answer_tokens(requested, &mut *lock(&state.rng));
    let admitted = Instant::now();
    let mut fixed = config.latency_fixed;
    if state.prefix_miss(config, endpoint, request) {
        fixed = fixed.saturating_add(config.prefix_miss_latency);
    }
    let mut per_token = config.latency(tokens).saturating_sub(config.latency_fixed);
    // Prompt processing, which the answer's usage.prompt_tokens shows (counting the words
    // costs a pass over the prompt: skipped when it costs nothing).
    if !config.latency_per_prompt_token.is_zero() {
        let prompt = u32::try_from(reply::prompt_tokens(endpoint, request)).unwrap_or(u32::MAX);
        fixed = fixed.saturating_add(config.latency_per_prompt_token.saturating_mul(prompt));
    }
    // The pod it lands on (held until the answer), when several serve the URL.
    let pod = state.route(config);
    let mut factor = pod.as_ref().map_or(1.0, |p| p.factor);
    if !config.batching && config.unseen != crate::Unseen::None {
        // The request's own cost, which its usage does not show.
        factor *= config.unseen.factor(&mut *lock(&state.rng));
    }
    if factor != 1.0 {
        fixed = fixed.mul_f64(factor);
        per_token = per_token.mul_f64(factor);
    }
    let unloaded = fixed.saturating_add(per_token);
    let token_time = if let Some(seqs) = config.max_num_seqs {
        let priority = request.get("priority").and_then(Value::as_i64);
        let priority = priority.filter(|_| config.priority_scheduling).unwrap_or(0);
        let arrival = state.engine.arrive(seqs, config.max_waiting, priority);
        if matches!(arrival, Arrival::Refused) {
            return state.count(full(config));
        }
        let streamed = reply::stream_asked(request).filter(|_| endpoint == Endpoint::Chat);
        if let Some(include_usage) = streamed {
            let prompt = include_usage.then(|| reply::prompt_tokens(endpoint, request));
            let answer = Streamed {
                state: state.clone(),
                active: active.clone(),
                arrival,
                fixed,
                per_token,
                tokens,
                model: model.to_owned(),
                digest,
                prompt,
                admitted,
                unloaded,
            };
            let (tx, body) = http::ChunkBody::channel(STREAM_BUFFER);
            let guards = (_slot, pod);
            tokio::spawn(async move {
                answer.send(tx).await;
                drop(guards);
            });
            return state.count_stream(body);
        }
        let Some(_running) = arrival.slot().await else {
            return state.count(full(config));
        };
        // The first token is slowed by the running batch as the later ones are.
        let stretch = config.itl_stretch(state.engine.counts().0);
        crate::timer::sleep(fixed.mul_f64(stretch)).await;
        let started = Instant::now();
        decode_vllm(&state, config, tokens).await;
        started.elapsed()
    } else if config.batching {
        crate::timer::sleep(fixed).await;
        let started = Instant::now();
        decode(&state, config, tokens).await;
        started.elapsed()
    } else {
        let latency = config.queued_latency(unloaded, in_flight);
        crate::timer::sleep(latency).await;
        per_token.mul_f64(latency.as_secs_f64() / unloaded.as_secs_f64().max(1e-9))
    };
    state.answered(admitted, unloaded, token_time, tokens);
    let text = reply::success(endpoint, model, request, &digest, tokens);
    state.count(http::json(StatusCode::OK, text))
}

/// Events of a streamed answer that may wait unsent for a slow client.
const STREAM_BUFFER: usize = 16;

/// A streamed chat answer in vLLM mode, from its place in the server (running or waiting) to
/// its last event.
struct Streamed {
    state: Arc<GatewayState>,
    active: Arc<Active>,
    arrival: Arrival,
    /// Time to the first token, unloaded.
    fixed: Duration,
    /// The time of all output tokens, unloaded.
    per_token: Duration,
    tokens: u64,
    model: String,
    digest: String,
    /// Prompt tokens for the usage event, when one is asked for.
    prompt: Option<u64>,
    admitted: Instant,
    unloaded: Duration,
}

impl Streamed {
    /// Waits for a slot, then sends one `chat.completion.chunk` event per token: the first
    /// after the time to the first token, each next after one token's time, both stretched by
    /// the requests running then (re-read per token, as vLLM's batch changes); then the usage
    /// event if asked, then `[DONE]`. A client that leaves ends it (its slot freed), as vLLM
    /// aborts a request whose client disconnected.
    async fn send(self, tx: tokio::sync::mpsc::Sender<Bytes>) {
        let config = &self.active.config;
        let engine = &self.state.engine;
        let _running = tokio::select! {
            slot = self.arrival.slot() => slot,
            _ = tx.closed() => return,
        };
        let content = reply::content(&self.digest);
        let n = self.tokens.max(1);
        let each = self.per_token.div_f64(n as f64);
        crate::timer::sleep(self.fixed.mul_f64(config.itl_stretch(engine.counts().0))).await;
        let started = Instant::now();
        for i in 0..n {
            if i > 0 {
                crate::timer::sleep(each.mul_f64(config.itl_stretch(engine.counts().0))).await;
            }
            let piece = reply::content_piece(&content, i, n);
            let event = reply::chunk_event(&self.model, &self.digest, &piece, i == 0, i + 1 == n);
            if tx.send(Bytes::from(event)).await.is_err() {
                return;
            }
        }
        let token_time = started.elapsed();
        if let Some(prompt) = self.prompt {
            let event = reply::usage_event(&self.model, &self.digest, prompt, self.tokens);
            if tx.send(Bytes::from(event)).await.is_err() {
                return;
            }
        }
        if tx
            .send(Bytes::from_static(reply::DONE_EVENT.as_bytes()))
            .await
            .is_ok()
        {
            let state = &self.state;
            state.answered(self.admitted, self.unloaded, token_time, self.tokens);
        }
    }
}

/// Output tokens re-read between steps of the model-server mode's decode.
const DECODE_STEP: u64 = 16;

/// Produces `tokens` output tokens in model-server mode: each step of [`DECODE_STEP`] tokens
/// takes the per-token time stretched by the requests running when it starts.
async fn decode(state: &GatewayState, config: &GatewayConfig, tokens: u64) {
    let mut left = tokens;
    while left > 0 {
        let step = left.min(DECODE_STEP);
        let stretch = config.token_stretch(state.in_flight.load(Ordering::SeqCst));
        let time = config.latency(step).saturating_sub(config.latency_fixed);
        crate::timer::sleep(time.mul_f64(stretch)).await;
        left -= step;
    }
}

/// vLLM mode: each step of [`DECODE_STEP`] tokens takes the per-token time stretched by
/// [`GatewayConfig::itl_stretch`] of the requests running when it starts.
async fn decode_vllm(state: &GatewayState, config: &GatewayConfig, tokens: u64) {
    let mut left = tokens;
    while left > 0 {
        let step = left.min(DECODE_STEP);
        let stretch = config.itl_stretch(state.engine.counts().0);
        let time = config.latency(step).saturating_sub(config.latency_fixed);
        crate::timer::sleep(time.mul_f64(stretch)).await;
        left -= step;
    }
}

/// The answer when the gateway (or vLLM mode's waiting queue) is full.
fn full(config: &GatewayConfig) -> Resp {
    if config.full_status == 503 {
        return openai_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the gateway is at capacity",
            "server_error",
            None,
            Some("service_unavailable"),
        );
    }
    too_many_requests(config, "the gateway is at capacity", None)
}

fn too_many_requests(config: &GatewayConfig, message: &str, dropped_reason: Option<&str>) -> Resp {
    let mut resp = openai_error(
        StatusCode::TOO_MANY_REQUESTS,
        message,
        "rate_limit_error",
        None,
        Some("rate_limit_exceeded"),
    );
    let headers = resp.headers_mut();
    if let Ok(v) = config.retry_after_secs.to_string().parse() {
        headers.insert(hyper::header::RETRY_AFTER, v);
    }
    if let Some(reason) = dropped_reason.and_then(|r| r.parse().ok()) {
        headers.insert(DROPPED_REASON, reason);
    }
    resp
}

fn injected(config: &GatewayConfig, kind: FailureKind) -> Resp {
    match kind {
        FailureKind::Status429 => too_many_requests(config, "simulated rate limit", None),
        FailureKind::TtlExpired => too_many_requests(
            config,
            "request TTL expired in the queue",
            Some("rejected-ttl-expired"),
        ),
        FailureKind::Status500 => openai_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "simulated internal error",
            "server_error",
            None,
            None,
        ),
        FailureKind::Status503 => openai_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "simulated overload",
            "server_error",
            None,
            Some("service_unavailable"),
        ),
        FailureKind::Status400 | FailureKind::ConnectionReset => openai_error(
            StatusCode::BAD_REQUEST,
            "simulated bad request",
            "invalid_request_error",
            None,
            None,
        ),
    }
}
