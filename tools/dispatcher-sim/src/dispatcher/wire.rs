//! The simulator's own reading of the contract's wire formats, written from
//! `dispatcher-contract.md` like the Go dispatcher's structs, and deliberately not shared with
//! the processor's `batch-wire`: a drift in what the processor writes must fail the end-to-end
//! tests instead of being parsed the same wrong way on both sides.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// Non-HTTP error codes written into a result's `error_code` (contract §3).
pub mod codes {
    /// The deadline passed (v0.10 answers expired requests with it).
    pub const DEADLINE_EXCEEDED: &str = "DEADLINE_EXCEEDED";
    /// `request-cancel:<id>` matched the request's token.
    pub const CANCELLED: &str = "CANCELLED";
    /// No HTTP response: connection failure or timeout.
    pub const INFERENCE_ERROR: &str = "INFERENCE_ERROR";
    /// The HTTP request could not be built from the message.
    pub const INVALID_REQUEST: &str = "INVALID_REQUEST";
}

/// One member of a request sorted set: `{internal, request_kind, data}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Envelope {
    /// Dispatcher bookkeeping; `{}` or absent on input.
    #[serde(default)]
    pub internal: Internal,
    /// `plain`, `redis` or `pubsub`; required.
    pub request_kind: RequestKind,
    /// The request; required.
    pub data: Data,
}

/// The envelope's `internal` object; every field optional, unknown ones ignored.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Internal {
    /// Retries so far; incremented on each 429/5xx.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_count: Option<u32>,
    /// The queue entry's id, written when the dispatcher re-adds a member.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_id: Option<String>,
    /// Compared with `request-cancel:<id>`; half of the v0.10 claim key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_token: Option<String>,
    /// The sorted set the member came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_queue_name: Option<String>,
    /// Where the result goes unless the queue entry names a list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_queue_name: Option<String>,
    /// Carried along untouched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport_correlation_id: Option<String>,
    /// Carried along untouched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
}

/// `request_kind`: an unknown value makes the member unparsable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RequestKind {
    /// The payload is inline.
    Plain,
    /// The payload is in a Redis key.
    Redis,
    /// Pub/sub.
    Pubsub,
}

/// The envelope's `data`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Data {
    /// Copied into the result; with the token, the claim key.
    #[serde(default)]
    pub id: String,
    /// Integer Unix seconds.
    #[serde(default)]
    pub created: i64,
    /// Integer Unix seconds, > 0; a string or a fraction does not parse.
    #[serde(default)]
    pub deadline: i64,
    /// A JSON object, POSTed as Go re-encodes it ([`Envelope::go_payload`]).
    pub payload: Box<RawValue>,
    /// Never sent back.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Added to the HTTP request.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// Overrides the queue's request path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
}

impl Envelope {
    /// Reads a member; `Err` says why the dispatcher drops it unanswered.
    pub fn parse(member: &str) -> Result<Self, String> {
        if !member.trim_start().starts_with('{') {
            return Err("not a JSON object".into());
        }
        let env: Envelope = serde_json::from_str(member).map_err(|e| e.to_string())?;
        if env.data.deadline <= 0 {
            return Err(format!("deadline must be > 0, got {}", env.data.deadline));
        }
        if !env.data.payload.get().trim_start().starts_with('{') {
            return Err("payload is not a JSON object".into());
        }
        // The real dispatcher decodes the payload into Go values; what it cannot decode (a
        // number beyond float64) makes the whole member undecodable.
        super::gojson::reencode(env.data.payload.get())
            .map_err(|e| format!("payload cannot be decoded: {e}"))?;
        Ok(env)
    }

    /// The member bytes when the dispatcher re-adds it: re-serialised as Go's encoder does,
    /// the payload included (keys sorted, numbers as float64, HTML characters escaped).
    pub fn to_member(&self) -> String {
        let mut env = self.clone();
        if let Some(raw) = self
            .go_payload()
            .and_then(|p| RawValue::from_string(p).ok())
        {
            env.data.payload = raw;
        }
        super::gojson::html_escape(&serde_json::to_string(&env).unwrap_or_default())
    }

    /// The payload as the real dispatcher POSTs it (Go's decode and encode); `None` only for
    /// an envelope that did not come through [`Envelope::parse`].
    pub fn go_payload(&self) -> Option<String> {
        super::gojson::reencode(self.data.payload.get()).ok()
    }

    /// The score a member is (re-)added at: its deadline.
    pub fn score(&self) -> f64 {
        self.data.deadline as f64
    }

    /// The request token, if non-empty.
    pub fn token(&self) -> Option<&str> {
        self.internal
            .request_token
            .as_deref()
            .filter(|t| !t.is_empty())
    }
}

/// One element of a result list (contract §3), as the dispatcher writes it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ResultMessage {
    /// The request's id.
    pub id: String,
    /// The HTTP status; absent when no response was received.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status_code: Option<u16>,
    /// The raw response body, or `{"error":"<message>"}`.
    pub payload: String,
    /// Why there is no response.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    /// Says what `error_code` means here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_message: Option<String>,
    /// v0.10 only: the request's token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_token: Option<String>,
}

impl ResultMessage {
    /// A result carrying an HTTP response.
    pub fn http(id: &str, status: u16, body: String) -> Self {
        Self {
            id: id.to_owned(),
            status_code: Some(status),
            payload: body,
            ..Self::default()
        }
    }

    /// A result without an HTTP response.
    pub fn failed(id: &str, code: &str, message: &str) -> Self {
        Self {
            id: id.to_owned(),
            payload: serde_json::json!({ "error": message }).to_string(),
            error_code: Some(code.to_owned()),
            error_message: Some(message.to_owned()),
            ..Self::default()
        }
    }

    /// The outcome label of the counters: the status, or the error code.
    pub fn outcome(&self) -> String {
        match self.status_code {
            Some(s) if s > 0 => s.to_string(),
            _ => self.error_code.clone().unwrap_or_default(),
        }
    }

    /// The element bytes to LPUSH.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// The marker a producer sets to cancel a request by token.
pub fn cancel_marker_key(id: &str) -> String {
    format!("request-cancel:{id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The literal example of the contract, section 1.
    const EXAMPLE: &str = r#"{"internal": {"request_token": "9f2c...", "request_queue_name": "llm-d-async:requests:pool-a",
              "result_queue_name": "llm-d-async:results:pool-a:$batch"},
 "request_kind": "plain",
 "data": {"id": "...", "created": 1700000000, "deadline": 1700086400,
          "payload": {"model": "m", "messages": [], "max_tokens": 128},
          "metadata": {"job_id": "batch_abc", "request_index": "42"},
          "headers": {"x-example": "v"}}}"#;

    #[test]
    fn reads_the_contract_example_and_re_adds_it_as_go_encodes_it() {
        let e = Envelope::parse(EXAMPLE).unwrap();
        assert_eq!(e.request_kind, RequestKind::Plain);
        assert_eq!(e.token(), Some("9f2c..."));
        assert_eq!(e.data.deadline, 1700086400);
        assert_eq!(e.score(), 1700086400.0);
        assert_eq!(e.data.headers["x-example"], "v");
        assert_eq!(
            e.data.payload.get(),
            r#"{"model": "m", "messages": [], "max_tokens": 128}"#
        );
        // Re-added members carry the payload as Go re-encodes it: keys sorted, compact.
        let again = Envelope::parse(&e.to_member()).unwrap();
        assert_eq!(
            again.data.payload.get(),
            r#"{"max_tokens":128,"messages":[],"model":"m"}"#
        );
    }

    #[test]
    fn refuses_what_the_dispatcher_drops() {
        for member in [
            r#"{"id":"x","created":1,"deadline":2,"payload":{}}"#,
            r#"{"internal":{},"data":{"id":"a","created":1,"deadline":2,"payload":{}}}"#,
            r#"{"request_kind":"plain"}"#,
            r#"{"request_kind":"plain","data":{"id":"a","deadline":"2","payload":{}}}"#,
            r#"{"request_kind":"plain","data":{"id":"a","deadline":1.5,"payload":{}}}"#,
            r#"{"request_kind":"plain","data":{"id":"a","deadline":0,"payload":{}}}"#,
            r#"{"request_kind":"plain","data":{"id":"a","deadline":2,"payload":"text"}}"#,
            r#"{"request_kind":"fax","data":{"id":"a","deadline":2,"payload":{}}}"#,
            "not json",
        ] {
            assert!(Envelope::parse(member).is_err(), "accepted {member}");
        }
    }

    #[test]
    fn results_serialise_like_the_dispatcher() {
        assert_eq!(
            ResultMessage::http("a", 200, "{}".into()).to_json(),
            r#"{"id":"a","status_code":200,"payload":"{}"}"#
        );
        let mut r = ResultMessage::failed("a", codes::CANCELLED, "cancelled");
        assert_eq!(
            r.to_json(),
            r#"{"id":"a","payload":"{\"error\":\"cancelled\"}","error_code":"CANCELLED","error_message":"cancelled"}"#
        );
        r.request_token = Some("t".into());
        assert!(r.to_json().ends_with(r#","request_token":"t"}"#));
        assert_eq!(r.outcome(), "CANCELLED");
    }
}
