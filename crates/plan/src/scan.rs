//! The usual valid line, read by hand in one pass over its bytes.
//!
//! Most of a line is message text, which [`batch_wire::json`] skips 32 bytes at a time, where
//! serde looks at each byte through its visitors. Anything this reading does not expect (an
//! invalid line, an escaped key, a repeated field, a message of an odd shape) gives `None`, and
//! the caller reads the line with serde as before: so every answer, and every error message, is
//! serde's. The tests hold the two readings to the same answer, line by line.

use std::borrow::Cow;

use batch_wire::json::{self, elements, members, string};

use crate::rules;
use crate::validate::{CheckedLine, NO_PREFIX};

/// The line's check when it is valid and of the usual shape; `None` otherwise.
pub(crate) fn valid_line(text: &str) -> Option<CheckedLine<'_>> {
    let s = text.as_bytes();
    let (mut custom_id, mut method, mut url, mut body) = (None, None, None, None);
    let end = members(s, json::skip_ws(s, 0), |key, i| {
        let slot = match key {
            b"custom_id" => &mut custom_id,
            b"method" => &mut method,
            b"url" => &mut url,
            b"body" if body.is_none() => {
                let (b, end) = request_body(text, i)?;
                body = Some(b);
                return Some(end);
            }
            b"body" => return None,
            _ => return json::value_end(s, i).ok(),
        };
        // A repeated field is serde's to refuse.
        if slot.is_some() {
            return None;
        }
        let (value, end) = string(text, i)?;
        *slot = Some(value);
        Some(end)
    })?;
    if json::skip_ws(s, end) != s.len() {
        return None;
    }
    let (custom_id, url, body) = (custom_id?, url?, body?);
    let valid =
        rules::named(&custom_id) && rules::method_allowed(&method?) && rules::url_allowed(&url);
    valid.then_some(CheckedLine {
        custom_id,
        model: body.model,
        url,
        prefix_hash: body.prefix_hash,
    })
}

/// A valid request body.
struct RequestBody<'a> {
    model: Cow<'a, str>,
    prefix_hash: u32,
}

/// The body at `s[i]`: an object with a non-blank `model`, no `stream: true`, and `messages`
/// (when there) a list of message objects.
fn request_body(text: &str, i: usize) -> Option<(RequestBody<'_>, usize)> {
    let s = text.as_bytes();
    let (mut model, mut stream, mut prefix) = (None, false, None);
    let end = members(s, i, |key, i| match key {
        b"model" if model.is_none() => {
            let (m, end) = string(text, i)?;
            model = Some(m);
            Some(end)
        }
        b"stream" if !stream => {
            stream = true;
            let end = json::value_end(s, i).ok()?;
            (!rules::streams(&s[i..end])).then_some(end)
        }
        b"messages" if prefix.is_none() => {
            let (hash, end) = messages(text, i)?;
            prefix = Some(hash);
            Some(end)
        }
        b"model" | b"stream" | b"messages" => None,
        _ => json::value_end(s, i).ok(),
    })?;
    let model = model.filter(|m| rules::named(m))?;
    let prefix_hash = prefix.unwrap_or(NO_PREFIX);
    Some((RequestBody { model, prefix_hash }, end))
}

/// The prefix hash of the message list at `s[i]`: of the first system message with text.
fn messages(text: &str, i: usize) -> Option<(u32, usize)> {
    let s = text.as_bytes();
    let mut hash = None;
    let end = elements(s, i, |i| {
        let (mut role, mut content) = (None, None);
        let end = members(s, i, |key, i| match key {
            b"role" if role.is_none() => {
                if let Some(end) = null(s, i) {
                    role = Some(None);
                    return Some(end);
                }
                let (r, end) = string(text, i)?;
                role = Some(Some(r));
                Some(end)
            }
            b"content" if content.is_none() => {
                let end = json::value_end(s, i).ok()?;
                content = Some(i..end);
                Some(end)
            }
            b"role" | b"content" => None,
            _ => json::value_end(s, i).ok(),
        })?;
        if hash.is_none() && role.flatten().as_deref() == Some("system") {
            if let Some(content) = content {
                hash = content_hash(text, content.start)?;
            }
        }
        Some(end)
    })?;
    Some((hash.unwrap_or(NO_PREFIX), end))
}

/// The hash of a system message's `content` at `s[i]`: `Some(None)` when it has no text.
fn content_hash(text: &str, i: usize) -> Option<Option<u32>> {
    let s = text.as_bytes();
    let prompt = match s.get(i) {
        Some(b'"') => string(text, i)?.0,
        Some(b'[') => {
            let mut joined = String::new();
            elements(s, i, |i| {
                let mut seen = false;
                members(s, i, |key, i| match key {
                    b"text" if !seen => {
                        seen = true;
                        if let Some(end) = null(s, i) {
                            return Some(end);
                        }
                        let (part, end) = string(text, i)?;
                        joined.push_str(&part);
                        Some(end)
                    }
                    b"text" => None,
                    _ => json::value_end(s, i).ok(),
                })
            })?;
            Cow::Owned(joined)
        }
        // `null` is no content; other values have no text.
        _ => return Some(None),
    };
    Some(rules::prompt_hash(&prompt))
}

/// The index after a `null` at `s[i]` (the walker checks what follows it).
fn null(s: &[u8], i: usize) -> Option<usize> {
    (s.get(i..i + 4) == Some(b"null")).then_some(i + 4)
}
