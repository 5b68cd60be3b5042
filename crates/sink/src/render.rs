//! From an outcome to the JSON of its output or error line, as the original processor maps it.
//!
//! The line is written straight into a caller's buffer, field by field. A body is copied where
//! it belongs in the line and checked there ([`batch_wire::json::check`], which finds its `usage`
//! in the same pass); only a line that turns out otherwise is written again.

use batch_wire::{error_codes, json, Usage};
use serde_json::value::RawValue;

use crate::usage::usage;

/// One rendered line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// The JSON, without newline.
    pub line: String,
    /// `Some(status)` for an `output.jsonl` line, `None` for an `error.jsonl` line.
    pub status: Option<u16>,
    /// Token counts of a successful response.
    pub usage: Option<Usage>,
}

/// Where a line rendered by [`render_into`] goes, and what it counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineKind {
    /// `Some(status)` for an `output.jsonl` line, `None` for an `error.jsonl` line.
    pub status: Option<u16>,
    /// Token counts of a successful response.
    pub usage: Option<Usage>,
}

/// Renders the line of request `id`:
/// - a 2xx with a JSON body: output line; with an empty body: `server_error`; with a body that
///   is not JSON: `parse_error` (both error lines);
/// - any other HTTP status: output line with that status; a body that is not JSON is wrapped as
///   `{"error":{"message":<body>,"type":"upstream_error"}}`, an empty one becomes `{}`;
/// - no HTTP answer: error line with the outcome's code.
pub fn render(id: &str, custom_id: &str, outcome: &batch_wire::Outcome<'_>) -> Rendered {
    let mut line = Vec::new();
    let kind = render_into(&mut line, id, custom_id, outcome);
    Rendered {
        line: String::from_utf8(line).expect("a line is rendered from strings"),
        status: kind.status,
        usage: kind.usage,
    }
}

/// [`render`], appending the line (without newline) to `out`.
pub fn render_into(
    out: &mut Vec<u8>,
    id: &str,
    custom_id: &str,
    outcome: &batch_wire::Outcome<'_>,
) -> LineKind {
    use batch_wire::Outcome;
    match *outcome {
        Outcome::Http { status, body } => http_line(out, id, custom_id, status, body),
        Outcome::Failed { code, message } => error_line(out, id, custom_id, code, message),
    }
}

/// The line of an HTTP answer. The body is copied where it goes in an output line and checked
/// there; a line that turns out to be an error line, or to need its body wrapped, is written
/// again from the start.
fn http_line(out: &mut Vec<u8>, id: &str, custom_id: &str, status: u16, body: &str) -> LineKind {
    let start = out.len();
    response_head(out, id, custom_id, status);
    let body_start = out.len();
    out.extend_from_slice(body.as_bytes());
    let (lo, hi) = trimmed(&out[body_start..]);
    let (lo, hi) = (body_start + lo, body_start + hi);
    let success = (200..300).contains(&status);
    let checked = match hi > lo {
        true => json::check(&out[lo..hi]).ok(),
        false => None,
    };
    if let Some(doc) = checked {
        let usage = success.then(|| usage(&out[lo..hi], &doc)).flatten();
        if lo > body_start {
            out.copy_within(lo..hi, body_start);
        }
        out.truncate(body_start + hi - lo);
        out.extend_from_slice(RESPONSE_TAIL);
        return LineKind {
            status: Some(status),
            usage,
        };
    }
    // The rare lines: written again.
    out.truncate(start);
    let trimmed = body.trim();
    match (success, trimmed.is_empty()) {
        (true, true) => error_line(
            out,
            id,
            custom_id,
            error_codes::SERVER_ERROR,
            &format!("the gateway answered {status} with an empty body"),
        ),
        (true, false) => {
            let e = serde_json::from_str::<&RawValue>(trimmed)
                .expect_err("a body that failed the check is not JSON");
            error_line(
                out,
                id,
                custom_id,
                error_codes::PARSE_ERROR,
                &format!("the gateway answered {status} with a body that is not JSON: {e}"),
            )
        }
        (false, true) => response_line(out, id, custom_id, status, "{}"),
        (false, false) => {
            let wrapped = serde_json::json!({
                "error": {"message": body, "type": "upstream_error"}
            });
            response_line(out, id, custom_id, status, &wrapped.to_string())
        }
    }
}

/// The bounds of `body` without surrounding whitespace, as `str::trim` sees it.
fn trimmed(body: &[u8]) -> (usize, usize) {
    let plain = |b: &u8| b.is_ascii_graphic();
    if body.first().is_some_and(plain) && body.last().is_some_and(plain) {
        return (0, body.len());
    }
    let text = std::str::from_utf8(body).expect("a body is a str");
    let inner = text.trim();
    let lo = inner.as_ptr() as usize - text.as_ptr() as usize;
    (lo, lo + inner.len())
}

/// A JSON string, escaped as serde_json escapes it.
fn string(out: &mut Vec<u8>, s: &str) {
    json::write_str(out, s);
}

const RESPONSE_TAIL: &[u8] = b"},\"error\":null}";

/// An output line up to its body.
fn response_head(out: &mut Vec<u8>, id: &str, custom_id: &str, status: u16) {
    out.extend_from_slice(b"{\"id\":");
    string(out, id);
    out.extend_from_slice(b",\"custom_id\":");
    string(out, custom_id);
    out.extend_from_slice(b",\"response\":{\"status_code\":");
    decimal(out, status);
    out.extend_from_slice(b",\"request_id\":");
    string(out, id);
    out.extend_from_slice(b",\"body\":");
}

fn decimal(out: &mut Vec<u8>, n: u16) {
    let mut digits = [0u8; 5];
    let mut at = digits.len();
    let mut n = n;
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// `body` must be one JSON value without surrounding whitespace.
fn response_line(
    out: &mut Vec<u8>,
    id: &str,
    custom_id: &str,
    status: u16,
    body: &str,
) -> LineKind {
    response_head(out, id, custom_id, status);
    out.extend_from_slice(body.as_bytes());
    out.extend_from_slice(RESPONSE_TAIL);
    LineKind {
        status: Some(status),
        usage: None,
    }
}

fn error_line(out: &mut Vec<u8>, id: &str, custom_id: &str, code: &str, message: &str) -> LineKind {
    out.extend_from_slice(b"{\"id\":");
    string(out, id);
    out.extend_from_slice(b",\"custom_id\":");
    string(out, custom_id);
    out.extend_from_slice(b",\"response\":null,\"error\":{\"code\":");
    string(out, code);
    out.extend_from_slice(b",\"message\":");
    string(out, message);
    out.extend_from_slice(b"}}");
    LineKind {
        status: None,
        usage: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use batch_wire::{ErrorBody, Outcome, OutputLine, ResponseBody};
    use proptest::prelude::*;

    /// The line as the `OutputLine` serialisation wrote it before lines were rendered by hand.
    fn reference(id: &str, custom_id: &str, outcome: &Outcome<'_>) -> (String, Option<u16>) {
        let line = |response: Option<ResponseBody>, error: Option<ErrorBody>| {
            OutputLine {
                id: id.into(),
                custom_id: custom_id.into(),
                response,
                error,
            }
            .to_json()
        };
        let failed = |code: &str, message: &str| {
            let error = ErrorBody {
                code: code.into(),
                message: message.into(),
            };
            (line(None, Some(error)), None)
        };
        let answered = |status: u16, body: &RawValue| {
            let response = ResponseBody {
                status_code: status,
                request_id: id.into(),
                body,
            };
            (line(Some(response), None), Some(status))
        };
        match *outcome {
            Outcome::Http { status, body } if (200..300).contains(&status) => {
                let trimmed = body.trim();
                if trimmed.is_empty() {
                    return failed(
                        error_codes::SERVER_ERROR,
                        &format!("the gateway answered {status} with an empty body"),
                    );
                }
                match serde_json::from_str::<&RawValue>(trimmed) {
                    Ok(raw) => answered(status, raw),
                    Err(e) => failed(
                        error_codes::PARSE_ERROR,
                        &format!("the gateway answered {status} with a body that is not JSON: {e}"),
                    ),
                }
            }
            Outcome::Http { status, body } => {
                let trimmed = body.trim();
                if trimmed.is_empty() {
                    return answered(status, &RawValue::from_string("{}".into()).unwrap());
                }
                match serde_json::from_str::<&RawValue>(trimmed) {
                    Ok(raw) => answered(status, raw),
                    Err(_) => {
                        let wrapped = serde_json::json!({
                            "error": {"message": body, "type": "upstream_error"}
                        });
                        answered(status, &serde_json::value::to_raw_value(&wrapped).unwrap())
                    }
                }
            }
            Outcome::Failed { code, message } => failed(code, message),
        }
    }

    /// Token counts as the line's usage was read before it was found by hand.
    fn reference_usage(status: u16, body: &str) -> Option<Usage> {
        let trimmed = body.trim();
        if !(200..300).contains(&status) || serde_json::from_str::<&RawValue>(trimmed).is_err() {
            return None;
        }
        crate::usage::read(trimmed.as_bytes())
    }

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            "[a-z0-9_-]{1,12}",
            any::<String>(),
            Just("quote \" back\\slash \u{1} tab\t é ☃ \u{2028}".to_owned()),
        ]
    }

    fn body() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            Just("  ".to_owned()),
            Just(r#" {"id":"x","usage":{"prompt_tokens":3,"completion_tokens":5}} "#.to_owned()),
            Just(r#"{"usage":{"prompt_tokens":-1}}"#.to_owned()),
            Just(r#"{"usage":3,"usage":4}"#.to_owned()),
            Just(r#"{"usage":{"prompt_tokens":3},"usage":{"prompt_tokens":4}}"#.to_owned()),
            Just(
                r#"{"a":[{"usage":{"prompt_tokens":9}}],"usage":{"completion_tokens":7,"x":[1]}}"#
                    .to_owned()
            ),
            Just(r#"{"usage":[3,4]}"#.to_owned()),
            Just(r#"{"usage":{"prompt_tokens":1e3}}"#.to_owned()),
            Just(r#"{"us\u0061ge":{"prompt_tokens":5}}"#.to_owned()),
            Just("\u{a0}{\"usage\":null}\u{2028}".to_owned()),
            Just(r#"{"text":"a \"quoted\" \\ word\n","usage":{"prompt_tokens":2}}"#.to_owned()),
            Just(r#"[{"prompt_tokens":2}]"#.to_owned()),
            Just("\n\"a string\"\t".to_owned()),
            Just("<html>".to_owned()),
            Just("{\"a\":1} trailing".to_owned()),
            Just("Bad Gateway".to_owned()),
            any::<String>(),
        ]
    }

    proptest! {
        /// The hand-written lines are byte for byte the serialised ones.
        #[test]
        fn lines_are_what_the_serialiser_wrote(
            id in text(),
            custom_id in text(),
            status in prop_oneof![Just(200u16), Just(201), Just(299), Just(429), Just(502), 100u16..600],
            body in body(),
            code in text(),
            message in text(),
            failed in any::<bool>(),
        ) {
            let outcome = match failed {
                true => Outcome::Failed { code: &code, message: &message },
                false => Outcome::Http { status, body: &body },
            };
            let ours = render(&id, &custom_id, &outcome);
            let (line, file) = reference(&id, &custom_id, &outcome);
            prop_assert_eq!(&ours.line, &line);
            prop_assert_eq!(ours.status, file);
            serde_json::from_str::<serde_json::Value>(&ours.line).unwrap();
            if !failed {
                prop_assert_eq!(ours.usage, reference_usage(status, &body));
            }
        }
    }

    fn http(status: u16, body: &str) -> Rendered {
        render("batch_req_j_0", "c", &Outcome::Http { status, body })
    }

    #[test]
    fn success_keeps_the_body_and_reads_usage() {
        let r = http(
            200,
            r#" {"id":"x","usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}} "#,
        );
        assert_eq!(r.status, Some(200));
        assert_eq!(
            r.line,
            r#"{"id":"batch_req_j_0","custom_id":"c","response":{"status_code":200,"request_id":"batch_req_j_0","body":{"id":"x","usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}},"error":null}"#
        );
        assert_eq!(
            r.usage,
            Some(Usage {
                input_tokens: 3,
                output_tokens: 5,
                total_tokens: 8,
                ..Usage::default()
            })
        );
    }

    #[test]
    fn bad_2xx_bodies_are_errors() {
        let empty = http(200, "  ");
        assert_eq!(empty.status, None);
        assert!(
            empty.line.contains(r#""code":"server_error""#),
            "{}",
            empty.line
        );
        let garbage = http(200, "<html>");
        assert_eq!(garbage.status, None);
        assert!(
            garbage.line.contains(r#""code":"parse_error""#),
            "{}",
            garbage.line
        );
    }

    #[test]
    fn http_errors_go_to_output_with_their_status() {
        let json = http(429, r#"{"error":{"message":"slow down"}}"#);
        assert_eq!(json.status, Some(429));
        assert!(json
            .line
            .contains(r#""body":{"error":{"message":"slow down"}}"#));
        let text = http(502, "Bad Gateway");
        assert_eq!(text.status, Some(502));
        assert!(
            text.line
                .contains(r#""body":{"error":{"message":"Bad Gateway","type":"upstream_error"}}"#),
            "{}",
            text.line
        );
        let empty = http(500, "");
        assert!(empty.line.contains(r#""body":{}"#), "{}", empty.line);
    }

    #[test]
    fn no_answer_is_an_error_line_with_its_code() {
        let r = render(
            "i",
            "c",
            &Outcome::Failed {
                code: "CANCELLED",
                message: "cancelled",
            },
        );
        assert_eq!(r.status, None);
        assert_eq!(
            r.line,
            r#"{"id":"i","custom_id":"c","response":null,"error":{"code":"CANCELLED","message":"cancelled"}}"#
        );
    }
}
