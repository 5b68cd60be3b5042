//! `/v1/batches`: create, retrieve, list, cancel, and the lines written so far.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use batch_state::{new_id, now_unix, BatchObject, Cursor, StoredBatch};
use batch_wire::{BatchStatus, ALLOWED_URLS};
use futures::TryStreamExt;
use serde::Deserialize;

use crate::files::owned_file;
use crate::{limit, list_body, Api, ApiError, ErrorCode, Id, ListParams, Tenant};

/// The longest value of a pass-through header kept with a batch.
const MAX_PASS_THROUGH_VALUE: usize = 1024;

/// The values of the `serve.pass_through_headers` the create request carries (the last one of a
/// repeated header, as for the tenant header), to send on each of the batch's requests.
fn pass_through(
    api: &Api,
    headers: &axum::http::HeaderMap,
) -> Result<BTreeMap<String, String>, ApiError> {
    let mut kept = BTreeMap::new();
    for name in api.pass_through_headers.iter() {
        let Some(value) = headers.get_all(name.as_str()).iter().next_back() else {
            continue;
        };
        // Stored as text and sent again as a header: visible ASCII and spaces only.
        let value = value
            .to_str()
            .ok()
            .filter(|v| v.len() <= MAX_PASS_THROUGH_VALUE)
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("The {name} header must be at most {MAX_PASS_THROUGH_VALUE} bytes of visible ASCII."),
                    None,
                )
            })?;
        kept.insert(name.clone(), value.trim().to_owned());
    }
    Ok(kept)
}

/// OpenAI's metadata limits.
const MAX_METADATA_PAIRS: usize = 16;
const MAX_METADATA_KEY: usize = 64;
const MAX_METADATA_VALUE: usize = 512;

#[derive(Debug, Deserialize)]
pub(crate) struct CreateBody {
    input_file_id: Option<String>,
    endpoint: Option<String>,
    completion_window: Option<String>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(default)]
    output_expires_after: Option<ExpiresAfter>,
}

#[derive(Debug, Deserialize)]
struct ExpiresAfter {
    anchor: Option<String>,
    seconds: Option<i64>,
}

pub(crate) async fn create(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    request_headers: axum::http::HeaderMap,
    body: Result<Json<CreateBody>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<BatchObject>, ApiError> {
    let Json(body) = body.map_err(json_rejection)?;
    let params = check_params(body)?;
    check_input(&api, &tenant, &params.input_file_id).await?;
    let window_text = params.window_text.clone();
    let stored = new_batch(&api, &tenant.0, params, &request_headers)?;
    queue_batch(&api, &stored).await?;
    api.hooks.wake();
    tracing::info!(batch = %stored.id, tenant = %tenant.0, window = %window_text, "batch created");
    Ok(Json(stored.view()))
}

/// A create request's parameters, checked.
struct CreateParams {
    input_file_id: String,
    endpoint: String,
    window_text: String,
    window: Duration,
    metadata: BTreeMap<String, String>,
    output_expires_after: Option<u64>,
}

/// Step of a create: checks the body's parameters, in their order.
fn check_params(body: CreateBody) -> Result<CreateParams, ApiError> {
    let input_file_id = match body.input_file_id {
        None => {
            return Err(ApiError::invalid(
                "Missing the required parameter 'input_file_id'.",
                Some("input_file_id"),
            ))
        }
        Some(id) if id.trim().is_empty() => {
            return Err(ApiError::invalid(
                "input_file_id must not be empty.",
                Some("input_file_id"),
            ))
        }
        Some(id) => id,
    };
    let endpoint = body.endpoint.ok_or_else(|| {
        ApiError::invalid(
            "Missing the required parameter 'endpoint'.",
            Some("endpoint"),
        )
    })?;
    if !ALLOWED_URLS.contains(&endpoint.as_str()) {
        return Err(ApiError::invalid(
            format!(
                "Invalid endpoint {endpoint:?}: expected one of {}.",
                ALLOWED_URLS.join(", ")
            ),
            Some("endpoint"),
        ));
    }
    let window_text = body.completion_window.ok_or_else(|| {
        ApiError::invalid(
            "Missing the required parameter 'completion_window'.",
            Some("completion_window"),
        )
    })?;
    let window = parse_window(&window_text)?;
    let metadata = metadata(body.metadata)?;
    let output_expires_after = output_expiry(body.output_expires_after)?;
    Ok(CreateParams {
        input_file_id,
        endpoint,
        window_text,
        window,
        metadata,
        output_expires_after,
    })
}

/// Step of a create: `output_expires_after` as seconds, if given.
fn output_expiry(given: Option<ExpiresAfter>) -> Result<Option<u64>, ApiError> {
    let Some(e) = given else {
        return Ok(None);
    };
    if e.anchor.as_deref().is_some_and(|a| a != "created_at") {
        return Err(ApiError::invalid(
            "output_expires_after.anchor must be 'created_at'.",
            Some("output_expires_after.anchor"),
        ));
    }
    match e.seconds {
        Some(s) if (1..=30 * 24 * 3600).contains(&s) => Ok(Some(s as u64)),
        _ => Err(ApiError::invalid(
            "output_expires_after.seconds must be from 1 to 2592000.",
            Some("output_expires_after.seconds"),
        )),
    }
}

/// Step of a create: checks that the input file is the tenant's and a `batch` file.
async fn check_input(api: &Api, tenant: &Tenant, input_file_id: &str) -> Result<(), ApiError> {
    // The file is named in the body, not the URL: a bad one is a bad request (400), not 404.
    let input = owned_file(api, tenant, input_file_id)
        .await
        .map_err(|e| match e.code {
            ErrorCode::NotFound => ApiError::invalid(
                format!("Input file with ID '{input_file_id}' not found"),
                Some("input_file_id"),
            ),
            _ => e,
        })?;
    if input.file.purpose != "batch" {
        return Err(ApiError::invalid(
            format!(
                "File {input_file_id} has purpose {:?}; a batch needs a 'batch' file.",
                input.file.purpose
            ),
            Some("input_file_id"),
        ));
    }
    Ok(())
}

/// Step of a create: the new batch's record, with the headers its requests carry.
fn new_batch(
    api: &Api,
    tenant: &str,
    params: CreateParams,
    request_headers: &axum::http::HeaderMap,
) -> Result<StoredBatch, ApiError> {
    let id = new_id("batch_");
    let created_at = now_unix();
    let window_secs = params.window.as_secs().max(1);
    // parse_window bounds the window, so this is only a second guard.
    let expires_at = batch_wire::deadline(created_at, params.window)
        .ok_or_else(|| window_error(&params.window_text))?;
    let mut stored = StoredBatch::new(
        &id,
        tenant,
        &params.input_file_id,
        params.window_text.trim(),
        window_secs,
        created_at,
        expires_at,
    );
    stored.endpoint = Some(params.endpoint);
    stored.metadata = params.metadata;
    stored.output_expires_after = params.output_expires_after;
    stored.headers = pass_through(api, request_headers)?;
    // The batch's trace is this request's: each run of it, on any replica, is a child of it.
    if let Some(parent) = batch_observability::traceparent(&tracing::Span::current()) {
        stored
            .headers
            .insert(batch_observability::TRACEPARENT.to_owned(), parent);
    }
    Ok(stored)
}

/// Step of a create: records the batch in the queue, unless the tenant is at its quota.
async fn queue_batch(api: &Api, stored: &StoredBatch) -> Result<(), ApiError> {
    let max = api.quotas.max_unfinished_batches;
    if api.store.create_batch_within(stored, max).await?.is_err() {
        return Err(ApiError::new(
            ErrorCode::InsufficientQuota,
            format!("This tenant already has {max} batches queued or running, its quota (serve.tenant_max_batches); wait for some to end or cancel some."),
        ));
    }
    Ok(())
}

/// A body that is not the JSON expected: 413 when it is over `serve.max_json_body_bytes`.
pub(crate) fn json_rejection(e: axum::extract::rejection::JsonRejection) -> ApiError {
    if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError::new(
            ErrorCode::RequestTooLarge,
            "The request body is larger than this service's limit for JSON bodies (serve.max_json_body_bytes).",
        );
    }
    ApiError::invalid(format!("Invalid JSON body: {}", e.body_text()), None)
}

fn parse_window(text: &str) -> Result<Duration, ApiError> {
    match humantime::parse_duration(text.trim()) {
        Ok(d) if d >= Duration::from_secs(1) && d <= batch_wire::MAX_COMPLETION_WINDOW => Ok(d),
        _ => Err(window_error(text)),
    }
}

fn window_error(text: &str) -> ApiError {
    ApiError::invalid(
        format!(
            "Invalid completion_window {text:?}: expected a duration from 1s to {} days, such as 24h, 30m or 90s.",
            batch_wire::MAX_COMPLETION_WINDOW.as_secs() / 86_400
        ),
        Some("completion_window"),
    )
}

fn metadata(
    given: Option<BTreeMap<String, serde_json::Value>>,
) -> Result<BTreeMap<String, String>, ApiError> {
    let Some(given) = given else {
        return Ok(BTreeMap::new());
    };
    if given.len() > MAX_METADATA_PAIRS {
        return Err(ApiError::invalid(
            format!(
                "metadata holds {} pairs; at most {MAX_METADATA_PAIRS} are allowed.",
                given.len()
            ),
            Some("metadata"),
        ));
    }
    let mut out = BTreeMap::new();
    for (key, value) in given {
        let serde_json::Value::String(value) = value else {
            return Err(ApiError::invalid(
                format!("metadata[{key:?}] must be a string."),
                Some("metadata"),
            ));
        };
        if key.chars().count() > MAX_METADATA_KEY || value.chars().count() > MAX_METADATA_VALUE {
            return Err(ApiError::invalid(
                format!("metadata keys may have {MAX_METADATA_KEY} characters and values {MAX_METADATA_VALUE}; {key:?} is over."),
                Some("metadata"),
            ));
        }
        out.insert(key, value);
    }
    Ok(out)
}

/// The batch `id` if `tenant` owns it; 404 otherwise.
async fn owned_batch(api: &Api, tenant: &Tenant, id: &str) -> Result<StoredBatch, ApiError> {
    match api.store.batch(id).await? {
        Some(b) if b.tenant == tenant.0 => Ok(b),
        _ => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("No such Batch object: {id}"),
        )),
    }
}

pub(crate) async fn retrieve(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    Id(id): Id,
) -> Result<Json<BatchObject>, ApiError> {
    Ok(Json(owned_batch(&api, &tenant, &id).await?.view()))
}

#[derive(Debug, Deserialize)]
pub(crate) struct ListQuery {
    after: Option<String>,
    limit: Option<i64>,
}

pub(crate) async fn list(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    ListParams(q): ListParams<ListQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let limit = limit(q.limit, 20, 100)?;
    let page = api
        .store
        .list_batches(
            &tenant.0,
            q.after.as_deref().map(Cursor::parse).as_ref(),
            limit,
        )
        .await?;
    let batches: Vec<BatchObject> = page.data.iter().map(StoredBatch::view).collect();
    let ids = batches.iter().map(|b| b.batch.id.clone()).collect();
    Ok(Json(list_body(batches, ids, page.has_more)))
}

pub(crate) async fn cancel(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    Id(id): Id,
) -> Result<Json<BatchObject>, ApiError> {
    let batch = owned_batch(&api, &tenant, &id).await?;
    match batch.status {
        BatchStatus::Cancelled | BatchStatus::Cancelling => return Ok(Json(batch.view())),
        s if s.is_terminal() => {
            return Err(ApiError::invalid(
                format!("Cannot cancel batch {id}: its status is {}.", s.as_str()),
                None,
            ))
        }
        _ => {}
    }
    api.store.request_cancel(&id).await?;
    api.hooks.wake();
    tracing::info!(batch = %id, tenant = %tenant.0, "cancel requested");
    Ok(Json(owned_batch(&api, &tenant, &id).await?.view()))
}

pub(crate) async fn output(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    Id(id): Id,
) -> Result<Response, ApiError> {
    lines_so_far(&api, &tenant, &id, batch_wire::OUTPUT_FILE).await
}

pub(crate) async fn errors(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    Id(id): Id,
) -> Result<Response, ApiError> {
    lines_so_far(&api, &tenant, &id, batch_wire::ERROR_FILE).await
}

/// The complete lines of a batch's output or error file: from storage once it ended, from the
/// running job's own file while it runs here, from its latest checkpoint while it runs on
/// another replica, none while it waits.
async fn lines_so_far(
    api: &Api,
    tenant: &Tenant,
    id: &str,
    file: &str,
) -> Result<Response, ApiError> {
    let batch = owned_batch(api, tenant, id).await?;
    let jsonl = [(header::CONTENT_TYPE, "application/jsonl")];
    if batch.status.is_terminal() {
        let file_id = if file == batch_wire::OUTPUT_FILE {
            &batch.output_file_id
        } else {
            &batch.error_file_id
        };
        let Some(file_id) = file_id else {
            return Ok((jsonl, Body::empty()).into_response());
        };
        let Some(record) = api.store.file(file_id).await? else {
            return Ok((jsonl, Body::empty()).into_response());
        };
        let object = api.storage.get(&record.storage_key()).await?;
        let stream = object.stream.map_err(std::io::Error::other);
        return Ok((jsonl, Body::from_stream(stream)).into_response());
    }
    Ok(match api.hooks.lines_so_far(id, file).await? {
        Some(lines) => (jsonl, Body::from_stream(lines)).into_response(),
        None => (jsonl, Body::empty()).into_response(),
    })
}
