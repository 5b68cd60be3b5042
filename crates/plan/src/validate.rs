//! Checks one input line and extracts what planning needs from it.

use std::borrow::Cow;

use batch_wire::{error_codes, BatchError, ALLOWED_URLS};
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::rules;

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
    body: Option<Body<'a>>,
}

/// The line's `body`, read in the same pass as the line: each byte of a request is scanned
/// once, where a `RawValue` per level (line, body, messages) scanned the messages three times.
enum Body<'a> {
    /// A JSON object, without duplicate fields among those read.
    Object(BodyView<'a>),
    /// Anything else.
    Other,
}

struct BodyView<'a> {
    model: Option<&'a RawValue>,
    stream: Option<&'a RawValue>,
    prefix_hash: u32,
}

impl<'de: 'a, 'a> Deserialize<'de> for Body<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(BodyVisitor)
    }
}

struct BodyVisitor;

impl<'de> Visitor<'de> for BodyVisitor {
    type Value = Body<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a request body")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Body<'de>, A::Error> {
        let (mut model, mut stream, mut messages) = (None, None, None);
        // A repeated field makes the body invalid, as it would for a derived struct.
        let mut repeated = false;
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            match key.as_ref() {
                "model" => {
                    repeated |= model
                        .replace(map.next_value::<Option<&RawValue>>()?)
                        .is_some()
                }
                "stream" => {
                    repeated |= stream
                        .replace(map.next_value::<Option<&RawValue>>()?)
                        .is_some()
                }
                "messages" => repeated |= messages.replace(map.next_value::<Messages>()?).is_some(),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if repeated {
            return Ok(Body::Other);
        }
        Ok(Body::Object(BodyView {
            model: model.flatten(),
            stream: stream.flatten(),
            prefix_hash: messages.map_or(NO_PREFIX, |m| m.0),
        }))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Body<'de>, A::Error> {
        skip_seq(seq).map(|()| Body::Other)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Body<'de>, E> {
        Ok(Body::Other)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Body<'de>, E> {
        Ok(Body::Other)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Body<'de>, E> {
        Ok(Body::Other)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Body<'de>, E> {
        Ok(Body::Other)
    }
    fn visit_str<E>(self, _: &str) -> Result<Body<'de>, E> {
        Ok(Body::Other)
    }
    fn visit_unit<E>(self) -> Result<Body<'de>, E> {
        Ok(Body::Other)
    }
}

fn skip_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

fn skip_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// `body.messages` reduced to the hash of its first non-empty system prompt ([`NO_PREFIX`] when
/// there is none, or when `messages` is not an array of message objects).
struct Messages(u32);

impl<'de> Deserialize<'de> for Messages {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(MessagesVisitor)
    }
}

struct MessagesVisitor;

impl<'de> Visitor<'de> for MessagesVisitor {
    type Value = Messages;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("messages")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Messages, A::Error> {
        let mut hash = None;
        let mut valid = true;
        while let Some(m) = seq.next_element::<Message>()? {
            match m {
                Message::Valid { role, content } if valid && hash.is_none() => {
                    if role.as_deref() == Some("system") {
                        hash = content.and_then(content_hash);
                    }
                }
                Message::Valid { .. } => {}
                Message::Invalid => valid = false,
            }
        }
        Ok(Messages(hash.filter(|_| valid).unwrap_or(NO_PREFIX)))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Messages, A::Error> {
        skip_map(map).map(|()| Messages(NO_PREFIX))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Messages, E> {
        Ok(Messages(NO_PREFIX))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Messages, E> {
        Ok(Messages(NO_PREFIX))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Messages, E> {
        Ok(Messages(NO_PREFIX))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Messages, E> {
        Ok(Messages(NO_PREFIX))
    }
    fn visit_str<E>(self, _: &str) -> Result<Messages, E> {
        Ok(Messages(NO_PREFIX))
    }
    fn visit_unit<E>(self) -> Result<Messages, E> {
        Ok(Messages(NO_PREFIX))
    }
}

/// One element of `messages`: an object whose `role` is a string or null, each of `role` and
/// `content` at most once; anything else is `Invalid` (and the whole list gets no prefix).
enum Message<'a> {
    Valid {
        role: Option<Cow<'a, str>>,
        content: Option<&'a RawValue>,
    },
    Invalid,
}

impl<'de: 'a, 'a> Deserialize<'de> for Message<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(MessageVisitor)
    }
}

struct MessageVisitor;

impl<'de> Visitor<'de> for MessageVisitor {
    type Value = Message<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a message")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Message<'de>, A::Error> {
        let (mut role, mut content) = (None, None);
        let mut valid = true;
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            match key.as_ref() {
                "role" => match map.next_value::<Text>()? {
                    Text::Str(r) => valid &= role.replace(Some(r)).is_none(),
                    Text::Null => valid &= role.replace(None).is_none(),
                    Text::Other => valid = false,
                },
                "content" => {
                    valid &= content
                        .replace(map.next_value::<Option<&RawValue>>()?)
                        .is_none()
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(match valid {
            true => Message::Valid {
                role: role.flatten(),
                content: content.flatten(),
            },
            false => Message::Invalid,
        })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Message<'de>, A::Error> {
        skip_seq(seq).map(|()| Message::Invalid)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Message<'de>, E> {
        Ok(Message::Invalid)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Message<'de>, E> {
        Ok(Message::Invalid)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Message<'de>, E> {
        Ok(Message::Invalid)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Message<'de>, E> {
        Ok(Message::Invalid)
    }
    fn visit_str<E>(self, _: &str) -> Result<Message<'de>, E> {
        Ok(Message::Invalid)
    }
    fn visit_unit<E>(self) -> Result<Message<'de>, E> {
        Ok(Message::Invalid)
    }
}

/// A value that should be a string.
enum Text<'a> {
    Str(Cow<'a, str>),
    Null,
    Other,
}

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TextVisitor)
    }
}

struct TextVisitor;

impl<'de> Visitor<'de> for TextVisitor {
    type Value = Text<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string")
    }

    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Text<'de>, E> {
        Ok(Text::Str(Cow::Borrowed(s)))
    }
    fn visit_str<E>(self, s: &str) -> Result<Text<'de>, E> {
        Ok(Text::Str(Cow::Owned(s.to_owned())))
    }
    fn visit_string<E>(self, s: String) -> Result<Text<'de>, E> {
        Ok(Text::Str(Cow::Owned(s)))
    }
    fn visit_unit<E>(self) -> Result<Text<'de>, E> {
        Ok(Text::Null)
    }
    fn visit_none<E>(self) -> Result<Text<'de>, E> {
        Ok(Text::Null)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Text<'de>, A::Error> {
        skip_map(map).map(|()| Text::Other)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Text<'de>, A::Error> {
        skip_seq(seq).map(|()| Text::Other)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Text<'de>, E> {
        Ok(Text::Other)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Text<'de>, E> {
        Ok(Text::Other)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Text<'de>, E> {
        Ok(Text::Other)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Text<'de>, E> {
        Ok(Text::Other)
    }
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

/// Why a line that does not start with `{` is not one: a byte order mark is named, since an
/// editor adds it unseen and "expected a JSON object" would not say what to remove.
pub(crate) fn not_an_object(text: &str) -> String {
    match text.starts_with('\u{feff}') {
        true => "expected a JSON object, found a UTF-8 byte order mark (U+FEFF) first: save the file without one".to_owned(),
        false => "expected a JSON object".to_owned(),
    }
}

/// Why `custom_id` cannot be used: absent, empty or not a string, or a string no JSON reader
/// can decode (an escaped lone surrogate such as `\ud800`), which is not a missing one.
pub(crate) fn custom_id_problem(raw: Option<&RawValue>) -> &'static str {
    match raw.map(|r| r.get().trim_start()) {
        Some(t) if t.starts_with('"') && serde_json::from_str::<Cow<str>>(t).is_err() => {
            "custom_id is not valid Unicode: it holds an escaped lone surrogate such as \\ud800"
        }
        _ => "custom_id is required and must be a non-empty string",
    }
}

fn as_nonempty_str(raw: Option<&RawValue>) -> Option<Cow<'_, str>> {
    let s: Cow<str> = serde_json::from_str(raw?.get()).ok()?;
    rules::named(&s).then_some(s)
}

/// Checks a line (without its newline) as OpenAI does; `line_no` is 1-based, for the errors.
///
/// Returns every problem of the line, not just the first.
pub fn check_line(text: &str, line_no: u64) -> Result<CheckedLine<'_>, Vec<BatchError>> {
    match crate::scan::valid_line(text) {
        Some(line) => Ok(line),
        None => check_line_with_serde(text, line_no),
    }
}

/// [`check_line`] through serde's visitors: every line the hand reading does not take, and the
/// reference the tests hold that reading to (public for the benchmark that compares the two).
pub fn check_line_with_serde(text: &str, line_no: u64) -> Result<CheckedLine<'_>, Vec<BatchError>> {
    let view = read_view(text, line_no).map_err(|e| vec![e])?;
    let mut errors = Vec::new();
    let custom_id = check_custom_id(view.custom_id, line_no, &mut errors);
    check_method(view.method.as_deref(), line_no, &mut errors);
    check_url(view.url.as_deref(), line_no, &mut errors);
    let (model, prefix_hash) = check_body(view.body, line_no, &mut errors);
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

/// The line read as a JSON object of the batch format, or the one error saying it is not.
fn read_view(text: &str, line_no: u64) -> Result<LineView<'_>, BatchError> {
    // serde would read a JSON array into the struct's fields in order: only objects are lines.
    let parsed = match text.trim_start().starts_with('{') {
        true => serde_json::from_str::<LineView>(text).map_err(|e| e.to_string()),
        false => Err(not_an_object(text)),
    };
    parsed.map_err(|e| {
        let what = if text.trim().is_empty() {
            "the line is empty".to_owned()
        } else {
            format!("the line is not a JSON object of the batch format: {e}")
        };
        error(error_codes::INVALID_JSON_LINE, what, None, line_no)
    })
}

/// The line's `custom_id` when it names something; else its problem joins `errors`.
fn check_custom_id<'a>(
    raw: Option<&'a RawValue>,
    line_no: u64,
    errors: &mut Vec<BatchError>,
) -> Option<Cow<'a, str>> {
    let custom_id = as_nonempty_str(raw);
    if custom_id.is_none() {
        errors.push(error(
            error_codes::MISSING_CUSTOM_ID,
            custom_id_problem(raw),
            Some("custom_id"),
            line_no,
        ));
    }
    custom_id
}

/// Notes in `errors` a `method` other than the one allowed.
fn check_method(method: Option<&str>, line_no: u64, errors: &mut Vec<BatchError>) {
    if !method.is_some_and(rules::method_allowed) {
        errors.push(error(
            error_codes::INVALID_METHOD,
            format!(
                "method must be {}, got {}",
                rules::METHOD,
                method.map_or("nothing".into(), |m| format!("{m:?}"))
            ),
            Some("method"),
            line_no,
        ));
    }
}

/// Notes in `errors` a `url` other than the allowed ones.
fn check_url(url: Option<&str>, line_no: u64, errors: &mut Vec<BatchError>) {
    if !url.is_some_and(rules::url_allowed) {
        errors.push(error(
            error_codes::INVALID_URL,
            format!(
                "url must be one of {}, got {}",
                ALLOWED_URLS.join(", "),
                url.map_or("nothing".into(), |u| format!("{u:?}"))
            ),
            Some("url"),
            line_no,
        ));
    }
}

/// The body's model and prefix hash; a body that is not an object, a missing model or a
/// request to stream joins `errors`.
fn check_body<'a>(
    body: Option<Body<'a>>,
    line_no: u64,
    errors: &mut Vec<BatchError>,
) -> (Option<Cow<'a, str>>, u32) {
    let Some(Body::Object(body)) = body else {
        errors.push(error(
            error_codes::INVALID_JSON_LINE,
            "body is required and must be a JSON object",
            Some("body"),
            line_no,
        ));
        return (None, NO_PREFIX);
    };
    let model = as_nonempty_str(body.model);
    if model.is_none() {
        errors.push(error(
            error_codes::MISSING_MODEL,
            "body.model is required and must be a non-empty string",
            Some("body.model"),
            line_no,
        ));
    }
    if body
        .stream
        .is_some_and(|s| rules::streams(s.get().as_bytes()))
    {
        errors.push(error(
            error_codes::STREAMING_NOT_SUPPORTED,
            "body.stream: streaming is not supported in batch requests",
            Some("body.stream"),
            line_no,
        ));
    }
    (model, body.prefix_hash)
}

/// The hash of a system message's text (a string, or the concatenated `text` of its parts),
/// `None` when it has none; shapes the gateway may still refuse are not our business here, they
/// simply get no prefix.
fn content_hash(content: &RawValue) -> Option<u32> {
    let raw = content.get();
    let text: Cow<str> = match raw.as_bytes().first() {
        Some(b'"') => serde_json::from_str(raw).ok()?,
        Some(b'[') => serde_json::from_str::<Vec<PartView>>(raw)
            .ok()?
            .into_iter()
            .filter_map(|p| p.text)
            .collect::<String>()
            .into(),
        _ => return None,
    };
    rules::prompt_hash(&text)
}

#[cfg(test)]
#[path = "validate_reference.rs"]
mod reference;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One JSON value out of a few, the first most often; `""` leaves the field out.
    fn pick(options: &'static [&'static str]) -> impl Strategy<Value = Option<&'static str>> {
        prop_oneof![2 => Just(options[0]), 1 => prop::sample::select(options)]
            .prop_map(|s| (!s.is_empty()).then_some(s))
    }

    fn object(fields: Vec<(&'static str, Option<String>)>) -> String {
        let parts: Vec<String> = fields
            .into_iter()
            .filter_map(|(k, v)| Some(format!("{k:?}: {}", v?)))
            .collect();
        format!("{{{}}}", parts.join(", "))
    }

    fn message() -> impl Strategy<Value = String> {
        (
            pick(&[
                r#""system""#,
                "",
                r#""user""#,
                "null",
                "3",
                r#""sys\u0074em""#,
            ]),
            pick(&[
                r#""be brief""#,
                "",
                r#""""#,
                "null",
                "7",
                r#"{"text":"x"}"#,
                r#"[{"type":"text","text":"be "},{"text":"brief"}]"#,
                r#"[{"type":"image_url"}]"#,
                r#"["be brief"]"#,
                r#"[]"#,
            ]),
            pick(&["", r#""x""#, r#"{"a":[1,{"b":null}]}"#]),
            prop::bool::weighted(0.1),
        )
            .prop_map(|(role, content, extra, repeat)| {
                let mut fields = vec![
                    ("role", role.map(str::to_owned)),
                    ("name", extra.map(str::to_owned)),
                    ("content", content.map(str::to_owned)),
                ];
                if repeat {
                    fields.push(("role", Some(r#""user""#.into())));
                }
                object(fields)
            })
    }

    fn messages() -> impl Strategy<Value = Option<String>> {
        prop_oneof![
            4 => prop::collection::vec(message(), 0..4).prop_map(|m| Some(format!("[{}]", m.join(",")))),
            1 => pick(&["", "null", r#""hi""#, r#"{"role":"system","content":"x"}"#, "[1]", r#"["system"]"#])
                .prop_map(|m| m.map(str::to_owned)),
        ]
    }

    fn body() -> impl Strategy<Value = Option<String>> {
        let object_body = (
            pick(&[
                r#""m""#,
                "",
                r#""  ""#,
                "null",
                "5",
                r#""Qwen/Qwen3-0.6B""#,
                r#""m\u00e9""#,
            ]),
            pick(&["", "true", "false", "null", r#""true""#]),
            messages(),
            pick(&["", "128", r#"{"deep":[[],{}]}"#]),
            pick(&["", "model", "stream", "messages"]),
        )
            .prop_map(|(model, stream, messages, extra, repeated)| {
                let mut fields = vec![
                    ("model", model.map(str::to_owned)),
                    ("messages", messages),
                    ("max_tokens", extra.map(str::to_owned)),
                    ("stream", stream.map(str::to_owned)),
                ];
                if let Some(repeated) = repeated {
                    fields.push((repeated, Some("null".into())));
                }
                Some(object(fields))
            });
        prop_oneof![
            6 => object_body,
            1 => pick(&["", "null", r#""x""#, "[1,2]", "3", "{}"]).prop_map(|b| b.map(str::to_owned)),
        ]
    }

    fn line() -> impl Strategy<Value = String> {
        (
            pick(&[r#""r1""#, "", r#""""#, r#""  ""#, "7", "null", r#""r\n2""#]),
            pick(&[r#""POST""#, "", r#""GET""#, "null"]),
            pick(&[
                r#""/v1/chat/completions""#,
                "",
                r#""/v1/completions""#,
                r#""/v2/x""#,
                "1",
            ]),
            body(),
            prop::bool::ANY,
        )
            .prop_map(|(custom_id, method, url, body, spaced)| {
                let line = object(vec![
                    ("custom_id", custom_id.map(str::to_owned)),
                    ("method", method.map(str::to_owned)),
                    ("url", url.map(str::to_owned)),
                    ("body", body),
                ]);
                match spaced {
                    true => format!("  {line} "),
                    false => line.replace(": ", ":").replace(", ", ","),
                }
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// The single-pass validator says exactly what the one before it said.
        #[test]
        fn agrees_with_the_reference_validator(line in line()) {
            prop_assert_eq!(check_line(&line, 3), reference::check_line(&line, 3), "{}", line);
        }
    }

    /// Where the hand reading takes a line, it says what serde says.
    fn same_as_serde(line: &str) -> Result<bool, TestCaseError> {
        let serde = check_line_with_serde(line, 3);
        match crate::scan::valid_line(line) {
            Some(hand) => {
                prop_assert_eq!(Ok(hand), serde, "{}", line);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        #[test]
        fn the_hand_reading_agrees_with_serde(line in line()) {
            same_as_serde(&line)?;
        }

        /// Any damage to a line is judged as serde judges it.
        #[test]
        fn damaged_lines_are_judged_as_serde_judges_them(
            line in line(),
            at in any::<usize>(),
            byte in prop::sample::select(b"\"\\,:[]{} untfe1-.\x01".to_vec()),
            mode in 0..3u8,
        ) {
            let mut bytes = line.into_bytes();
            batch_testkit::damage(&mut bytes, at, byte, mode);
            if let Ok(line) = String::from_utf8(bytes) {
                same_as_serde(&line)?;
                prop_assert_eq!(check_line(&line, 3), check_line_with_serde(&line, 3));
            }
        }
    }

    #[test]
    fn the_hand_reading_takes_the_usual_lines_and_leaves_the_odd_ones() {
        let taken = [
            r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"m"}}"#,
            r#" { "custom_id" : "a\u00e9" , "method" : "PO\u0053T" , "url" : "/v1/completions" , "body" : { "model" : "m" , "stream" : false } } "#,
            r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"m","x":"\ud800","messages":[]},"extra":[{"\ud800":1}]}"#,
            r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"m","messages":[{"role":null,"content":"x"},{"role":"system","content":null},{"role":"system","content":[{"type":"text","text":null},{"text":"be"}]}]}}"#,
            r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"m","messages":[{"role":"system","content":7},{"role":"system","content":"x"}]}}"#,
        ];
        let left = [
            // An escaped key, a repeated field, a lone surrogate read as text.
            r#"{"custom_\u0069d":"a","method":"POST","url":"/v1/completions","body":{"model":"m"}}"#,
            r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"m","model":"n"}}"#,
            r#"{"custom_id":"\ud800","method":"POST","url":"/v1/completions","body":{"model":"m"}}"#,
            // Odd messages: not a list, a role that is no string, a part that is no object.
            r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"m","messages":null}}"#,
            r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"m","messages":[{"role":1}]}}"#,
            r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"m","messages":[{"role":"system","content":["x"]}]}}"#,
            // Invalid lines.
            r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"m","stream":true}}"#,
            r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"m"}} x"#,
            "\u{a0}{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"model\":\"m\"}}",
            r#"{"custom_id":" ","method":"POST","url":"/v1/completions","body":{"model":"m"}}"#,
        ];
        for line in taken {
            assert!(crate::scan::valid_line(line).is_some(), "{line}");
            assert!(same_as_serde(line).unwrap(), "{line}");
        }
        for line in left {
            assert!(crate::scan::valid_line(line).is_none(), "{line}");
            assert_eq!(
                check_line(line, 3),
                check_line_with_serde(line, 3),
                "{line}"
            );
        }
    }

    #[test]
    fn the_generated_lines_cover_both_answers_and_prefixes() {
        use proptest::strategy::ValueTree;
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let (mut ok, mut hashed, mut bad) = (0, 0, 0);
        let (mut hand_ok, mut hand_hashed) = (0, 0);
        for _ in 0..2000 {
            let line = line().new_tree(&mut runner).unwrap().current();
            match check_line(&line, 1) {
                Ok(c) if c.prefix_hash != NO_PREFIX => hashed += 1,
                Ok(_) => ok += 1,
                Err(_) => bad += 1,
            }
            match crate::scan::valid_line(&line) {
                Some(c) if c.prefix_hash != NO_PREFIX => hand_hashed += 1,
                Some(_) => hand_ok += 1,
                None => {}
            }
        }
        assert!(ok > 20 && hashed > 20 && bad > 20, "{ok} {hashed} {bad}");
        // The hand reading takes most valid lines, with and without a prefix.
        assert!(
            hand_ok * 2 > ok && hand_hashed * 2 > hashed,
            "{hand_ok} of {ok}, {hand_hashed} of {hashed}"
        );
    }

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

    #[test]
    fn a_byte_order_mark_is_named() {
        let line = "\u{feff}{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"model\":\"m\"}}";
        let errs = check_line(line, 1).unwrap_err();
        assert!(errs[0].message.contains("byte order mark"), "{errs:?}");
        assert_eq!(errs, reference::check_line(line, 1).unwrap_err());
    }

    #[test]
    fn a_custom_id_with_a_lone_surrogate_is_not_called_missing() {
        let line = r#"{"custom_id":"x\ud800","method":"POST","url":"/v1/completions","body":{"model":"m"}}"#;
        let errs = check_line(line, 3).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert!(errs[0].message.contains("lone surrogate"), "{errs:?}");
        assert_eq!(errs[0].param.as_deref(), Some("custom_id"));
        let missing = check_line(
            r#"{"method":"POST","url":"/v1/completions","body":{"model":"m"}}"#,
            3,
        )
        .unwrap_err();
        assert!(missing[0].message.contains("is required"), "{missing:?}");
    }
}
