//! From an outcome to the JSON of its output or error line, as the original processor maps it.
//!
//! The line is written straight into a caller's buffer, field by field: a 2xx body is read once
//! (its `usage` read while checking that it is JSON), then copied as it is.

use batch_wire::error_codes;
use serde::Deserialize;
use serde_json::value::RawValue;

/// Token counts of a response, from its `usage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Generated tokens.
    #[serde(default)]
    pub completion_tokens: u64,
}

#[derive(Deserialize)]
struct UsageOnly {
    #[serde(default)]
    usage: Option<Usage>,
}

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
        Outcome::Http { status, body } if (200..300).contains(&status) => {
            let trimmed = body.trim();
            if trimmed.is_empty() {
                return error_line(
                    out,
                    id,
                    custom_id,
                    error_codes::SERVER_ERROR,
                    &format!("the gateway answered {status} with an empty body"),
                );
            }
            // Reading `usage` parses the whole body: when it succeeds the body is JSON.
            if let Ok(u) = serde_json::from_str::<UsageOnly>(trimmed) {
                response_line(out, id, custom_id, status, trimmed);
                return LineKind {
                    status: Some(status),
                    usage: u.usage,
                };
            }
            match serde_json::from_str::<&RawValue>(trimmed) {
                Ok(raw) => response_line(out, id, custom_id, status, raw.get()),
                Err(e) => error_line(
                    out,
                    id,
                    custom_id,
                    error_codes::PARSE_ERROR,
                    &format!("the gateway answered {status} with a body that is not JSON: {e}"),
                ),
            }
        }
        Outcome::Http { status, body } => {
            let trimmed = body.trim();
            if trimmed.is_empty() {
                return response_line(out, id, custom_id, status, "{}");
            }
            match serde_json::from_str::<&RawValue>(trimmed) {
                Ok(raw) => response_line(out, id, custom_id, status, raw.get()),
                Err(_) => {
                    let wrapped = serde_json::json!({
                        "error": {"message": body, "type": "upstream_error"}
                    });
                    response_line(out, id, custom_id, status, &wrapped.to_string())
                }
            }
        }
        Outcome::Failed { code, message } => error_line(out, id, custom_id, code, message),
    }
}

/// A JSON string, escaped as serde_json escapes it.
fn string(out: &mut Vec<u8>, s: &str) {
    serde_json::to_writer(&mut *out, s).expect("writing to a Vec cannot fail");
}

/// `body` must be one JSON value without surrounding whitespace.
fn response_line(
    out: &mut Vec<u8>,
    id: &str,
    custom_id: &str,
    status: u16,
    body: &str,
) -> LineKind {
    out.extend_from_slice(b"{\"id\":");
    string(out, id);
    out.extend_from_slice(b",\"custom_id\":");
    string(out, custom_id);
    out.extend_from_slice(b",\"response\":{\"status_code\":");
    out.extend_from_slice(status.to_string().as_bytes());
    out.extend_from_slice(b",\"request_id\":");
    string(out, id);
    out.extend_from_slice(b",\"body\":");
    out.extend_from_slice(body.as_bytes());
    out.extend_from_slice(b"},\"error\":null}");
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
                prompt_tokens: 3,
                completion_tokens: 5
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
