use std::collections::BTreeMap;

use batch_wire::{Envelope, InputLine, Internal, RequestKind, RequestMessage};

use crate::ProducerError;

/// Steps of one second in a score's fraction: float64 keeps them exact at today's epoch.
const POSITION_STEPS: f64 = 2_097_152.0;

/// The last plan position with a score of its own (2^21 - 1).
pub const MAX_POSITION: u64 = 2_097_151;

/// Everything a job's members share; [`JobMessages::member`] adds the line.
#[derive(Debug, Clone)]
pub struct JobMessages {
    /// The job id (part of every request id).
    pub job_id: String,
    /// The job's creation time, Unix seconds: every member's `created`.
    pub created: i64,
    /// The job's SLO deadline, Unix seconds: every member's `deadline` and score.
    pub deadline: i64,
    /// The sorted set the members go into.
    pub request_queue: String,
    /// This replica's result list, named in each envelope so results come back here.
    pub result_queue: String,
    /// Headers added to every request (objective, pass-through headers).
    pub headers: BTreeMap<String, String>,
}

/// What it takes to remove one member or cancel its request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingMember {
    /// The exact member bytes.
    pub member: String,
    /// The request id.
    pub id: String,
    /// The request token, the value of its cancel marker.
    pub token: String,
}

/// The cancel token of line `index` of a job: derived, so a rebuilt member is byte-identical.
pub fn request_token(job_id: &str, created: i64, index: u64) -> String {
    let seed = format!("{job_id}\u{0}{created}\u{0}{index}");
    format!("{:016x}", batch_wire::hash::fnv1a_64(seed.as_bytes()))
}

impl JobMessages {
    /// The sorted-set score of a member at the head of the job's plan: the deadline.
    pub fn score(&self) -> f64 {
        self.deadline as f64
    }

    /// The score of the member at `position` in the job's plan order for its queue: the
    /// deadline plus `position / 2^21` s (as the v0.10 dispatcher's own producer orders equal
    /// deadlines), so the dispatcher, which takes the lowest score first, sends the job's
    /// requests in plan order. Positions from [`MAX_POSITION`] on share the last step.
    pub fn score_at(&self, position: u64) -> f64 {
        self.deadline as f64 + position.min(MAX_POSITION) as f64 / POSITION_STEPS
    }

    /// The member of line `index`, built from the raw input line.
    ///
    /// `x-slo-ttft-ms` carries the job's whole window: the member must be the same bytes every
    /// time it is built, and how long it will wait in the queue is not known here anyway.
    pub fn member(&self, index: u64, line: &[u8]) -> Result<String, ProducerError> {
        let input: InputLine = serde_json::from_slice(line)
            .map_err(|error| ProducerError::BadLine { index, error })?;
        let id = batch_wire::request_id(&self.job_id, index);
        let mut headers = self.headers.clone();
        headers.insert("X-Request-ID".into(), id.clone());
        let window_ms = (self.deadline - self.created).max(0) * 1000;
        headers.insert("x-slo-ttft-ms".into(), window_ms.to_string());
        let envelope = Envelope {
            internal: Internal {
                request_token: Some(request_token(&self.job_id, self.created, index)),
                request_queue_name: Some(self.request_queue.clone()),
                result_queue_name: Some(self.result_queue.clone()),
                ..Internal::default()
            },
            request_kind: RequestKind::Plain,
            data: RequestMessage {
                id,
                created: self.created,
                deadline: self.deadline,
                payload: input.body,
                metadata: BTreeMap::from([
                    ("job_id".to_owned(), self.job_id.clone()),
                    ("request_index".to_owned(), index.to_string()),
                ]),
                headers,
                endpoint: Some(input.url.into_owned()),
            },
        };
        Ok(envelope.to_member())
    }

    /// The member of line `index` with its id and token, for removal and cancel markers.
    pub fn pending(&self, index: u64, line: &[u8]) -> Result<PendingMember, ProducerError> {
        Ok(PendingMember {
            member: self.member(index, line)?,
            id: batch_wire::request_id(&self.job_id, index),
            token: request_token(&self.job_id, self.created, index),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> JobMessages {
        JobMessages {
            job_id: "batch_abc".into(),
            created: 1_700_000_000,
            deadline: 1_700_086_400,
            request_queue: "llm-d-async:requests:pool-a".into(),
            result_queue: "llm-d-async:results:pool-a:$batch".into(),
            headers: BTreeMap::from([("x-gateway-inference-objective".into(), "batch".into())]),
        }
    }

    const LINE: &[u8] = br#"{"custom_id":"r42","method":"POST","url":"/v1/chat/completions","body":{"model":"Qwen/Qwen3-0.6B", "messages":[{"role":"user","content":"What is 2+2?"}],"max_tokens":128}}"#;

    #[test]
    fn builds_what_the_dispatcher_reads() {
        let member = job().member(42, LINE).unwrap();
        let e = Envelope::parse(&member).expect("the dispatcher accepts it");
        assert_eq!(e.request_kind, RequestKind::Plain);
        assert_eq!(e.data.id, "batch_req_batch_abc_42");
        assert_eq!(
            (e.data.created, e.data.deadline),
            (1_700_000_000, 1_700_086_400)
        );
        assert_eq!(
            e.data.payload.get(),
            r#"{"model":"Qwen/Qwen3-0.6B", "messages":[{"role":"user","content":"What is 2+2?"}],"max_tokens":128}"#,
            "body byte for byte"
        );
        assert_eq!(e.data.metadata["job_id"], "batch_abc");
        assert_eq!(e.data.metadata["request_index"], "42");
        assert_eq!(e.data.headers["X-Request-ID"], "batch_req_batch_abc_42");
        assert_eq!(e.data.headers["x-slo-ttft-ms"], "86400000");
        assert_eq!(e.data.headers["x-gateway-inference-objective"], "batch");
        assert_eq!(e.data.endpoint.as_deref(), Some("/v1/chat/completions"));
        assert_eq!(
            e.internal.result_queue_name.as_deref(),
            Some("llm-d-async:results:pool-a:$batch")
        );
        assert_eq!(
            e.internal.request_token.as_deref(),
            Some(request_token("batch_abc", 1_700_000_000, 42).as_str())
        );
        assert!(
            member.contains(r#""created":1700000000,"deadline":1700086400"#),
            "integers"
        );
    }

    #[test]
    fn the_same_line_gives_the_same_bytes() {
        assert_eq!(
            job().member(7, LINE).unwrap(),
            job().member(7, LINE).unwrap()
        );
        assert_ne!(
            job().member(7, LINE).unwrap(),
            job().member(8, LINE).unwrap()
        );
    }

    #[test]
    fn scores_keep_plan_order_within_the_deadline_second() {
        let j = job();
        let scores: Vec<f64> = (0..50_000).map(|p| j.score_at(p)).collect();
        assert!(scores.windows(2).all(|w| w[0] < w[1]), "strictly increasing");
        assert!(scores.iter().all(|s| s.floor() as i64 == j.deadline));
        assert_eq!(j.score_at(MAX_POSITION + 5), j.score_at(MAX_POSITION));
        assert!(j.score_at(MAX_POSITION) < (j.deadline + 1) as f64);
        // The text Redis is sent reads back as the same number.
        let text = j.score_at(12_345).to_string();
        assert_eq!(text.parse::<f64>().unwrap(), j.score_at(12_345));
    }

    #[test]
    fn tokens_differ_per_line_and_job() {
        let a = request_token("j", 1, 0);
        assert_ne!(a, request_token("j", 1, 1));
        assert_ne!(a, request_token("k", 1, 0));
        assert_ne!(a, request_token("j", 2, 0));
    }

    #[test]
    fn a_bad_line_names_its_index() {
        let err = job().member(3, b"{").unwrap_err();
        assert!(err.to_string().starts_with("line 3:"), "{err}");
    }
}
