use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::WireError;

/// One member of the dispatcher's request sorted set.
///
/// Field order is fixed, and maps are ordered, so serialising the same envelope twice gives the
/// same bytes: a re-enqueue is then a ZADD of an existing member, which only rewrites its score.
///
/// The payload type `P` is an owned [`RawValue`] when reading; a producer can serialise with a
/// borrowed `&RawValue` to avoid copying each body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Envelope<P = Box<RawValue>> {
    /// Dispatcher bookkeeping; may be `{}` or absent on input.
    #[serde(default)]
    pub internal: Internal,
    /// How the dispatcher should treat `data`; required.
    pub request_kind: RequestKind,
    /// The request itself; required.
    pub data: RequestMessage<P>,
}

/// The envelope's `internal` block. Every field is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Internal {
    /// Times the dispatcher has retried this request (it increments it on 429/5xx).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_count: Option<u32>,
    /// The dispatcher's own queue id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_id: Option<String>,
    /// Matched against `request-cancel:<id>` to cancel this request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_token: Option<String>,
    /// The sorted set this member was put in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_queue_name: Option<String>,
    /// The list the dispatcher writes this request's result to, unless its queue entry names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_queue_name: Option<String>,
    /// Transport correlation id (unused by the sorted-set transport).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport_correlation_id: Option<String>,
    /// Free-form labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
}

/// The dispatcher's `request_kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RequestKind {
    /// The request is in `data` itself; the only kind this project produces.
    Plain,
    /// The payload lives in a Redis key.
    Redis,
    /// The request came from pub/sub.
    Pubsub,
}

/// The request message inside the envelope's `data`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RequestMessage<P = Box<RawValue>> {
    /// Request id; the dispatcher copies it into the result and nothing else.
    #[serde(default)]
    pub id: String,
    /// Creation time, integer Unix seconds.
    #[serde(default)]
    pub created: i64,
    /// SLO deadline, integer Unix seconds; also the member's score. Must be > 0.
    #[serde(default)]
    pub deadline: i64,
    /// The POST body, kept byte for byte.
    pub payload: P,
    /// Correlation data; the dispatcher does not send it back.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// HTTP headers the dispatcher adds to its request to the gateway.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// Overrides the queue's request path for this message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
}

impl Envelope {
    /// Reads a sorted-set member, refusing what the real dispatcher drops unread.
    pub fn parse(member: &str) -> Result<Self, WireError> {
        crate::expect_object(member)?;
        let envelope: Envelope = serde_json::from_str(member)?;
        envelope.data.check()?;
        Ok(envelope)
    }
}

impl<P: Serialize> Envelope<P> {
    /// The member bytes to ZADD.
    pub fn to_member(&self) -> String {
        // Serialising these types cannot fail: every map has string keys.
        serde_json::to_string(self).expect("envelope serialises")
    }

    /// The sorted-set score: the deadline in seconds.
    pub fn score(&self) -> f64 {
        self.data.deadline as f64
    }
}

impl RequestMessage {
    fn check(&self) -> Result<(), WireError> {
        if self.deadline <= 0 {
            return Err(WireError::Invalid(format!(
                "deadline must be > 0, got {}",
                self.deadline
            )));
        }
        if !self.payload.get().trim_start().starts_with('{') {
            return Err(WireError::Invalid("payload must be a JSON object".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The literal example of the contract doc, section 1.
    const CONTRACT_EXAMPLE: &str = r#"{"internal": {"request_token": "9f2c...", "request_queue_name": "llm-d-async:requests:pool-a",
              "result_queue_name": "llm-d-async:results:pool-a:$batch"},
 "request_kind": "plain",
 "data": {"id": "...", "created": 1700000000, "deadline": 1700086400,
          "payload": {"model": "m", "messages": [], "max_tokens": 128},
          "metadata": {"job_id": "batch_abc", "request_index": "42"},
          "headers": {"x-example": "v"}}}"#;

    #[test]
    fn reads_the_contract_example() {
        let e = Envelope::parse(CONTRACT_EXAMPLE).unwrap();
        assert_eq!(e.request_kind, RequestKind::Plain);
        assert_eq!(e.internal.request_token.as_deref(), Some("9f2c..."));
        assert_eq!(
            e.internal.result_queue_name.as_deref(),
            Some("llm-d-async:results:pool-a:$batch")
        );
        assert_eq!(e.data.created, 1700000000);
        assert_eq!(e.data.deadline, 1700086400);
        assert_eq!(e.score(), 1700086400.0);
        assert_eq!(e.data.metadata["request_index"], "42");
        assert_eq!(e.data.headers["x-example"], "v");
        assert_eq!(
            e.data.payload.get(),
            r#"{"model": "m", "messages": [], "max_tokens": 128}"#,
            "payload must be kept byte for byte"
        );
    }

    #[test]
    fn internal_may_be_empty_or_absent() {
        let data = r#""data":{"id":"a","created":1,"deadline":2,"payload":{}}"#;
        for member in [
            format!(r#"{{"internal":{{}},"request_kind":"plain",{data}}}"#),
            format!(r#"{{"request_kind":"redis",{data}}}"#),
        ] {
            let e = Envelope::parse(&member).unwrap();
            assert_eq!(e.internal, Internal::default());
        }
    }

    #[test]
    fn refuses_what_the_dispatcher_drops() {
        let cases = [
            // The seed's own example: a bare request message, no envelope.
            r#"{"id":"batch_req_xyz","created":1700000000,"deadline":1700086400,"payload":{"model":"m"}}"#,
            r#"{"internal":{},"data":{"id":"a","created":1,"deadline":2,"payload":{}}}"#,
            r#"{"internal":{},"request_kind":"plain"}"#,
            r#"{"request_kind":"plain","data":{"id":"a","created":1,"deadline":"1700086400","payload":{}}}"#,
            r#"{"request_kind":"plain","data":{"id":"a","created":1,"deadline":0,"payload":{}}}"#,
            r#"{"request_kind":"plain","data":{"id":"a","created":1,"deadline":-5,"payload":{}}}"#,
            r#"{"request_kind":"plain","data":{"id":"a","created":1,"payload":{}}}"#,
            r#"{"request_kind":"plain","data":{"id":"a","created":1,"deadline":1.5,"payload":{}}}"#,
            r#"{"request_kind":"carrier-pigeon","data":{"id":"a","created":1,"deadline":2,"payload":{}}}"#,
            r#"{"request_kind":"plain","data":{"id":"a","created":1,"deadline":2,"payload":"text"}}"#,
            "not json",
            r#"[{},"plain",{"id":"a","created":1,"deadline":2,"payload":{}}]"#,
        ];
        for member in cases {
            assert!(Envelope::parse(member).is_err(), "accepted: {member}");
        }
    }

    #[test]
    fn a_borrowed_payload_serialises_the_same() {
        let owned = Envelope::parse(CONTRACT_EXAMPLE).unwrap();
        let borrowed = Envelope {
            internal: owned.internal.clone(),
            request_kind: owned.request_kind,
            data: RequestMessage {
                payload: &*owned.data.payload,
                id: owned.data.id.clone(),
                created: owned.data.created,
                deadline: owned.data.deadline,
                metadata: owned.data.metadata.clone(),
                headers: owned.data.headers.clone(),
                endpoint: None,
            },
        };
        assert_eq!(borrowed.to_member(), owned.to_member());
    }

    #[test]
    fn serialisation_is_stable_and_round_trips() {
        let e = Envelope::parse(CONTRACT_EXAMPLE).unwrap();
        let member = e.to_member();
        assert_eq!(member, Envelope::parse(&member).unwrap().to_member());
        assert!(
            member.starts_with(r#"{"internal":{"request_token":"9f2c...""#),
            "{member}"
        );
        assert!(member.contains(r#""payload":{"model": "m", "messages": [], "max_tokens": 128}"#));
    }
}
