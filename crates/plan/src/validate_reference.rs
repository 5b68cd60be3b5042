//! The validator as it was before the single-pass one: the oracle its tests compare with.

use std::borrow::Cow;

use batch_wire::{error_codes, BatchError, ALLOWED_URLS};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{CheckedLine, NO_PREFIX};

#[derive(Deserialize)]
struct LineView<'a> {
    #[serde(borrow, default)]
    custom_id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    method: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    url: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    body: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct BodyView<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct MessageView<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Parts(#[serde(borrow)] Vec<PartView<'a>>),
}

#[derive(Deserialize)]
struct PartView<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

fn error(code: &str, message: impl Into<String>, param: Option<&str>, line: u64) -> BatchError {
    BatchError {
        code: code.to_owned(),
        message: message.into(),
        param: param.map(str::to_owned),
        line: Some(line),
    }
}

fn as_nonempty_str(raw: Option<&RawValue>) -> Option<Cow<'_, str>> {
    let s: Cow<str> = serde_json::from_str(raw?.get()).ok()?;
    (!s.trim().is_empty()).then_some(s)
}

/// Checks a line (without its newline) as OpenAI does; `line_no` is 1-based, for the errors.
///
/// Returns every problem of the line, not just the first.
pub(super) fn check_line(text: &str, line_no: u64) -> Result<CheckedLine<'_>, Vec<BatchError>> {
    // serde would read a JSON array into the struct's fields in order: only objects are lines.
    let parsed = match text.trim_start().starts_with('{') {
        true => serde_json::from_str::<LineView>(text).map_err(|e| e.to_string()),
        false => Err(super::not_an_object(text)),
    };
    let view = match parsed {
        Ok(v) => v,
        Err(e) => {
            let what = if text.trim().is_empty() {
                "the line is empty".to_owned()
            } else {
                format!("the line is not a JSON object of the batch format: {e}")
            };
            return Err(vec![error(
                error_codes::INVALID_JSON_LINE,
                what,
                None,
                line_no,
            )]);
        }
    };
    let mut errors = Vec::new();
    let custom_id = as_nonempty_str(view.custom_id);
    if custom_id.is_none() {
        errors.push(error(
            error_codes::MISSING_CUSTOM_ID,
            super::custom_id_problem(view.custom_id),
            Some("custom_id"),
            line_no,
        ));
    }
    if view.method.as_deref() != Some("POST") {
        errors.push(error(
            error_codes::INVALID_METHOD,
            format!(
                "method must be POST, got {}",
                view.method
                    .as_deref()
                    .map_or("nothing".into(), |m| format!("{m:?}"))
            ),
            Some("method"),
            line_no,
        ));
    }
    let url_ok = view
        .url
        .as_deref()
        .is_some_and(|u| ALLOWED_URLS.contains(&u));
    if !url_ok {
        errors.push(error(
            error_codes::INVALID_URL,
            format!(
                "url must be one of {}, got {}",
                ALLOWED_URLS.join(", "),
                view.url
                    .as_deref()
                    .map_or("nothing".into(), |u| format!("{u:?}"))
            ),
            Some("url"),
            line_no,
        ));
    }
    let body = view
        .body
        .filter(|b| b.get().trim_start().starts_with('{'))
        .and_then(|b| serde_json::from_str::<BodyView>(b.get()).ok());
    let mut model = None;
    let mut prefix_hash = NO_PREFIX;
    match body {
        None => errors.push(error(
            error_codes::INVALID_JSON_LINE,
            "body is required and must be a JSON object",
            Some("body"),
            line_no,
        )),
        Some(body) => {
            model = as_nonempty_str(body.model);
            if model.is_none() {
                errors.push(error(
                    error_codes::MISSING_MODEL,
                    "body.model is required and must be a non-empty string",
                    Some("body.model"),
                    line_no,
                ));
            }
            if body.stream.is_some_and(|s| s.get() == "true") {
                errors.push(error(
                    error_codes::STREAMING_NOT_SUPPORTED,
                    "body.stream: streaming is not supported in batch requests",
                    Some("body.stream"),
                    line_no,
                ));
            }
            prefix_hash = system_prompt_hash(body.messages);
        }
    }
    match (errors.is_empty(), custom_id, model, view.url) {
        (true, Some(custom_id), Some(model), Some(url)) => Ok(CheckedLine {
            custom_id,
            model,
            url,
            prefix_hash,
        }),
        _ => Err(errors),
    }
}

/// Hashes the first system message with non-empty text; messages the gateway may still refuse
/// (odd shapes) are not our business here, they simply get no prefix.
fn system_prompt_hash(messages: Option<&RawValue>) -> u32 {
    let Some(messages) = messages else {
        return NO_PREFIX;
    };
    let Ok(messages) = serde_json::from_str::<Vec<MessageView>>(messages.get()) else {
        return NO_PREFIX;
    };
    for m in messages {
        if m.role.as_deref() != Some("system") {
            continue;
        }
        let Some(content) = m.content else { continue };
        let text = match serde_json::from_str::<Content>(content.get()) {
            Ok(Content::Text(t)) => t.into_owned(),
            Ok(Content::Parts(parts)) => parts.into_iter().filter_map(|p| p.text).collect(),
            Err(_) => continue,
        };
        if !text.is_empty() {
            return batch_wire::hash::fnv1a_32(text.as_bytes());
        }
    }
    NO_PREFIX
}
