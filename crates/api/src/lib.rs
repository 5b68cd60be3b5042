#![doc = include_str!("../README.md")]

mod batches;
mod edge;
mod error;
mod files;
mod tenant;
mod webhooks;

use std::sync::Arc;

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use batch_config::InputLimits;
use futures::future::BoxFuture;

use edge::{count, path_limit, redis_gate, request_id};
pub use edge::{MAX_HEADERS, MAX_HEADER_BYTES, MAX_URI_BYTES};
pub use error::{ApiError, ErrorCode};
pub use tenant::{Keys, Tenant, DEFAULT_TENANT};

/// The request id header, echoed or generated on every response.
pub const REQUEST_ID: &str = "x-request-id";

/// Bytes of whole JSONL lines, as [`Hooks::lines_so_far`] gives them.
pub type LineStream = futures::stream::BoxStream<'static, std::io::Result<bytes::Bytes>>;

/// What the API needs from the part of the process that runs jobs.
pub trait Hooks: Send + Sync + 'static {
    /// A batch was created or a cancel asked for: look at the queues now.
    fn wake(&self);
    /// The whole lines a running batch's `file` (`output.jsonl` or `error.jsonl`) holds so
    /// far: from the job itself while it runs in this process, else from its latest checkpoint;
    /// `None` while there are none.
    fn lines_so_far<'a>(
        &'a self,
        batch_id: &'a str,
        file: &'a str,
    ) -> BoxFuture<'a, Result<Option<LineStream>, ApiError>>;
    /// The Prometheus text of `/metrics`.
    fn render_metrics(&self) -> BoxFuture<'_, String>;
    /// Sends one sample `event_type` event to `endpoint`, signed with `secret`: the status it
    /// answered, `None` when it did not answer. Without a sender, nothing is sent.
    fn test_webhook<'a>(
        &'a self,
        endpoint: &'a batch_state::WebhookEndpoint,
        secret: &'a str,
        event_type: &'a str,
    ) -> BoxFuture<'a, Option<u16>> {
        let _ = (endpoint, secret, event_type);
        Box::pin(async { None })
    }

    /// Why the process cannot serve now although Redis and storage answer (Redis lost the
    /// service's state, being rebuilt): `/ready` fails with it.
    fn not_ready(&self) -> Option<String> {
        None
    }
}

/// Limits on what a request carries besides an uploaded file (the `serve.max_*` settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EdgeLimits {
    /// The largest JSON body; a larger one is a 413 before it is read whole.
    pub max_json_body_bytes: u64,
    /// The largest multipart field other than `file`.
    pub max_form_field_bytes: u64,
    /// The longest upload `filename`, in bytes.
    pub max_filename_bytes: usize,
    /// The longest segment of a request's path (an id), in bytes.
    pub max_id_bytes: usize,
}

impl Default for EdgeLimits {
    /// The defaults of `serve`.
    fn default() -> Self {
        Self {
            max_json_body_bytes: 1 << 20,
            max_form_field_bytes: 64 << 10,
            max_filename_bytes: 255,
            max_id_bytes: 128,
        }
    }
}

/// What one tenant may hold (the `serve.tenant_max_*` settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quotas {
    /// Batches queued or running.
    pub max_unfinished_batches: u64,
    /// Bytes of stored files.
    pub max_stored_bytes: u64,
    /// Stored files.
    pub max_files: u64,
}

impl Default for Quotas {
    /// The defaults of `serve`.
    fn default() -> Self {
        Self {
            max_unfinished_batches: 1_000,
            max_stored_bytes: 100 << 30,
            max_files: 10_000,
        }
    }
}

/// Everything the handlers share.
#[derive(Clone)]
pub struct Api {
    /// Records, listings, the job queue.
    pub store: batch_state::Store,
    /// Where file bytes live.
    pub storage: batch_storage::Storage,
    /// Who may call.
    pub keys: Keys,
    /// Limits on uploads (and on a batch's input).
    pub limits: InputLimits,
    /// Limits on the size of what a request carries besides a file.
    pub edge: EdgeLimits,
    /// Each tenant's quotas.
    pub quotas: Quotas,
    /// Headers of `POST /v1/batches` kept with the batch and sent on each of its requests
    /// (`serve.pass_through_headers`, lower case).
    pub pass_through_headers: Arc<[String]>,
    /// Where tenants' webhooks may point (`serve.webhooks`).
    pub webhooks: batch_config::WebhooksConfig,
    /// The job-running side.
    pub hooks: Arc<dyn Hooks>,
}

/// `Query`, with its rejections in OpenAI's error shape.
pub(crate) struct ListParams<T>(pub T);

impl<T, S> FromRequestParts<S> for ListParams<T>
where
    T: serde::de::DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(q)) => Ok(Self(q)),
            Err(e) => Err(ApiError::invalid(
                format!("Invalid query parameters: {}", e.body_text()),
                None,
            )),
        }
    }
}

/// The `{id}` of a route, with its rejection (not UTF-8 once percent-decoded) in OpenAI's error
/// shape instead of axum's plain text.
pub(crate) struct Id(pub String);

impl<S: Send + Sync> FromRequestParts<S> for Id {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<String>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(id)) => Ok(Self(id)),
            Err(e) => Err(ApiError::invalid(
                format!("Invalid id in the path: {}", e.body_text()),
                Some("id"),
            )),
        }
    }
}

/// `Multipart`, with its rejections (not a form, no boundary) in OpenAI's error shape.
pub(crate) struct Form(pub axum::extract::Multipart);

impl<S: Send + Sync> axum::extract::FromRequest<S> for Form {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Multipart::from_request(request, state).await {
            Ok(form) => Ok(Self(form)),
            Err(e) => Err(ApiError::invalid(
                format!(
                    "Expected a multipart/form-data body with the fields 'file' and 'purpose': {}",
                    e.body_text()
                ),
                None,
            )),
        }
    }
}

/// The whole API.
pub fn router(api: Api) -> Router {
    routers(api).0
}

/// The whole API, and the probes alone (`/health`, `/ready`, `/metrics`, the same answers as
/// the API's) for a port of their own (`observability.addr`), where neither keys nor the tenant
/// header are asked for.
pub fn routers(api: Api) -> (Router, Router) {
    // Every request clones the state a few times (each middleware and handler): one counter,
    // not every field's.
    let api = Arc::new(api);
    let probes = Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn(request_id))
        .with_state(api.clone());
    (full_router(api), probes)
}

fn full_router(api: Arc<Api>) -> Router {
    let json_limit = usize::try_from(api.edge.max_json_body_bytes).unwrap_or(usize::MAX);
    Router::new()
        .route(
            "/v1/files",
            // An upload is streamed to storage under its own limit, `input.max_file_bytes`.
            post(files::upload)
                .layer(axum::extract::DefaultBodyLimit::disable())
                .get(files::list),
        )
        .route("/v1/files/{id}", get(files::retrieve).delete(files::delete))
        .route("/v1/files/{id}/content", get(files::content))
        .route("/v1/batches", post(batches::create).get(batches::list))
        .route("/v1/batches/{id}", get(batches::retrieve))
        .route("/v1/batches/{id}/cancel", post(batches::cancel))
        .route("/v1/batches/{id}/output", get(batches::output))
        .route("/v1/batches/{id}/errors", get(batches::errors))
        .route(
            "/v1/webhook_endpoints",
            post(webhooks::create).get(webhooks::list),
        )
        .route(
            "/v1/webhook_endpoints/{id}",
            get(webhooks::retrieve)
                .post(webhooks::update)
                .delete(webhooks::delete),
        )
        .route(
            "/v1/webhook_endpoints/{id}/rotate_secret",
            post(webhooks::rotate_secret),
        )
        .route("/v1/webhook_endpoints/{id}/test", post(webhooks::test))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", get(openapi))
        .route_layer(axum::middleware::from_fn_with_state(
            api.clone(),
            redis_gate,
        ))
        .route_layer(axum::middleware::from_fn(count))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(json_limit))
        .layer(axum::middleware::from_fn_with_state(
            api.edge.max_id_bytes,
            path_limit,
        ))
        .layer(axum::middleware::from_fn(request_id))
        .with_state(api)
}

/// The OpenAPI document of the routes served: the subset of OpenAI's that the service
/// implements, and its own routes.
pub const OPENAPI: &str = include_str!("openapi.json");

async fn openapi() -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        OPENAPI,
    )
        .into_response()
}

async fn health() -> &'static str {
    "ok\n"
}

async fn ready(State(api): State<Arc<Api>>) -> Response {
    if let Some(why) = api.hooks.not_ready() {
        return (StatusCode::SERVICE_UNAVAILABLE, why).into_response();
    }
    // A probe gets its answer at once while Redis is not connected, not after a reconnection.
    let redis = if api.store.is_connected() {
        api.store.ping().await.map_err(|e| e.to_string())
    } else {
        Err("not connected".to_owned())
    };
    let storage = api.storage.check().await;
    match (redis, storage) {
        (Ok(()), Ok(())) => (StatusCode::OK, "ready\n").into_response(),
        (r, s) => {
            let mut why = String::new();
            if let Err(e) = r {
                why.push_str(&format!("redis: {e}\n"));
            }
            if let Err(e) = s {
                why.push_str(&format!("storage: {e}\n"));
            }
            (StatusCode::SERVICE_UNAVAILABLE, why).into_response()
        }
    }
}

async fn metrics_text(State(api): State<Arc<Api>>) -> Response {
    let text = api.hooks.render_metrics().await;
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn not_found(request: Request) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!(
            "Unknown request URL: {} {}.",
            request.method(),
            request.uri().path()
        ),
    )
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        format!(
            "{} is not allowed on {}.",
            request.method(),
            request.uri().path()
        ),
    )
}

/// `limit` of a listing: `default` when absent, an error outside `1..=max`.
pub(crate) fn limit(value: Option<i64>, default: usize, max: usize) -> Result<usize, ApiError> {
    match value {
        None => Ok(default),
        Some(n) if n >= 1 && n as usize <= max => Ok(n as usize),
        Some(n) => Err(ApiError::invalid(
            format!("limit must be between 1 and {max}, got {n}."),
            Some("limit"),
        )),
    }
}

/// A listing in OpenAI's shape.
pub(crate) fn list_body<T: serde::Serialize>(
    data: Vec<T>,
    ids: Vec<String>,
    has_more: bool,
) -> serde_json::Value {
    serde_json::json!({
        "object": "list",
        "data": data,
        "first_id": ids.first(),
        "last_id": ids.last(),
        "has_more": has_more,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edge::plain_request_id;

    /// The document describes exactly the routes of [`router`], and parses.
    #[test]
    fn the_openapi_document_lists_every_route_served() {
        let doc: serde_json::Value = serde_json::from_str(OPENAPI).expect("valid JSON");
        let paths: Vec<&str> = doc["paths"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let mut served = vec![
            "/v1/files",
            "/v1/files/{file_id}",
            "/v1/files/{file_id}/content",
            "/v1/batches",
            "/v1/batches/{batch_id}",
            "/v1/batches/{batch_id}/cancel",
            "/v1/batches/{batch_id}/output",
            "/v1/batches/{batch_id}/errors",
            "/v1/webhook_endpoints",
            "/v1/webhook_endpoints/{webhook_endpoint_id}",
            "/v1/webhook_endpoints/{webhook_endpoint_id}/rotate_secret",
            "/v1/webhook_endpoints/{webhook_endpoint_id}/test",
            "/health",
            "/ready",
            "/metrics",
            "/openapi.json",
        ];
        served.sort_unstable();
        let mut paths = paths;
        paths.sort_unstable();
        assert_eq!(paths, served);
        assert_eq!(doc["openapi"], "3.0.3");
    }

    #[test]
    fn only_plain_request_ids_are_kept() {
        assert!(plain_request_id("req_0af3"));
        assert!(plain_request_id("client-1.retry:2"));
        for forged in ["", "a b", "x=1", "a\"b", &"x".repeat(129)] {
            assert!(!plain_request_id(forged), "{forged:?}");
        }
    }
}
