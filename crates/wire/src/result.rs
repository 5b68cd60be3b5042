use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::{error_codes, WireError};

/// A string as it is; a JSON object or array as its JSON text (some dispatchers send the body
/// decoded). Scalars other than strings are refused: they are no response body.
fn string_or_json<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let raw: Box<RawValue> = Deserialize::deserialize(d)?;
    payload_text(&raw).map_err(serde::de::Error::custom)
}

fn payload_text(raw: &RawValue) -> Result<String, String> {
    let text = raw.get().trim();
    match text.as_bytes().first() {
        Some(b'"') => serde_json::from_str(text).map_err(|e| e.to_string()),
        Some(b'{' | b'[') => Ok(text.to_owned()),
        _ => Err(format!(
            "payload: expected a string, object or array, found {text}"
        )),
    }
}

/// A result list element as [`ResultMessage::parse`] reads it: borrowed where it can be, so
/// the payload is copied once, when it is unescaped, not first into a box of its own.
#[derive(Deserialize)]
#[serde(bound(deserialize = "P: Deserialize<'de> + Default"))]
struct ResultView<'a, P> {
    #[serde(borrow)]
    id: Cow<'a, str>,
    #[serde(default)]
    status_code: Option<u16>,
    #[serde(default)]
    payload: P,
    #[serde(borrow, default)]
    error_code: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    error_message: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    request_token: Option<Cow<'a, str>>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
}

/// `payload` as it came, `null` included (which [`payload_text`] refuses, like any scalar).
#[derive(Default)]
struct Payload<'a>(Option<&'a RawValue>);

/// `payload` when it is a string (as every dispatcher sends it), unescaped in the pass that
/// reads it; anything else is refused, and then read again as a [`Payload`].
#[derive(Default)]
struct StrPayload<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for StrPayload<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text;
        impl<'de> serde::de::Visitor<'de> for Text {
            type Value = Cow<'de, str>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Cow::Borrowed(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v.to_owned()))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v))
            }
        }
        d.deserialize_str(Text).map(StrPayload)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Payload<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <&RawValue>::deserialize(d).map(|raw| Payload(Some(raw)))
    }
}

/// Non-HTTP error codes the dispatcher writes into `error_code`.
pub mod dispatcher_error_codes {
    /// The deadline passed before the request could be sent (or while it was being retried).
    pub const DEADLINE_EXCEEDED: &str = "DEADLINE_EXCEEDED";
    /// A `request-cancel:<id>` marker matched the request's token.
    pub const CANCELLED: &str = "CANCELLED";
    /// The gate dropped the request.
    pub const GATE_DROPPED: &str = "GATE_DROPPED";
    /// The gate failed.
    pub const GATE_ERROR: &str = "GATE_ERROR";
    /// No HTTP response: connection failure or timeout.
    pub const INFERENCE_ERROR: &str = "INFERENCE_ERROR";
    /// The request could not be built.
    pub const INVALID_REQUEST: &str = "INVALID_REQUEST";
    /// The payload could not be loaded (newer dispatchers).
    pub const PAYLOAD_UNAVAILABLE: &str = "PAYLOAD_UNAVAILABLE";
}

/// One element of a dispatcher result list.
///
/// Unknown fields are ignored on input.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResultMessage {
    /// The request's id, copied from the request message.
    pub id: String,
    /// HTTP status when a response was received; absent or 0 when none was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_code: Option<u16>,
    /// The gateway's raw response body as a string (for errors, `{"error":"<msg>"}`). A payload
    /// sent as a JSON object or array instead of a string is kept as its JSON text.
    #[serde(default, deserialize_with = "string_or_json")]
    pub payload: String,
    /// Why there is no HTTP response, e.g. `CANCELLED`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    /// A human-readable message for `error_code`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_message: Option<String>,
    /// The request's token, sent by newer dispatchers (v0.10): a result whose token is not the
    /// one its line was sent with belongs to another attempt or another job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_token: Option<String>,
    /// Not sent by the real dispatcher; accepted when a dispatcher does echo it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
}

/// What became of one request, whichever way it was dispatched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<'a> {
    /// An HTTP response, of any status.
    Http {
        /// The HTTP status.
        status: u16,
        /// The raw response body.
        body: &'a str,
    },
    /// No HTTP response.
    Failed {
        /// An error code: a dispatcher code or one of [`crate::error_codes`].
        code: &'a str,
        /// What happened.
        message: &'a str,
    },
}

impl ResultMessage {
    /// Reads one list element.
    pub fn parse(raw: &str) -> Result<Self, WireError> {
        crate::expect_object(raw)?;
        // Every dispatcher sends the payload as a string: read and unescape it in one pass.
        // Anything else (a decoded body, or an error to report) takes the general path.
        if let Ok(mut view) = serde_json::from_str::<ResultView<StrPayload>>(raw) {
            let payload = std::mem::take(&mut view.payload.0).into_owned();
            return Ok(Self::from_view(view, payload));
        }
        let view: ResultView<Payload> = serde_json::from_str(raw)?;
        let payload = match view.payload.0 {
            Some(p) => payload_text(p).map_err(WireError::Invalid)?,
            None => String::new(),
        };
        Ok(Self::from_view(view, payload))
    }

    fn from_view<P>(view: ResultView<'_, P>, payload: String) -> Self {
        Self {
            id: view.id.into_owned(),
            status_code: view.status_code,
            payload,
            error_code: view.error_code.map(Cow::into_owned),
            error_message: view.error_message.map(Cow::into_owned),
            request_token: view.request_token.map(Cow::into_owned),
            metadata: view.metadata,
        }
    }

    /// The element bytes to LPUSH.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("result serialises")
    }

    /// A result carrying an HTTP response.
    pub fn http(id: impl Into<String>, status: u16, body: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            status_code: Some(status),
            payload: body.into(),
            ..Self::default()
        }
    }

    /// A result without an HTTP response; the payload is `{"error":"<message>"}` as the
    /// dispatcher writes it.
    pub fn failed(id: impl Into<String>, code: &str, message: &str) -> Self {
        Self {
            id: id.into(),
            payload: serde_json::json!({ "error": message }).to_string(),
            error_code: Some(code.to_owned()),
            error_message: Some(message.to_owned()),
            ..Self::default()
        }
    }

    /// Whether an HTTP response was received, and if not, why. `DEADLINE_EXCEEDED` (v0.10)
    /// becomes the `batch_expired` error of the batch format; any other code, known or not,
    /// is passed on as the error line's code.
    pub fn outcome(&self) -> Outcome<'_> {
        match self.status_code {
            Some(status) if status > 0 => Outcome::Http {
                status,
                body: &self.payload,
            },
            _ => failure(self.error_code.as_deref(), self.error_message.as_deref()),
        }
    }
}

/// The outcome of a result without an HTTP response; see [`ResultMessage::outcome`].
pub(crate) fn failure<'a>(code: Option<&'a str>, message: Option<&'a str>) -> Outcome<'a> {
    if code == Some(dispatcher_error_codes::DEADLINE_EXCEEDED) {
        return Outcome::Failed {
            code: error_codes::BATCH_EXPIRED,
            message: error_codes::BATCH_EXPIRED_MESSAGE,
        };
    }
    Outcome::Failed {
        code: code
            .filter(|c| !c.is_empty())
            .unwrap_or(dispatcher_error_codes::INFERENCE_ERROR),
        message: message.unwrap_or("the dispatcher returned no response"),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Elements of every shape a reader must judge as the derived deserializer does.
    pub(crate) const ODD_ELEMENTS: [&str; 12] = [
        r#"{"id":"a","status_code":200,"payload":"{\"n\":\"\\u00e9\"}","request_token":"t"}"#,
        r#"{"id":"a\u00e9","payload":{"x":[1, 2]},"error_code":"E","error_message":"m\n"}"#,
        r#"{"id":"a","payload":"","metadata":{"job_id":"j","request_index":"3"},"extra":[{}]}"#,
        r#"{"id":"a","status_code":0}"#,
        r#"{"id":"a","payload":null}"#,
        r#"{"id":"a","payload":"x","payload":"y"}"#,
        r#"{"id":"a","status_code":-1}"#,
        r#"{"id":"a","status_code":null,"error_code":null}"#,
        r#"{"id":"a","status_code":200,"payload":"\ud83d\ude00 \"q\" \\ \/ \b\f\n\r\t"}"#,
        r#"{"id":"a","payload":[1]}"#,
        r#"{"id":"a","payload":"\ud83d"}"#,
        r#"{"id":"a","payload":"x","status_code":"200"}"#,
    ];

    /// Elements that are no result at all.
    pub(crate) const GARBAGE: [&str; 7] = [
        "",
        "[]",
        r#"["a",200,"{}"]"#,
        "{}",
        r#"{"id":3}"#,
        r#"{"id":"a","payload":3}"#,
        r#"{"id":"a","payload":true}"#,
    ];

    #[test]
    fn reads_the_contract_examples() {
        let ok = ResultMessage::parse(
            r#"{"id": "...", "status_code": 200, "payload": "{\"id\":\"chatcmpl-1\",\"choices\":[]}"}"#,
        )
        .unwrap();
        assert_eq!(ok.id, "...");
        assert_eq!(
            ok.outcome(),
            Outcome::Http {
                status: 200,
                body: r#"{"id":"chatcmpl-1","choices":[]}"#
            }
        );

        let cancelled = ResultMessage::parse(
            r#"{"id": "...", "payload": "{\"error\":\"cancelled\"}", "error_code": "CANCELLED", "error_message": "cancelled"}"#,
        )
        .unwrap();
        assert_eq!(
            cancelled.outcome(),
            Outcome::Failed {
                code: "CANCELLED",
                message: "cancelled"
            }
        );
    }

    #[test]
    fn tolerates_unknown_fields_and_zero_status() {
        let r = ResultMessage::parse(
            r#"{"id":"a","status_code":0,"payload":"","error_code":"INFERENCE_ERROR","request_token":"t","future":[1]}"#,
        )
        .unwrap();
        assert_eq!(r.request_token.as_deref(), Some("t"));
        assert!(matches!(
            r.outcome(),
            Outcome::Failed {
                code: "INFERENCE_ERROR",
                ..
            }
        ));
    }

    #[test]
    fn accepts_echoed_metadata() {
        let r = ResultMessage::parse(
            r#"{"id":"a","status_code":200,"payload":"{}","metadata":{"job_id":"j","request_index":"3"}}"#,
        )
        .unwrap();
        assert_eq!(r.metadata.unwrap()["request_index"], "3");
    }

    #[test]
    fn accepts_a_payload_given_as_json() {
        let r = ResultMessage::parse(
            r#"{"id":"a","status_code":200,"payload":{"id":"chatcmpl-1","choices":[]}}"#,
        )
        .unwrap();
        assert_eq!(r.payload, r#"{"id":"chatcmpl-1","choices":[]}"#);
        let r = ResultMessage::parse(r#"{"id":"a","status_code":200,"payload":[1, 2]}"#).unwrap();
        assert_eq!(r.payload, "[1, 2]");
        // A string stays a string: its content, not its quoted JSON.
        let r =
            ResultMessage::parse(r#"{"id":"a","status_code":200,"payload":"{\"n\":1}"}"#).unwrap();
        assert_eq!(r.payload, r#"{"n":1}"#);
        // Absent: empty.
        let r = ResultMessage::parse(r#"{"id":"a","error_code":"CANCELLED"}"#).unwrap();
        assert_eq!(r.payload, "");
    }

    #[test]
    fn deadline_exceeded_is_batch_expired() {
        let r = ResultMessage::parse(
            r#"{"id":"a","payload":"{\"error\":\"deadline exceeded\"}","error_code":"DEADLINE_EXCEEDED","error_message":"deadline exceeded","request_token":"t"}"#,
        )
        .unwrap();
        assert_eq!(
            r.outcome(),
            Outcome::Failed {
                code: error_codes::BATCH_EXPIRED,
                message: error_codes::BATCH_EXPIRED_MESSAGE,
            }
        );
        // With an HTTP answer (the deadline stopped retries), the answer is what counts.
        let r = ResultMessage {
            status_code: Some(503),
            ..r
        };
        assert!(matches!(r.outcome(), Outcome::Http { status: 503, .. }));
    }

    #[test]
    fn other_codes_pass_through() {
        for code in ["PAYLOAD_UNAVAILABLE", "GATE_DROPPED", "SOMETHING_NEW"] {
            let r = ResultMessage::failed("a", code, "why");
            assert_eq!(
                r.outcome(),
                Outcome::Failed {
                    code,
                    message: "why"
                }
            );
        }
        // No code at all: the dispatcher had no response.
        let r = ResultMessage::parse(r#"{"id":"a"}"#).unwrap();
        assert!(matches!(
            r.outcome(),
            Outcome::Failed {
                code: "INFERENCE_ERROR",
                ..
            }
        ));
    }

    #[test]
    fn serialises_like_the_dispatcher() {
        assert_eq!(
            ResultMessage::http("a", 200, "{}").to_json(),
            r#"{"id":"a","status_code":200,"payload":"{}"}"#
        );
        assert_eq!(
            ResultMessage::failed("a", "CANCELLED", "cancelled").to_json(),
            r#"{"id":"a","payload":"{\"error\":\"cancelled\"}","error_code":"CANCELLED","error_message":"cancelled"}"#
        );
    }

    #[test]
    fn parse_reads_what_the_derived_deserializer_reads() {
        for raw in ODD_ELEMENTS {
            let derived = serde_json::from_str::<ResultMessage>(raw).map_err(|e| e.to_string());
            let parsed = ResultMessage::parse(raw).map_err(|e| e.to_string());
            assert_eq!(
                parsed.is_ok(),
                derived.is_ok(),
                "{raw}: {parsed:?} {derived:?}"
            );
            if let Ok(p) = parsed {
                assert_eq!(p, derived.unwrap(), "{raw}");
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn any_string_payload_reads_back_as_it_was_sent(body in ".*", id in "[a-z_0-9]{1,20}", status in 100u16..600) {
            let sent = ResultMessage::http(id, status, body);
            proptest::prop_assert_eq!(ResultMessage::parse(&sent.to_json()).unwrap(), sent);
        }
    }

    #[test]
    fn refuses_garbage() {
        for raw in GARBAGE {
            assert!(ResultMessage::parse(raw).is_err(), "{raw}");
        }
    }
}
