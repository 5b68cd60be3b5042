//! The middleware at the edge of every route: request ids, limits on the request head, the
//! Redis gate and the request counter.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tracing::Instrument;

use crate::{Api, ApiError, ErrorCode, REQUEST_ID};

/// While the state store has no connection, a `/v1/` request is a 503 at once (the SDKs retry
/// it) instead of waiting out the reconnection and then failing the same way.
pub(crate) async fn redis_gate(
    State(api): State<Arc<Api>>,
    request: Request,
    next: Next,
) -> Response {
    if request.uri().path().starts_with("/v1/") && !api.store.is_connected() {
        let mut response = ApiError::new(
            ErrorCode::Unavailable,
            "The service's state store is not connected; retry shortly.",
        )
        .into_response();
        response.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from_static("1"),
        );
        return response;
    }
    next.run(request).await
}

/// Gives every response a request id (the caller's, or a new one) and logs the request.
pub(crate) async fn request_id(request: Request, next: Next) -> Response {
    let id = request
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| plain_request_id(v))
        .map(str::to_owned)
        .unwrap_or_else(|| format!("req_{:032x}", rand::random::<u128>()));
    let (method, path) = (request.method().clone(), request.uri().path().to_owned());
    let has_body = request
        .headers()
        .contains_key(axum::http::header::CONTENT_LENGTH)
        || request
            .headers()
            .contains_key(axum::http::header::TRANSFER_ENCODING);
    let started = Instant::now();
    let mut response = match head_too_large(&request) {
        Some(refusal) => refusal.into_response(),
        None => next.run(request).await,
    };
    if has_body && !response.status().is_success() {
        // A refusal (a wrong key, a bad form) may leave the body unread, and then the server
        // drops the connection: say so, or the client reuses it and its next request fails.
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            HeaderValue::from_static("close"),
        );
    }
    tracing::debug!(request_id = %id, %method, path, status = response.status().as_u16(), elapsed = ?started.elapsed(), "request");
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID, value);
    }
    response
}

/// Refuses a path with a segment (an id) longer than `max` bytes before any handler or store
/// sees it.
pub(crate) async fn path_limit(State(max): State<usize>, request: Request, next: Next) -> Response {
    if request.uri().path().split('/').any(|part| part.len() > max) {
        return ApiError::invalid(
            format!("A part of the request path is longer than the {max} bytes an id may have."),
            Some("id"),
        )
        .into_response();
    }
    next.run(request).await
}

/// The longest caller's request id kept.
const MAX_REQUEST_ID: usize = 128;

/// Whether a caller's `x-request-id` is kept: up to [`MAX_REQUEST_ID`] letters, digits, `-`,
/// `_`, `.` and `:`. Anything else (spaces, `=`, quotes) could forge fields of a log line, and is
/// replaced by a new id.
pub(crate) fn plain_request_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_REQUEST_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

/// The longest request target answered (8 KiB); hyper itself cuts at 64 KiB, with no body.
pub const MAX_URI_BYTES: usize = 8 << 10;
/// The most header bytes (names and values) answered (32 KiB); hyper's buffer cuts at 64 KiB.
pub const MAX_HEADER_BYTES: usize = 32 << 10;
/// The most headers answered; hyper's own limit is set above it.
pub const MAX_HEADERS: usize = 100;

/// A 414 or 431 in OpenAI's shape for a request head over the limits hyper lets through.
fn head_too_large(request: &Request) -> Option<ApiError> {
    let uri = request.uri().to_string().len();
    if uri > MAX_URI_BYTES {
        return Some(ApiError::new(
            ErrorCode::UriTooLong,
            format!("The request URL has {uri} bytes; at most {MAX_URI_BYTES} are answered."),
        ));
    }
    let headers = request.headers();
    let bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if headers.len() > MAX_HEADERS || bytes > MAX_HEADER_BYTES {
        return Some(ApiError::new(
            ErrorCode::HeadersTooLarge,
            format!(
                "The request has {} headers of {bytes} bytes; at most {MAX_HEADERS} headers of {MAX_HEADER_BYTES} bytes are answered.",
                headers.len()
            ),
        ));
    }
    None
}

/// Routes that get no span of their own: probes and scrapes, every few seconds.
const UNTRACED: [&str; 3] = ["/health", "/ready", "/metrics"];

/// Counts requests by route (the pattern, not the ids in it) and status, each in a span of
/// its own (`POST /v1/batches`, ...) under the caller's `traceparent` if it sent one.
pub(crate) async fn count(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    // hyper takes any token as a method: only the standard ones become label values.
    let method = match request.method().as_str() {
        m @ ("GET" | "POST" | "PUT" | "PATCH" | "DELETE" | "HEAD" | "OPTIONS") => m.to_owned(),
        _ => "other".to_owned(),
    };
    let response = if UNTRACED.contains(&route.as_str()) {
        next.run(request).await
    } else {
        let span = tracing::info_span!(
            "api",
            otel.name = %format!("{method} {route}"),
            otel.kind = "server",
            http.request.method = %method,
            http.route = %route,
            http.response.status_code = tracing::field::Empty,
        );
        if let Some(parent) = request
            .headers()
            .get(batch_observability::TRACEPARENT)
            .and_then(|v| v.to_str().ok())
        {
            batch_observability::set_parent(&span, parent);
        }
        let response = next.run(request).instrument(span.clone()).await;
        span.record("http.response.status_code", response.status().as_u16());
        response
    };
    metrics::counter!(
        "batch_service_api_requests_total",
        "route" => route,
        "method" => method,
        "status" => response.status().as_u16().to_string()
    )
    .increment(1);
    response
}
