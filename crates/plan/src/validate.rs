//! Checks one input line and extracts what planning needs from it.

use std::borrow::Cow;

use batch_wire::{error_codes, BatchError, ALLOWED_URLS};
use serde::Deserialize;
use serde_json::value::RawValue;

/// What planning keeps of a valid line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedLine<'a> {
    /// The caller's id.
    pub custom_id: Cow<'a, str>,
    /// The request's model.
    pub model: Cow<'a, str>,
    /// The request path, one of [`ALLOWED_URLS`].
    pub url: Cow<'a, str>,
    /// FNV-1a 32 of the first non-empty system message, or `u32::MAX` when there is none.
    pub prefix_hash: u32,
}

/// The value of `prefix_hash` for requests without a system prompt.
pub const NO_PREFIX: u32 = u32::MAX;

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
pub fn check_line(text: &str, line_no: u64) -> Result<CheckedLine<'_>, Vec<BatchError>> {
    // serde would read a JSON array into the struct's fields in order: only objects are lines.
    let parsed = match text.trim_start().starts_with('{') {
        true => serde_json::from_str::<LineView>(text).map_err(|e| e.to_string()),
        false => Err("expected a JSON object".to_owned()),
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
            "custom_id is required and must be a non-empty string",
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

#[cfg(test)]
mod tests {
    use super::*;

    fn codes(text: &str) -> Vec<String> {
        check_line(text, 1)
            .unwrap_err()
            .into_iter()
            .map(|e| e.code)
            .collect()
    }

    #[test]
    fn accepts_the_reference_line() {
        let line = r#"{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}"#;
        let c = check_line(line, 1).unwrap();
        assert_eq!((c.custom_id.as_ref(), c.model.as_ref()), ("r1", "m"));
        assert_eq!(c.url, "/v1/chat/completions");
        assert_eq!(c.prefix_hash, NO_PREFIX);
    }

    #[test]
    fn hashes_the_first_nonempty_system_prompt_in_either_form() {
        let text = r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"m","messages":[{"role":"system","content":""},{"role":"system","content":"be brief"},{"role":"user","content":"x"}]}}"#;
        let parts = r#"{"custom_id":"b","method":"POST","url":"/v1/chat/completions","body":{"model":"m","messages":[{"role":"system","content":[{"type":"text","text":"be "},{"type":"text","text":"brief"}]}]}}"#;
        let expected = batch_wire::hash::fnv1a_32(b"be brief");
        assert_eq!(check_line(text, 1).unwrap().prefix_hash, expected);
        assert_eq!(check_line(parts, 1).unwrap().prefix_hash, expected);
    }

    #[test]
    fn array_content_in_user_messages_is_fine() {
        let line = r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:x"}}]}]}}"#;
        assert!(check_line(line, 1).is_ok());
    }

    #[test]
    fn names_every_problem_of_a_line() {
        let all_wrong = r#"{"custom_id":"","method":"GET","url":"/v2/x","body":{"stream":true}}"#;
        assert_eq!(
            codes(all_wrong),
            [
                error_codes::MISSING_CUSTOM_ID,
                error_codes::INVALID_METHOD,
                error_codes::INVALID_URL,
                error_codes::MISSING_MODEL,
                error_codes::STREAMING_NOT_SUPPORTED
            ]
        );
    }

    #[test]
    fn refuses_malformed_lines() {
        assert_eq!(codes("not json"), [error_codes::INVALID_JSON_LINE]);
        assert_eq!(codes(""), [error_codes::INVALID_JSON_LINE]);
        assert_eq!(codes("[1]"), [error_codes::INVALID_JSON_LINE]);
        assert_eq!(
            codes(r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":"x"}"#),
            [error_codes::INVALID_JSON_LINE]
        );
        assert_eq!(
            codes(
                r#"{"custom_id":7,"method":"POST","url":"/v1/completions","body":{"model":"m"}}"#
            ),
            [error_codes::MISSING_CUSTOM_ID]
        );
        assert_eq!(
            codes(
                r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"  "}}"#
            ),
            [error_codes::MISSING_MODEL]
        );
    }

    #[test]
    fn stream_false_is_allowed() {
        let line = r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"m","stream":false}}"#;
        assert!(check_line(line, 1).is_ok());
    }

    #[test]
    fn errors_carry_the_line_number() {
        let errs = check_line("{", 17).unwrap_err();
        assert_eq!(errs[0].line, Some(17));
    }
}
