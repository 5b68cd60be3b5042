use std::borrow::Cow;
use std::collections::BTreeMap;

use batch_wire::{json, Envelope, InputLine, Internal, RequestKind, RequestMessage};

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
        match line_parts(line) {
            Some((url, body)) => Ok(self.write_member(index, &url, body)),
            None => self.member_with_serde(index, line),
        }
    }

    /// The envelope of [`JobMessages::member`] written field by field, in serde's order and
    /// spelling: the same bytes, without reading the line into a struct or cloning the headers.
    fn write_member(&self, index: u64, url: &str, body: &str) -> String {
        let id = batch_wire::request_id(&self.job_id, index);
        let token = request_token(&self.job_id, self.created, index);
        let window_ms = (self.deadline.saturating_sub(self.created).max(0))
            .saturating_mul(1000)
            .to_string();
        let mut headers: Vec<(&str, &str)> = self
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .filter(|(k, _)| !matches!(*k, "X-Request-ID" | "x-slo-ttft-ms"))
            .chain([("X-Request-ID", id.as_str()), ("x-slo-ttft-ms", &window_ms)])
            .collect();
        headers.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let mut out = Vec::with_capacity(body.len() + 512);
        let field = |out: &mut Vec<u8>, before: &str, value: &str| {
            out.extend_from_slice(before.as_bytes());
            json::write_str(out, value);
        };
        field(&mut out, r#"{"internal":{"request_token":"#, &token);
        field(&mut out, r#","request_queue_name":"#, &self.request_queue);
        field(&mut out, r#","result_queue_name":"#, &self.result_queue);
        field(&mut out, r#"},"request_kind":"plain","data":{"id":"#, &id);
        let numbers = format!(
            r#","created":{},"deadline":{},"payload":"#,
            self.created, self.deadline
        );
        out.extend_from_slice(numbers.as_bytes());
        out.extend_from_slice(body.as_bytes());
        field(&mut out, r#","metadata":{"job_id":"#, &self.job_id);
        field(&mut out, r#","request_index":"#, &index.to_string());
        out.extend_from_slice(br#"},"headers":{"#);
        for (n, (name, value)) in headers.into_iter().enumerate() {
            if n > 0 {
                out.push(b',');
            }
            json::write_str(&mut out, name);
            field(&mut out, ":", value);
        }
        field(&mut out, r#"},"endpoint":"#, url);
        out.extend_from_slice(b"}}");
        String::from_utf8(out).expect("JSON written from text is text")
    }

    /// [`JobMessages::member`] through serde: for any line the hand reading does not take, and
    /// the reference the tests hold that reading to (public for the benchmark that compares the
    /// two).
    pub fn member_with_serde(&self, index: u64, line: &[u8]) -> Result<String, ProducerError> {
        let input: InputLine = serde_json::from_slice(line)
            .map_err(|error| ProducerError::BadLine { index, error })?;
        let id = batch_wire::request_id(&self.job_id, index);
        let mut headers = self.headers.clone();
        headers.insert("X-Request-ID".into(), id.clone());
        let window_ms = self
            .deadline
            .saturating_sub(self.created)
            .max(0)
            .saturating_mul(1000);
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

/// The `url` and the raw `body` of a line of the usual shape, found in one pass; `None` for
/// anything serde should read (and perhaps refuse): not text, not an object, an escaped key, a
/// field missing or repeated.
fn line_parts(line: &[u8]) -> Option<(Cow<'_, str>, &str)> {
    let text = std::str::from_utf8(line).ok()?;
    let (mut seen, mut url, mut body) = ([false; 4], None, None);
    let end = json::members(line, json::skip_ws(line, 0), |key, i| {
        let field = match key {
            b"custom_id" => 0,
            b"method" => 1,
            b"url" => 2,
            b"body" => 3,
            _ => return json::value_end(line, i).ok(),
        };
        if std::mem::replace(&mut seen[field], true) {
            return None;
        }
        match field {
            3 => {
                let end = json::value_end(line, i).ok()?;
                body = Some(&text[i..end]);
                Some(end)
            }
            _ => {
                let (value, end) = json::string(text, i)?;
                if field == 2 {
                    url = Some(value);
                }
                Some(end)
            }
        }
    })?;
    if json::skip_ws(line, end) != line.len() || !seen.iter().all(|&s| s) {
        return None;
    }
    Some((url?, body?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
        assert!(
            scores.windows(2).all(|w| w[0] < w[1]),
            "strictly increasing"
        );
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

    fn odd_job() -> impl Strategy<Value = JobMessages> {
        let header = prop::sample::select(vec![
            ("x-gateway-inference-objective", "batch"),
            ("X-Request-ID", "theirs"),
            ("x-slo-ttft-ms", "1"),
            ("X-Request-Id", "case"),
            ("A-first", "\"q\" \\"),
            ("zz", "é\u{7f}\u{1}"),
        ]);
        (
            prop::sample::select(vec!["batch_abc", "b\"q", "j\u{1}é", "x/y z"]),
            prop::sample::select(vec![(1_700_000_000i64, 1_700_086_400i64), (5, 1), (-3, 10)]),
            prop::sample::select(vec!["llm-d-async:requests:p", "q\"\\\u{2}"]),
            prop::collection::vec(header, 0..4),
        )
            .prop_map(
                |(job_id, (created, deadline), queue, headers)| JobMessages {
                    job_id: job_id.into(),
                    created,
                    deadline,
                    request_queue: queue.into(),
                    result_queue: format!("{queue}:$batch"),
                    headers: headers
                        .into_iter()
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .collect(),
                },
            )
    }

    fn odd_line() -> impl Strategy<Value = String> {
        let pick = |options: Vec<&'static str>| prop_oneof![3 => Just(options[0]), 1 => prop::sample::select(options)];
        (
            pick(vec![r#""r1""#, r#""r\u0031""#, "7", ""]),
            pick(vec![r#""POST""#, r#""G\u0045T""#, "null", ""]),
            pick(vec![
                r#""/v1/chat/completions""#,
                r#""/v1/compl\u0065tions""#,
                r#""\ud800""#,
                "1",
                "",
            ]),
            pick(vec![
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
                r#"{ "model" : "m\u00e9", "messages":[{"content":"a\"b\ud800"}] }"#,
                "[1]",
                r#""x""#,
                "null",
                "",
            ]),
            pick(vec![
                "",
                r#""x":[{"\ud800":1}]"#,
                r#""custom_id":"dup""#,
                r#""body":{}"#,
                r#""k\u0065y":1"#,
            ]),
            any::<prop::sample::Index>(),
            any::<bool>(),
        )
            .prop_map(|(id, method, url, body, extra, order, spaced)| {
                let mut fields: Vec<String> = [
                    ("custom_id", id),
                    ("method", method),
                    ("url", url),
                    ("body", body),
                ]
                .into_iter()
                .filter(|(_, v)| !v.is_empty())
                .map(|(k, v)| format!(r#""{k}":{v}"#))
                .collect();
                if !extra.is_empty() {
                    fields.push(extra.to_owned());
                }
                let turn = order.index(fields.len().max(1));
                fields.rotate_left(turn);
                match spaced {
                    true => format!(" {{ {} }}\t", fields.join(" , ")),
                    false => format!("{{{}}}", fields.join(",")),
                }
            })
    }

    /// The member written by hand, when the line is taken, is serde's, byte for byte.
    fn same_as_serde(job: &JobMessages, line: &[u8]) -> Result<bool, TestCaseError> {
        let serde = job.member_with_serde(9, line).ok();
        let ours = job.member(9, line).ok();
        prop_assert_eq!(&ours, &serde, "{}", String::from_utf8_lossy(line));
        match line_parts(line) {
            Some((url, body)) => {
                prop_assert_eq!(Some(job.write_member(9, &url, body)), serde);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        #[test]
        fn members_written_by_hand_are_serde_s(job in odd_job(), line in odd_line()) {
            same_as_serde(&job, line.as_bytes())?;
        }

        #[test]
        fn damaged_lines_give_serde_s_answer(
            job in odd_job(),
            line in odd_line(),
            at in any::<usize>(),
            byte in prop::sample::select(b"\"\\,:[]{} un1\x01\xff".to_vec()),
            mode in 0..3u8,
        ) {
            let mut bytes = line.into_bytes();
            batch_testkit::damage(&mut bytes, at, byte, mode);
            same_as_serde(&job, &bytes)?;
        }
    }

    #[test]
    fn the_usual_line_is_written_by_hand() {
        assert!(same_as_serde(&job(), LINE).unwrap());
        let escaped_key =
            br#"{"custom_\u0069d":"r","method":"POST","url":"/v1/completions","body":{}}"#;
        assert!(!same_as_serde(&job(), escaped_key).unwrap());
        assert!(job().member(1, escaped_key).is_ok());
    }

    #[test]
    fn a_bad_line_names_its_index() {
        let err = job().member(3, b"{").unwrap_err();
        assert!(err.to_string().starts_with("line 3:"), "{err}");
    }
}
