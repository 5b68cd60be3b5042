//! `/v1/webhook_endpoints`: a tenant's webhook endpoints, as OpenAI's SDKs manage them
//! (`client.webhooks`). A URL is accepted only within `serve.webhooks` (allowed hosts, https
//! unless http is allowed); the signing secret is shown once, when created or rotated.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use batch_state::{new_id, now_unix, Cursor, StoredWebhook, WebhookEndpoint, BATCH_EVENTS};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::batches::json_rejection;
use crate::{limit, list_body, Api, ApiError, ErrorCode, Id, ListParams, Tenant};

/// The longest endpoint name.
const MAX_NAME: usize = 256;
/// The longest URL.
const MAX_URL: usize = 2048;

#[derive(Debug, Deserialize)]
pub(crate) struct EndpointBody {
    url: Option<String>,
    name: Option<String>,
    event_types: Option<Vec<String>>,
    status: Option<String>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct TestBody {
    event_type: Option<String>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct ListQuery {
    limit: Option<i64>,
    after: Option<String>,
}

type Body<T> = Result<Json<T>, axum::extract::rejection::JsonRejection>;

/// A new `whsec_` secret: 32 random bytes, base64.
fn new_secret() -> String {
    use base64::Engine;
    let bytes: [u8; 32] = rand::random();
    format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// The secret with all but its last four characters masked.
fn hint(secret: &str) -> String {
    let tail = &secret[secret.len().saturating_sub(4)..];
    format!("whsec_****{tail}")
}

fn check_url(api: &Api, url: &str) -> Result<String, ApiError> {
    if url.len() > MAX_URL {
        return Err(ApiError::invalid(
            format!("The url is longer than {MAX_URL} bytes."),
            Some("url"),
        ));
    }
    let refused = |rule: &str| ApiError::invalid(format!("Refused url: {rule}."), Some("url"));
    let checked = api.webhooks.check_url(url).map_err(|rule| refused(&rule))?;
    // What is stored, and later sent, is the URL as the checker read it: parsed again by
    // another parser, the raw string could mean another host, or be no request at all.
    let checked = checked.as_str();
    if checked.parse::<axum::http::Uri>().is_err() {
        return Err(refused("it cannot be sent as an HTTP request"));
    }
    Ok(checked.to_owned())
}

fn check_events(events: Vec<String>) -> Result<Vec<String>, ApiError> {
    if events.is_empty() {
        return Err(ApiError::invalid(
            "event_types must name at least one event.",
            Some("event_types"),
        ));
    }
    let mut out: Vec<String> = Vec::new();
    for e in events {
        if !BATCH_EVENTS.contains(&e.as_str()) {
            return Err(ApiError::invalid(
                format!(
                    "Unknown event type {e:?}; expected one of {}.",
                    BATCH_EVENTS.join(", ")
                ),
                Some("event_types"),
            ));
        }
        if !out.contains(&e) {
            out.push(e);
        }
    }
    Ok(out)
}

fn check_name(name: Option<String>) -> Result<Option<String>, ApiError> {
    match name {
        Some(n) if n.len() > MAX_NAME => Err(ApiError::invalid(
            format!("name is longer than {MAX_NAME} bytes."),
            Some("name"),
        )),
        other => Ok(other),
    }
}

/// The endpoint object with its secret, as only create and rotate answer.
fn with_secret(endpoint: &WebhookEndpoint, secret: &str) -> Value {
    let mut value = serde_json::to_value(endpoint).expect("an endpoint serializes");
    value["signing_secret"] = json!(secret);
    value
}

async fn owned(api: &Api, tenant: &Tenant, id: &str) -> Result<StoredWebhook, ApiError> {
    match api.store.webhook(id).await? {
        Some(w) if w.tenant == tenant.0 => Ok(w),
        _ => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("No webhook endpoint found with id '{id}'."),
        )),
    }
}

pub(crate) async fn create(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    body: Body<EndpointBody>,
) -> Result<Json<Value>, ApiError> {
    let Json(body) = body.map_err(json_rejection)?;
    let url = body
        .url
        .ok_or_else(|| ApiError::invalid("Missing the required parameter 'url'.", Some("url")))?;
    let url = check_url(&api, &url)?;
    let event_types = match body.event_types {
        Some(events) => check_events(events)?,
        None => BATCH_EVENTS.iter().map(|e| (*e).to_owned()).collect(),
    };
    let secret = new_secret();
    let endpoint = WebhookEndpoint {
        id: new_id("we_"),
        object: "webhook_endpoint".into(),
        created_at: now_unix(),
        updated_at: None,
        name: check_name(body.name)?,
        url,
        event_types,
        status: "enabled".into(),
        signing_secret_hint: hint(&secret),
    };
    let stored = StoredWebhook {
        tenant: tenant.0.clone(),
        endpoint,
    };
    let cap = api.webhooks.max_endpoints_per_tenant;
    if !api.store.create_webhook(&stored, &secret, cap).await? {
        return Err(ApiError::new(
            ErrorCode::InsufficientQuota,
            format!(
                "This tenant already has {cap} webhook endpoints, its quota \
                 (serve.webhooks.max_endpoints_per_tenant); delete one first."
            ),
        ));
    }
    tracing::info!(webhook = %stored.endpoint.id, tenant = %tenant.0, "webhook endpoint created");
    Ok(Json(with_secret(&stored.endpoint, &secret)))
}

pub(crate) async fn list(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    ListParams(q): ListParams<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let limit = limit(q.limit, 20, 100)?;
    // Oldest first, as stored; `after` continues past that id or skips that many.
    let after = q.after.as_deref().map(Cursor::parse);
    let listed = api
        .store
        .list_webhooks_page(&tenant.0, after.as_ref(), limit)
        .await?;
    let page: Vec<WebhookEndpoint> = listed.data.into_iter().map(|w| w.endpoint).collect();
    let has_more = listed.has_more;
    let ids = page.iter().map(|e| e.id.clone()).collect();
    Ok(Json(list_body(page, ids, has_more)))
}

pub(crate) async fn retrieve(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    Id(id): Id,
) -> Result<Json<WebhookEndpoint>, ApiError> {
    Ok(Json(owned(&api, &tenant, &id).await?.endpoint))
}

pub(crate) async fn update(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    Id(id): Id,
    body: Body<EndpointBody>,
) -> Result<Json<WebhookEndpoint>, ApiError> {
    let Json(body) = body.map_err(json_rejection)?;
    let mut stored = owned(&api, &tenant, &id).await?;
    if let Some(url) = body.url {
        stored.endpoint.url = check_url(&api, &url)?;
    }
    if let Some(events) = body.event_types {
        stored.endpoint.event_types = check_events(events)?;
    }
    if body.name.is_some() {
        stored.endpoint.name = check_name(body.name)?;
    }
    match body.status.as_deref() {
        None => {}
        Some(s @ ("enabled" | "disabled")) => stored.endpoint.status = s.to_owned(),
        Some(other) => {
            return Err(ApiError::invalid(
                format!("status must be 'enabled' or 'disabled', got {other:?}."),
                Some("status"),
            ))
        }
    }
    stored.endpoint.updated_at = Some(now_unix());
    api.store.put_webhook(&stored, None).await?;
    Ok(Json(stored.endpoint))
}

pub(crate) async fn delete(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    Id(id): Id,
) -> Result<Json<Value>, ApiError> {
    let stored = owned(&api, &tenant, &id).await?;
    api.store.delete_webhook(&stored).await?;
    Ok(Json(
        json!({"id": id, "object": "webhook_endpoint.deleted", "deleted": true}),
    ))
}

pub(crate) async fn rotate_secret(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    Id(id): Id,
) -> Result<Json<Value>, ApiError> {
    let mut stored = owned(&api, &tenant, &id).await?;
    let secret = new_secret();
    stored.endpoint.signing_secret_hint = hint(&secret);
    stored.endpoint.updated_at = Some(now_unix());
    api.store.put_webhook(&stored, Some(&secret)).await?;
    tracing::info!(webhook = %id, tenant = %tenant.0, "webhook secret rotated");
    Ok(Json(with_secret(&stored.endpoint, &secret)))
}

pub(crate) async fn test(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    Id(id): Id,
    body: Body<TestBody>,
) -> Result<Json<Value>, ApiError> {
    let Json(body) = body.map_err(json_rejection)?;
    let stored = owned(&api, &tenant, &id).await?;
    let event_type = body.event_type.unwrap_or_else(|| "batch.completed".into());
    check_events(vec![event_type.clone()])?;
    // The URL is checked again: the rules may have changed since it was stored.
    check_url(&api, &stored.endpoint.url)?;
    let secret = api.store.webhook_secret(&id).await?.ok_or_else(|| {
        ApiError::new(
            ErrorCode::NotFound,
            format!("No webhook endpoint found with id '{id}'."),
        )
    })?;
    let status = api
        .hooks
        .test_webhook(&stored.endpoint, &secret, &event_type)
        .await;
    Ok(Json(json!({
        "object": "webhook_endpoint.test",
        "webhook_endpoint_id": id,
        "event_type": event_type,
        "status_code": status,
        "success": status.is_some_and(|s| (200..300).contains(&s)),
    })))
}
