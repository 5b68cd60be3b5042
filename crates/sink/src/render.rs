//! From an outcome to the JSON of its output or error line, as the original processor maps it.

use batch_wire::{error_codes, ErrorBody, Outcome, OutputLine, ResponseBody};
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

/// Renders the line of request `id`:
/// - a 2xx with a JSON body: output line; with an empty body: `server_error`; with a body that
///   is not JSON: `parse_error` (both error lines);
/// - any other HTTP status: output line with that status; a body that is not JSON is wrapped as
///   `{"error":{"message":<body>,"type":"upstream_error"}}`, an empty one becomes `{}`;
/// - no HTTP answer: error line with the outcome's code.
pub fn render(id: &str, custom_id: &str, outcome: &Outcome<'_>) -> Rendered {
    match *outcome {
        Outcome::Http { status, body } if (200..300).contains(&status) => {
            let trimmed = body.trim();
            if trimmed.is_empty() {
                return error_line(
                    id,
                    custom_id,
                    error_codes::SERVER_ERROR,
                    &format!("the gateway answered {status} with an empty body"),
                );
            }
            match serde_json::from_str::<&RawValue>(trimmed) {
                Ok(raw) => {
                    let usage = serde_json::from_str::<UsageOnly>(raw.get())
                        .ok()
                        .and_then(|u| u.usage);
                    let mut r = response_line(id, custom_id, status, raw);
                    r.usage = usage;
                    r
                }
                Err(e) => error_line(
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
                let empty = RawValue::from_string("{}".into()).expect("valid JSON");
                return response_line(id, custom_id, status, &empty);
            }
            match serde_json::from_str::<&RawValue>(trimmed) {
                Ok(raw) => response_line(id, custom_id, status, raw),
                Err(_) => {
                    let wrapped = serde_json::json!({
                        "error": {"message": body, "type": "upstream_error"}
                    });
                    let wrapped = serde_json::value::to_raw_value(&wrapped).expect("valid JSON");
                    response_line(id, custom_id, status, &wrapped)
                }
            }
        }
        Outcome::Failed { code, message } => error_line(id, custom_id, code, message),
    }
}

fn response_line(id: &str, custom_id: &str, status: u16, body: &RawValue) -> Rendered {
    let line = OutputLine {
        id: id.into(),
        custom_id: custom_id.into(),
        response: Some(ResponseBody {
            status_code: status,
            request_id: id.into(),
            body,
        }),
        error: None,
    };
    Rendered {
        line: line.to_json(),
        status: Some(status),
        usage: None,
    }
}

fn error_line(id: &str, custom_id: &str, code: &str, message: &str) -> Rendered {
    let line = OutputLine {
        id: id.into(),
        custom_id: custom_id.into(),
        response: None,
        error: Some(ErrorBody {
            code: code.into(),
            message: message.into(),
        }),
    };
    Rendered {
        line: line.to_json(),
        status: None,
        usage: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
