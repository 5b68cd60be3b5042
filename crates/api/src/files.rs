//! `/v1/files`: upload (multipart, streamed to storage), retrieve, list, content, delete.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Multipart, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use batch_state::{new_id, now_unix, Cursor, FileObject, Order, QuotaExceeded, StoredFile};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use serde::Deserialize;

use crate::{limit, list_body, Api, ApiError, ErrorCode, Form, Id, ListParams, Tenant};

/// Batch input files expire after 30 days unless the upload says otherwise.
const DEFAULT_INPUT_EXPIRY_SECS: i64 = 30 * 24 * 3600;
/// The longest `expires_after[seconds]` OpenAI allows.
const MAX_EXPIRY_SECS: i64 = 30 * 24 * 3600;

pub(crate) async fn upload(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    Form(mut form): Form,
) -> Result<Json<FileObject>, ApiError> {
    // The quotas first: a tenant at one is refused before a byte of the file is read.
    let room = room_left(&api, &tenant.0).await?;
    let id = new_id("file-");
    let key = batch_state::layout::upload(&id);
    let read = read_form(&api, &mut form, &key, room).await;
    let stored = match read.and_then(|fields| stored_file(&tenant.0, &id, fields)) {
        Ok(stored) => stored,
        Err(e) => {
            remove_refused(&api, &key).await;
            return Err(e);
        }
    };
    if let Err(e) = record_file(&api, &stored).await {
        remove_refused(&api, &key).await;
        return Err(e);
    }
    tracing::info!(file = %stored.file.id, tenant = %stored.tenant, bytes = stored.file.bytes, "file uploaded");
    Ok(Json(stored.file))
}

/// Step of an upload: the room left in the tenant's quota of stored bytes, refused when the
/// tenant is at one of its quotas.
async fn room_left(api: &Api, tenant: &str) -> Result<u64, ApiError> {
    let (used_bytes, used_files) = api.store.usage(tenant).await?;
    let quotas = api.quotas;
    if used_files >= quotas.max_files {
        return Err(files_quota(quotas.max_files));
    }
    if used_bytes >= quotas.max_stored_bytes {
        return Err(bytes_quota(quotas.max_stored_bytes));
    }
    Ok(quotas.max_stored_bytes - used_bytes)
}

/// The fields of an upload's form, as read (the file as its name and size once stored).
#[derive(Default)]
struct UploadForm {
    purpose: Option<String>,
    anchor: Option<String>,
    seconds: Option<String>,
    uploaded: Option<(String, u64)>,
}

/// Step of an upload: reads the form's fields, streaming the file to storage at `key`.
async fn read_form(
    api: &Api,
    form: &mut Multipart,
    key: &str,
    room: u64,
) -> Result<UploadForm, ApiError> {
    let mut fields = UploadForm::default();
    let max_field = api.edge.max_form_field_bytes;
    while let Some(field) = form.next_field().await.map_err(bad_form)? {
        let name = field.name().unwrap_or("").to_owned();
        match name.as_str() {
            "file" => {
                if fields.uploaded.is_some() {
                    return Err(ApiError::invalid("Only one file per upload.", Some("file")));
                }
                let filename = field.file_name().unwrap_or("upload.jsonl").to_owned();
                let max_name = api.edge.max_filename_bytes;
                if filename.len() > max_name {
                    return Err(ApiError::invalid(
                        format!("The file's name is longer than this service's limit of {max_name} bytes."),
                        Some("file"),
                    ));
                }
                let bytes = match store_file(api, key, field, room).await {
                    Ok(bytes) => bytes,
                    Err(e) => {
                        if matches!(
                            e.code.status(),
                            axum::http::StatusCode::PAYLOAD_TOO_LARGE
                                | axum::http::StatusCode::TOO_MANY_REQUESTS
                        ) {
                            drain(form).await;
                        }
                        return Err(e);
                    }
                };
                fields.uploaded = Some((filename, bytes));
            }
            "purpose" => fields.purpose = Some(small_text(field, max_field).await?),
            "expires_after[anchor]" => fields.anchor = Some(small_text(field, max_field).await?),
            "expires_after[seconds]" => fields.seconds = Some(small_text(field, max_field).await?),
            _ => {
                // Unknown fields are read and ignored, as OpenAI does.
                small_text(field, max_field).await?;
            }
        }
    }
    Ok(fields)
}

/// Step of an upload: the file's record, once the form read has a file and valid fields.
fn stored_file(tenant: &str, id: &str, fields: UploadForm) -> Result<StoredFile, ApiError> {
    let Some((filename, bytes)) = fields.uploaded else {
        return Err(ApiError::invalid(
            "Missing the file: send it as the multipart field 'file'.",
            Some("file"),
        ));
    };
    let purpose = fields.purpose.ok_or_else(|| {
        ApiError::invalid("Missing the required parameter 'purpose'.", Some("purpose"))
    })?;
    if purpose != "batch" {
        return Err(ApiError::invalid(
            format!("Invalid purpose {purpose:?}: this service accepts 'batch' files."),
            Some("purpose"),
        ));
    }
    let created_at = now_unix();
    let expires_at = created_at + expiry(fields.anchor.as_deref(), fields.seconds.as_deref())?;
    Ok(StoredFile {
        tenant: tenant.to_owned(),
        file: FileObject {
            id: id.to_owned(),
            object: "file".into(),
            bytes,
            created_at,
            filename,
            purpose,
            expires_at: Some(expires_at),
            status: "processed".into(),
            status_details: None,
        },
        key: None,
    })
}

/// Step of an upload: records the file, unless that takes the tenant over a quota.
async fn record_file(api: &Api, stored: &StoredFile) -> Result<(), ApiError> {
    let quotas = api.quotas;
    let quota = batch_state::FileQuota {
        max_bytes: quotas.max_stored_bytes,
        max_files: quotas.max_files,
    };
    // Checked again as it is counted: another upload of the tenant may have ended meanwhile.
    match api.store.put_file_within(stored, &quota).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(QuotaExceeded::Files)) => Err(files_quota(quotas.max_files)),
        Ok(Err(_)) => Err(bytes_quota(quotas.max_stored_bytes)),
        Err(e) => Err(e.into()),
    }
}

/// Step of a refused upload: removes what of its file reached storage.
async fn remove_refused(api: &Api, key: &str) {
    if let Err(cleanup) = api.storage.delete(key).await {
        tracing::warn!(key, error = %cleanup, "could not remove a refused upload");
    }
}

fn files_quota(max: u64) -> ApiError {
    ApiError::new(
        ErrorCode::InsufficientQuota,
        format!("This tenant already stores {max} files, its quota (serve.tenant_max_files); delete some first."),
    )
    .param("file")
}

fn bytes_quota(max: u64) -> ApiError {
    ApiError::new(
        ErrorCode::InsufficientQuota,
        format!("This file would take the tenant's stored bytes over its quota of {max} (serve.tenant_max_stored_bytes); delete some files first."),
    )
    .param("file")
}

/// Reads and drops the rest of a refused upload (up to a bound), so that the client, which is
/// still sending, reads the 413 instead of a reset connection (which SDKs retry).
async fn drain(form: &mut Multipart) {
    const MAX_DRAIN: u64 = 1 << 30;
    let mut drained = 0u64;
    while let Ok(Some(mut field)) = form.next_field().await {
        while let Ok(Some(chunk)) = field.chunk().await {
            drained += chunk.len() as u64;
            if drained > MAX_DRAIN {
                return;
            }
        }
    }
}

fn bad_form(e: axum::extract::multipart::MultipartError) -> ApiError {
    ApiError::invalid(format!("Invalid multipart body: {e}"), None)
}

async fn small_text(
    mut field: axum::extract::multipart::Field<'_>,
    max: u64,
) -> Result<String, ApiError> {
    let name = field.name().unwrap_or("").to_owned();
    let mut text = Vec::new();
    while let Some(chunk) = field.chunk().await.map_err(bad_form)? {
        text.extend_from_slice(&chunk);
        if text.len() as u64 > max {
            return Err(ApiError::invalid(
                format!(
                    "The form field '{name}' is longer than this service's limit of {max} bytes."
                ),
                Some(&name),
            ));
        }
    }
    String::from_utf8(text).map_err(|_| {
        ApiError::invalid(
            format!("The form field '{name}' is not UTF-8."),
            Some(&name),
        )
    })
}

fn expiry(anchor: Option<&str>, seconds: Option<&str>) -> Result<i64, ApiError> {
    if let Some(a) = anchor.filter(|a| *a != "created_at") {
        return Err(ApiError::invalid(
            format!("expires_after[anchor] must be 'created_at', got {a:?}."),
            Some("expires_after[anchor]"),
        ));
    }
    let Some(text) = seconds else {
        return Ok(DEFAULT_INPUT_EXPIRY_SECS);
    };
    match text.trim().parse::<i64>() {
        Ok(n) if (1..=MAX_EXPIRY_SECS).contains(&n) => Ok(n),
        _ => Err(ApiError::invalid(
            format!("expires_after[seconds] must be a whole number of seconds from 1 to {MAX_EXPIRY_SECS}, got {text:?}."),
            Some("expires_after[seconds]"),
        )),
    }
}

const TOO_MANY_BYTES: u8 = 1;
const TOO_MANY_LINES: u8 = 2;
const OVER_QUOTA: u8 = 3;

/// Streams the `file` field to storage, counting bytes and request lines against the limits
/// and the `room` left in the tenant's quota of stored bytes.
async fn store_file(
    api: &Api,
    key: &str,
    field: axum::extract::multipart::Field<'_>,
    room: u64,
) -> Result<u64, ApiError> {
    let (max_bytes, max_lines) = (api.limits.max_file_bytes, api.limits.max_requests);
    let quota = api.quotas.max_stored_bytes;
    let over = Arc::new(AtomicU8::new(0));
    let flag = over.clone();
    let mut bytes = 0u64;
    let mut lines = LineCounter::default();
    let counted = field.map(move |chunk| {
        let chunk: Bytes = chunk.map_err(|e| e.to_string())?;
        bytes += chunk.len() as u64;
        if bytes > max_bytes {
            flag.store(TOO_MANY_BYTES, Ordering::Relaxed);
            return Err("too large".to_owned());
        }
        if bytes > room {
            flag.store(OVER_QUOTA, Ordering::Relaxed);
            return Err("over the quota".to_owned());
        }
        lines.feed(&chunk);
        if lines.lines > max_lines {
            flag.store(TOO_MANY_LINES, Ordering::Relaxed);
            return Err("too many lines".to_owned());
        }
        Ok(chunk)
    });
    match api.storage.put_stream(key, counted).await {
        Ok(n) => Ok(n),
        Err(e) => match over.load(Ordering::Relaxed) {
            TOO_MANY_BYTES => Err(ApiError::new(
                ErrorCode::FileTooLarge,
                format!("The file is larger than this service's limit of {max_bytes} bytes."),
            )),
            TOO_MANY_LINES => Err(ApiError::new(
                ErrorCode::TooManyRequestsInFile,
                format!("The file holds more than this service's limit of {max_lines} requests."),
            )),
            OVER_QUOTA => Err(bytes_quota(quota)),
            _ => match e {
                batch_storage::StorageError::Source { message, .. } => Err(ApiError::invalid(
                    format!("The upload stopped before its end: {message}"),
                    Some("file"),
                )),
                other => Err(other.into()),
            },
        },
    }
}

/// Counts the request lines of a file given in chunks: lines holding anything but spaces, tabs
/// and carriage returns.
#[derive(Debug, Default)]
struct LineCounter {
    lines: u64,
    /// Whether the line the last chunk ended in was already counted.
    in_line: bool,
}

impl LineCounter {
    fn feed(&mut self, chunk: &[u8]) {
        // Line ends are found with SIMD; a line is looked at only until its first byte that is
        // not blank, which is its first byte in any request line.
        let mut start = 0;
        let ends = memchr::memchr_iter(b'\n', chunk).chain(std::iter::once(chunk.len()));
        for end in ends {
            let line = &chunk[start..end];
            if !self.in_line && line.iter().any(|&b| !matches!(b, b' ' | b'\t' | b'\r')) {
                self.in_line = true;
                self.lines += 1;
            }
            if end < chunk.len() {
                self.in_line = false;
            }
            start = end + 1;
        }
    }
}

/// The file `id` if `tenant` owns it; 404 otherwise, also when another tenant does.
pub(crate) async fn owned_file(
    api: &Api,
    tenant: &Tenant,
    id: &str,
) -> Result<StoredFile, ApiError> {
    match api.store.file(id).await? {
        Some(f) if f.tenant == tenant.0 && !expired(&f.file) => Ok(f),
        _ => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("No such File object: {id}"),
        )),
    }
}

/// Expired files are gone for the API even before the reaper deletes them.
fn expired(file: &FileObject) -> bool {
    file.expires_at.is_some_and(|at| at <= now_unix())
}

pub(crate) async fn retrieve(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    Id(id): Id,
) -> Result<Json<FileObject>, ApiError> {
    Ok(Json(owned_file(&api, &tenant, &id).await?.file))
}

pub(crate) async fn content(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    Id(id): Id,
) -> Result<Response, ApiError> {
    let file = owned_file(&api, &tenant, &id).await?;
    let object = api.storage.get(&file.storage_key()).await?;
    let stream = object.stream.map_err(std::io::Error::other);
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
            (header::CONTENT_LENGTH, object.size.to_string()),
            (
                header::CONTENT_DISPOSITION,
                format!(
                    "attachment; filename=\"{}\"",
                    file.file.filename.replace('"', "")
                ),
            ),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

pub(crate) async fn delete(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    Id(id): Id,
) -> Result<Json<serde_json::Value>, ApiError> {
    let file = owned_file(&api, &tenant, &id).await?;
    api.storage.delete(&file.storage_key()).await?;
    api.store.delete_file(&file).await?;
    tracing::info!(file = %id, tenant = %tenant.0, "file deleted");
    Ok(Json(
        serde_json::json!({"id": id, "object": "file", "deleted": true}),
    ))
}

#[derive(Debug, Deserialize)]
pub(crate) struct ListQuery {
    after: Option<String>,
    limit: Option<i64>,
    order: Option<String>,
    purpose: Option<String>,
}

pub(crate) async fn list(
    State(api): State<Arc<Api>>,
    tenant: Tenant,
    ListParams(q): ListParams<ListQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let limit = limit(q.limit, 10_000, 10_000)?;
    let order = match q.order.as_deref() {
        None | Some("desc") => Order::Desc,
        Some("asc") => Order::Asc,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("order must be 'asc' or 'desc', got {other:?}."),
                Some("order"),
            ))
        }
    };
    let page = api
        .store
        .list_files(
            &tenant.0,
            q.purpose.as_deref(),
            q.after.as_deref().map(Cursor::parse).as_ref(),
            limit,
            order,
        )
        .await?;
    let files: Vec<FileObject> = page
        .data
        .into_iter()
        .map(|f| f.file)
        .filter(|f| !expired(f))
        .collect();
    let ids = files.iter().map(|f| f.id.clone()).collect();
    Ok(Json(list_body(files, ids, page.has_more)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The count a byte at a time, as a state machine.
    fn lines_one_byte_at_a_time(text: &[u8]) -> u64 {
        let (mut lines, mut in_line) = (0, false);
        for &b in text {
            match b {
                b'\n' => in_line = false,
                b' ' | b'\t' | b'\r' => {}
                _ if !in_line => {
                    in_line = true;
                    lines += 1;
                }
                _ => {}
            }
        }
        lines
    }

    proptest! {
        #[test]
        fn counts_lines_across_any_chunking(
            text in prop::collection::vec(prop::sample::select(b"\n \t\rx{".to_vec()), 0..200),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
        ) {
            let mut at: Vec<usize> = cuts.iter().map(|c| c.index(text.len() + 1)).collect();
            at.sort_unstable();
            let mut counter = LineCounter::default();
            let mut start = 0;
            for end in at.into_iter().chain([text.len()]) {
                counter.feed(&text[start..end]);
                start = end;
            }
            prop_assert_eq!(counter.lines, lines_one_byte_at_a_time(&text));
        }
    }

    #[test]
    fn counts_request_lines_only() {
        let mut counter = LineCounter::default();
        counter.feed(b"{\"a\":1}\n \r\n\t\n{\"b\"");
        counter.feed(b":2}\n{}");
        assert_eq!(counter.lines, 3);
    }
}
