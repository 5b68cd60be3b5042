//! A result list element read in place: its fields found, nothing copied.

use std::collections::BTreeMap;
use std::ops::Deref;

use crate::json::{self, StringEnd};
use crate::result::failure;
use crate::{Outcome, ResultMessage, WireError};

/// One element of a dispatcher result list, read where it lies.
///
/// [`RawResult::parse`] reads what it is given exactly as [`ResultMessage::parse`] does, but
/// the usual element (`id`, `status_code`, a string `payload`, the error fields and the token,
/// none of them but the payload escaped) is read in one pass over its bytes: its fields are
/// located where they are, and only a payload with escapes is copied, unescaped as it is
/// found. Anything else is decoded by [`ResultMessage::parse`] and kept as it.
///
/// `T` holds the element's text: a `String`, a `&str`, or a Redis client's shared string.
///
/// ```
/// use batch_wire::{Outcome, RawResult};
///
/// let raw = RawResult::parse(r#"{"id":"a","status_code":200,"payload":"{\"n\":1}"}"#)?;
/// assert_eq!(raw.id(), "a");
/// assert_eq!(raw.outcome(), Outcome::Http { status: 200, body: r#"{"n":1}"# });
/// assert_eq!(raw.to_message().payload, r#"{"n":1}"#);
/// # Ok::<(), batch_wire::WireError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawResult<T> {
    text: T,
    form: Form,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Form {
    Located(Fields),
    Decoded(Box<ResultMessage>),
}

/// A string's text in the element: `start..end`, between its quotes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    start: u32,
    end: u32,
}

/// A payload as found: its text in the element, or, when it held escapes, its text unescaped.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Payload {
    InPlace(Span),
    Unescaped(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Fields {
    id: Span,
    status_code: Option<u16>,
    payload: Option<Payload>,
    error_code: Option<Span>,
    error_message: Option<Span>,
    request_token: Option<Span>,
}

impl<T: Deref<Target = str>> RawResult<T> {
    /// Reads one list element.
    pub fn parse(text: T) -> Result<Self, WireError> {
        let form = match locate(text.as_bytes()) {
            Some(fields) => Form::Located(fields),
            None => Form::Decoded(Box::new(ResultMessage::parse(&text)?)),
        };
        Ok(Self { text, form })
    }

    /// The element as it was read.
    pub fn text(&self) -> &str {
        &self.text
    }

    fn span(&self, span: Span) -> &str {
        &self.text[span.start as usize..span.end as usize]
    }

    /// The request's id.
    pub fn id(&self) -> &str {
        match &self.form {
            Form::Located(f) => self.span(f.id),
            Form::Decoded(m) => &m.id,
        }
    }

    /// The HTTP status, when a response was received (absent or 0 when none was).
    pub fn status_code(&self) -> Option<u16> {
        match &self.form {
            Form::Located(f) => f.status_code,
            Form::Decoded(m) => m.status_code,
        }
    }

    /// Why there is no HTTP response.
    pub fn error_code(&self) -> Option<&str> {
        match &self.form {
            Form::Located(f) => f.error_code.map(|s| self.span(s)),
            Form::Decoded(m) => m.error_code.as_deref(),
        }
    }

    /// A human-readable message for the error code.
    pub fn error_message(&self) -> Option<&str> {
        match &self.form {
            Form::Located(f) => f.error_message.map(|s| self.span(s)),
            Form::Decoded(m) => m.error_message.as_deref(),
        }
    }

    /// The request's token (newer dispatchers).
    pub fn request_token(&self) -> Option<&str> {
        match &self.form {
            Form::Located(f) => f.request_token.map(|s| self.span(s)),
            Form::Decoded(m) => m.request_token.as_deref(),
        }
    }

    /// Echoed `metadata`, when a dispatcher sent it.
    pub fn metadata(&self) -> Option<&BTreeMap<String, String>> {
        match &self.form {
            Form::Located(_) => None,
            Form::Decoded(m) => m.metadata.as_ref(),
        }
    }

    /// What became of the request, as [`ResultMessage::outcome`] says.
    pub fn outcome(&self) -> Outcome<'_> {
        let f = match &self.form {
            Form::Located(f) => f,
            Form::Decoded(m) => return m.outcome(),
        };
        match f.status_code {
            Some(status) if status > 0 => Outcome::Http {
                status,
                body: self.payload(f),
            },
            _ => failure(self.error_code(), self.error_message()),
        }
    }

    fn payload<'a>(&'a self, f: &'a Fields) -> &'a str {
        match &f.payload {
            Some(Payload::InPlace(span)) => self.span(*span),
            Some(Payload::Unescaped(text)) => text,
            None => "",
        }
    }

    /// The element decoded into a [`ResultMessage`].
    pub fn to_message(&self) -> ResultMessage {
        let f = match &self.form {
            Form::Located(f) => f,
            Form::Decoded(m) => return (**m).clone(),
        };
        let payload = self.payload(f).to_owned();
        let own = |s: Option<Span>| s.map(|s| self.span(s).to_owned());
        ResultMessage {
            id: self.span(f.id).to_owned(),
            status_code: f.status_code,
            payload,
            error_code: own(f.error_code),
            error_message: own(f.error_message),
            request_token: own(f.request_token),
            metadata: None,
        }
    }
}

fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\t' | b'\n' | b'\r') = s.get(i) {
        i += 1;
    }
    i
}

/// Finds the fields of the usual element; `None` for anything [`ResultMessage::parse`] must
/// judge (other fields, escaped ids or codes, a payload that is not a string, repeated fields,
/// numbers other than plain integers, errors).
fn locate(s: &[u8]) -> Option<Fields> {
    if s.len() > u32::MAX as usize {
        return None;
    }
    let mut i = skip_ws(s, 0);
    if s.get(i) != Some(&b'{') {
        return None;
    }
    i = skip_ws(s, i + 1);
    let mut id = None;
    let mut status_code: Option<Option<u16>> = None;
    let mut payload = None;
    let (mut error_code, mut error_message, mut request_token) = (None, None, None);
    loop {
        let (name, value_at) = member_key(s, i)?;
        i = value_at;
        match name {
            b"status_code" => {
                let (value, end) = status(s, i)?;
                set_once(&mut status_code, value)?;
                i = end;
            }
            b"payload" => {
                let (found, end) = payload_at(s, i)?;
                set_once(&mut payload, found)?;
                i = end;
            }
            b"id" => {
                let (span, end) = plain_string(s, i)?;
                set_once(&mut id, span)?;
                i = end;
            }
            b"error_code" | b"error_message" | b"request_token" => {
                let slot = match name {
                    b"error_code" => &mut error_code,
                    b"error_message" => &mut error_message,
                    _ => &mut request_token,
                };
                let (value, end) = match s.get(i..i + 4) {
                    Some(b"null") => (None, i + 4),
                    _ => plain_string(s, i).map(|(span, end)| (Some(span), end))?,
                };
                set_once(slot, value)?;
                i = end;
            }
            _ => return None,
        }
        i = skip_ws(s, i);
        match s.get(i) {
            Some(b',') => i = skip_ws(s, i + 1),
            Some(b'}') => break,
            _ => return None,
        }
    }
    if skip_ws(s, i + 1) != s.len() {
        return None;
    }
    Some(Fields {
        id: id?,
        status_code: status_code.flatten(),
        payload,
        error_code: error_code.flatten(),
        error_message: error_message.flatten(),
        request_token: request_token.flatten(),
    })
}

/// The unescaped key of the member at `i` and where its value starts (past the colon).
fn member_key(s: &[u8], i: usize) -> Option<(&[u8], usize)> {
    if s.get(i) != Some(&b'"') {
        return None;
    }
    let key = json::string_end(s, i + 1)?;
    if key.escaped {
        return None;
    }
    let colon = skip_ws(s, key.quote + 1);
    if s.get(colon) != Some(&b':') {
        return None;
    }
    Some((&s[i + 1..key.quote], skip_ws(s, colon + 1)))
}

/// The payload string at `i` (in place when it has no escapes, read out when it has) and
/// where it ends; `None` when it is not a string.
fn payload_at(s: &[u8], i: usize) -> Option<(Payload, usize)> {
    if s.get(i) != Some(&b'"') {
        return None;
    }
    let mut text = Vec::new();
    let end = json::read_string(s, i + 1, &mut text)?;
    let found = match end.escaped {
        true => Payload::Unescaped(String::from_utf8(text).ok()?),
        false => Payload::InPlace(Span {
            start: (i + 1) as u32,
            end: end.quote as u32,
        }),
    };
    Some((found, end.quote + 1))
}

/// The string without escapes at `i` and where it ends; `None` for anything else.
fn plain_string(s: &[u8], i: usize) -> Option<(Span, usize)> {
    let (span, end) = string(s, i)?;
    if end.escaped {
        return None;
    }
    Some((span, end.quote + 1))
}

/// Fills a field seen for the first time; `None` when it was seen before (serde refuses a
/// repeated field).
fn set_once<V>(slot: &mut Option<V>, value: V) -> Option<()> {
    match slot {
        Some(_) => None,
        None => {
            *slot = Some(value);
            Some(())
        }
    }
}

/// A string value at `i`: its text and where it ends.
fn string(s: &[u8], i: usize) -> Option<(Span, StringEnd)> {
    if s.get(i) != Some(&b'"') {
        return None;
    }
    let end = json::string_end(s, i + 1)?;
    let span = Span {
        start: (i + 1) as u32,
        end: end.quote as u32,
    };
    Some((span, end))
}

/// `null` or a plain integer that fits a status, at `i`, and the index after it.
fn status(s: &[u8], i: usize) -> Option<(Option<u16>, usize)> {
    if s.get(i..i + 4) == Some(b"null") {
        return Some((None, i + 4));
    }
    let digits = s[i..].iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits > 5 || (digits > 1 && s[i] == b'0') {
        return None;
    }
    // A fraction or exponent makes a float, which serde refuses as a status: let it say so.
    if let Some(b'.' | b'e' | b'E') = s.get(i + digits) {
        return None;
    }
    let value = s[i..i + digits]
        .iter()
        .fold(0u32, |n, &d| n * 10 + (d - b'0') as u32);
    Some((Some(u16::try_from(value).ok()?), i + digits))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result::tests::{GARBAGE, ODD_ELEMENTS};
    use proptest::prelude::*;

    /// Reads `raw` both ways: the same message, or the same refusal.
    fn agrees(raw: &str) {
        let decoded = ResultMessage::parse(raw).map_err(|e| e.to_string());
        let read = RawResult::parse(raw).map(|r| r.to_message());
        match (&read, &decoded) {
            (Ok(r), Ok(d)) => assert_eq!(r, d, "{raw}"),
            (Err(_), Err(_)) => {}
            _ => panic!("{raw}: {read:?} against {decoded:?}"),
        }
        if let Ok(r) = RawResult::parse(raw) {
            let m = decoded.unwrap();
            assert_eq!(
                (r.id(), r.status_code(), r.request_token()),
                (m.id.as_str(), m.status_code, m.request_token.as_deref())
            );
            assert_eq!(r.outcome(), m.outcome(), "{raw}");
        }
    }

    #[test]
    fn reads_what_result_message_reads() {
        let more = [
            r#" { "id" : "a" , "status_code" : 200 , "payload" : "{}" } "#,
            r#"{"payload":"{}","status_code":201,"id":"a"}"#,
            r#"{"id":"a","id":"b"}"#,
            r#"{"id":"a","status_code":200,"status_code":200}"#,
            r#"{"id":"a","error_code":null,"error_code":"X"}"#,
            r#"{"id":"a","status_code":-0}"#,
            r#"{"id":"a","status_code":0200}"#,
            r#"{"id":"a","status_code":200.0}"#,
            r#"{"id":"a","status_code":2e2}"#,
            r#"{"id":"a","status_code":65535}"#,
            r#"{"id":"a","status_code":65536}"#,
            r#"{"id":"a","status_code":123456}"#,
            r#"{"id":"a","payload":"x"} x"#,
            r#"{"id":"a","payload":"x",}"#,
            r#"{"id":"a" "payload":"x"}"#,
            r#"{"id":"a","error_code":"CANCELLED","error_message":"cancelled"}"#,
            r#"{"id":"a","error_code":"DEADLINE_EXCEEDED","request_token":"t"}"#,
            r#"{"id":"a","error_code":"C\u0041"}"#,
            r#"{"i\u0064":"a"}"#,
            "\u{a0}{\"id\":\"a\"}",
            "{\"id\":\"a\u{1}\"}",
        ];
        for raw in ODD_ELEMENTS.into_iter().chain(GARBAGE).chain(more) {
            agrees(raw);
        }
    }

    #[test]
    fn the_usual_element_is_only_located() {
        let raw = r#"{"id":"a","status_code":200,"payload":"{\"n\":1}","request_token":"t"}"#;
        let r = RawResult::parse(raw).unwrap();
        assert!(matches!(r.form, Form::Located(_)));
        let r = RawResult::parse(r#"{"id":"a","payload":"{}","metadata":{}}"#).unwrap();
        assert!(matches!(r.form, Form::Decoded(_)));
        assert_eq!(r.metadata(), Some(&BTreeMap::new()));
    }

    proptest! {
        #[test]
        fn any_message_reads_back(
            id in "[a-z_0-9]{1,20}",
            status in prop::option::of(0u16..1000),
            body in ".*",
            code in prop::option::of("[A-Z_]{1,12}"),
            token in prop::option::of("[a-f0-9]{1,16}"),
        ) {
            let message = ResultMessage {
                id,
                status_code: status,
                payload: body,
                error_code: code,
                request_token: token,
                ..ResultMessage::default()
            };
            agrees(&message.to_json());
        }

        #[test]
        fn damaged_elements_are_judged_alike(
            at in any::<prop::sample::Index>(),
            byte in prop::sample::select(b"\"\\,:{}[]0 x-.n".to_vec()),
            replace in any::<bool>(),
        ) {
            let mut bytes = br#"{"id":"a","status_code":200,"payload":"{\"k\":\"v\\n\"}","request_token":"t"}"#.to_vec();
            let at = at.index(bytes.len());
            if replace { bytes[at] = byte } else { bytes.insert(at, byte) }
            agrees(std::str::from_utf8(&bytes).unwrap());
        }
    }
}
