//! The OpenAI batch file formats and the Batch object.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// The longest completion window a job may have (10 years of 365 days): a deadline, its
/// creation time plus the window, then stays far inside `i64` seconds, and milliseconds.
pub const MAX_COMPLETION_WINDOW: std::time::Duration =
    std::time::Duration::from_secs(10 * 365 * 24 * 3600);

/// The SLO deadline (Unix seconds) of a job created at `created_at` with `window` (at least 1 s
/// counted); `None` when the window is over [`MAX_COMPLETION_WINDOW`] or the sum overflows.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(batch_wire::deadline(1_000, Duration::from_secs(60)), Some(1_060));
/// assert_eq!(batch_wire::deadline(1_000, Duration::from_secs(u64::MAX)), None);
/// ```
pub fn deadline(created_at: i64, window: std::time::Duration) -> Option<i64> {
    if window > MAX_COMPLETION_WINDOW {
        return None;
    }
    let secs = i64::try_from(window.as_secs().max(1)).ok()?;
    created_at.checked_add(secs)
}

/// The output file's name in a job directory: one line per request the gateway answered.
pub const OUTPUT_FILE: &str = "output.jsonl";
/// The error file's name in a job directory: one line per request without an answer.
pub const ERROR_FILE: &str = "error.jsonl";
/// The Batch object's file name in a job directory.
pub const BATCH_FILE: &str = "batch.json";

/// The endpoints a batch input line may target.
pub const ALLOWED_URLS: [&str; 5] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/moderations",
];

/// Error codes of output and validation errors, as OpenAI and the original processor use them.
pub mod error_codes {
    /// The job's completion window passed before the request ran.
    pub const BATCH_EXPIRED: &str = "batch_expired";
    /// The message that goes with [`BATCH_EXPIRED`], word for word as OpenAI writes it.
    pub const BATCH_EXPIRED_MESSAGE: &str =
        "This request could not be executed before the completion window expired.";
    /// The job was cancelled before the request ran.
    pub const BATCH_CANCELLED: &str = "batch_cancelled";
    /// The job failed before the request ran.
    pub const BATCH_FAILED: &str = "batch_failed";
    /// The request's model has no gateway.
    pub const MODEL_NOT_FOUND: &str = "model_not_found";
    /// A 2xx response whose body is not JSON.
    pub const PARSE_ERROR: &str = "parse_error";
    /// A 2xx response with an empty body.
    pub const SERVER_ERROR: &str = "server_error";
    /// Validation: the line is not a JSON object of the batch format.
    pub const INVALID_JSON_LINE: &str = "invalid_json_line";
    /// Validation: `custom_id` missing or empty.
    pub const MISSING_CUSTOM_ID: &str = "missing_required_parameter";
    /// Validation: `custom_id` seen before in the file.
    pub const DUPLICATE_CUSTOM_ID: &str = "duplicate_custom_id";
    /// Validation: `method` is not POST.
    pub const INVALID_METHOD: &str = "invalid_method";
    /// Validation: `url` is not an allowed endpoint.
    pub const INVALID_URL: &str = "invalid_url";
    /// Validation: `url` is not the batch's endpoint.
    pub const URL_MISMATCH: &str = "url_mismatch";
    /// Validation: `body.model` missing or empty.
    pub const MISSING_MODEL: &str = "missing_model";
    /// Validation: `body.stream` is true.
    pub const STREAMING_NOT_SUPPORTED: &str = "invalid_request";
    /// Validation (async mode): the body holds a value the dispatcher would change or drop (a
    /// number beyond float64, an integer beyond ±2^53, a lone surrogate).
    pub const DISPATCHER_CANNOT_CARRY: &str = "invalid_request";
    /// Validation: the file has more bytes than allowed (the code of the service's 413 too).
    pub const FILE_TOO_LARGE: &str = "file_too_large";
    /// Validation: the file has more request lines than allowed (the service's 413 too).
    pub const TOO_MANY_REQUESTS_IN_FILE: &str = "too_many_requests_in_file";
    /// Validation: the file has no request at all.
    pub const EMPTY_FILE: &str = "empty_file";
}

/// One line of a batch input file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InputLine<'a> {
    /// The caller's id for the request, unique in the file.
    #[serde(borrow)]
    pub custom_id: Cow<'a, str>,
    /// Always `POST`.
    #[serde(borrow)]
    pub method: Cow<'a, str>,
    /// One of [`ALLOWED_URLS`].
    #[serde(borrow)]
    pub url: Cow<'a, str>,
    /// The request body, kept byte for byte.
    #[serde(borrow)]
    pub body: &'a RawValue,
}

/// One line of `output.jsonl` or `error.jsonl`: `response` and `error` are both always present,
/// one of them `null`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OutputLine<'a> {
    /// The request id (see [`crate::request_id`]).
    #[serde(borrow)]
    pub id: Cow<'a, str>,
    /// The caller's id from the input line.
    #[serde(borrow)]
    pub custom_id: Cow<'a, str>,
    /// The HTTP response, when there was one.
    #[serde(borrow)]
    pub response: Option<ResponseBody<'a>>,
    /// Why there is no response.
    #[serde(borrow)]
    pub error: Option<ErrorBody<'a>>,
}

/// The `response` of an output line.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ResponseBody<'a> {
    /// The HTTP status.
    pub status_code: u16,
    /// The request id again, as OpenAI writes it.
    #[serde(borrow)]
    pub request_id: Cow<'a, str>,
    /// The response body as JSON.
    #[serde(borrow)]
    pub body: &'a RawValue,
}

/// The `error` of an output line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody<'a> {
    /// An error code, see [`error_codes`].
    #[serde(borrow)]
    pub code: Cow<'a, str>,
    /// What happened.
    #[serde(borrow)]
    pub message: Cow<'a, str>,
}

impl OutputLine<'_> {
    /// The line as JSON, without the trailing newline.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("output line serialises")
    }
}

/// The lifecycle of a batch job, as OpenAI names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchStatus {
    /// The input file is being checked.
    Validating,
    /// Validation failed, or a system error stopped the job.
    Failed,
    /// Requests are being sent.
    InProgress,
    /// Every request has its result; files are being closed.
    Finalizing,
    /// Done.
    Completed,
    /// The completion window passed; partial results kept.
    Expired,
    /// A cancel was asked for.
    Cancelling,
    /// Cancelled; partial results kept.
    Cancelled,
}

impl BatchStatus {
    /// Whether the job can change no more.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Completed | Self::Failed | Self::Expired | Self::Cancelled
        )
    }

    /// The status as written in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Validating => "validating",
            Self::Failed => "failed",
            Self::InProgress => "in_progress",
            Self::Finalizing => "finalizing",
            Self::Completed => "completed",
            Self::Expired => "expired",
            Self::Cancelling => "cancelling",
            Self::Cancelled => "cancelled",
        }
    }
}

/// `request_counts` of the Batch object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestCounts {
    /// Every request line of the input.
    pub total: u64,
    /// Results with HTTP 200.
    pub completed: u64,
    /// Every other result.
    pub failed: u64,
}

/// Token counts in the Batch object's `usage` shape: one response's, or summed over a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Of which were cached.
    pub input_tokens_details: CachedTokens,
    /// Generated tokens.
    pub output_tokens: u64,
    /// Of which were reasoning.
    pub output_tokens_details: ReasoningTokens,
    /// Both.
    pub total_tokens: u64,
}

/// `input_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachedTokens {
    /// Prompt tokens served from a cache.
    pub cached_tokens: u64,
}

/// `output_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReasoningTokens {
    /// Generated tokens spent on reasoning.
    pub reasoning_tokens: u64,
}

impl std::ops::AddAssign for Usage {
    fn add_assign(&mut self, o: Self) {
        self.input_tokens = self.input_tokens.saturating_add(o.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(o.output_tokens);
        self.total_tokens = self.total_tokens.saturating_add(o.total_tokens);
        let cached = &mut self.input_tokens_details.cached_tokens;
        *cached = cached.saturating_add(o.input_tokens_details.cached_tokens);
        let reasoning = &mut self.output_tokens_details.reasoning_tokens;
        *reasoning = reasoning.saturating_add(o.output_tokens_details.reasoning_tokens);
    }
}

/// One entry of `errors.data`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchError {
    /// A machine-readable code.
    pub code: String,
    /// What is wrong, for a person.
    pub message: String,
    /// The offending parameter, if any.
    #[serde(default)]
    pub param: Option<String>,
    /// The 1-based input line, if any.
    #[serde(default)]
    pub line: Option<u64>,
}

/// The Batch object's `errors`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchErrors {
    /// Always `list`.
    pub object: String,
    /// The errors.
    pub data: Vec<BatchError>,
}

impl BatchErrors {
    /// Wraps `data` as OpenAI does.
    pub fn new(data: Vec<BatchError>) -> Self {
        Self {
            object: "list".into(),
            data,
        }
    }
}

/// The OpenAI Batch object, written as `batch.json` next to a job's files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// The job id.
    pub id: String,
    /// Always `batch`.
    pub object: String,
    /// The endpoint of the job's requests, when they share one.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Validation or system errors.
    #[serde(default)]
    pub errors: Option<BatchErrors>,
    /// Where the input came from.
    pub input_file_id: String,
    /// The job's completion window, e.g. `24h`.
    pub completion_window: String,
    /// Where the job stands.
    pub status: BatchStatus,
    /// The output file, relative to the job's directory.
    #[serde(default)]
    pub output_file_id: Option<String>,
    /// The error file, relative to the job's directory.
    #[serde(default)]
    pub error_file_id: Option<String>,
    /// Unix seconds; also the `created` of every request message.
    pub created_at: i64,
    /// Unix seconds.
    #[serde(default)]
    pub in_progress_at: Option<i64>,
    /// Unix seconds: `created_at` + the completion window, the SLO deadline of every request.
    pub expires_at: i64,
    /// Unix seconds.
    #[serde(default)]
    pub finalizing_at: Option<i64>,
    /// Unix seconds.
    #[serde(default)]
    pub completed_at: Option<i64>,
    /// Unix seconds.
    #[serde(default)]
    pub failed_at: Option<i64>,
    /// Unix seconds.
    #[serde(default)]
    pub expired_at: Option<i64>,
    /// Unix seconds.
    #[serde(default)]
    pub cancelling_at: Option<i64>,
    /// Unix seconds.
    #[serde(default)]
    pub cancelled_at: Option<i64>,
    /// Progress.
    pub request_counts: RequestCounts,
    /// Free-form metadata.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

impl Batch {
    /// A new job in `validating`.
    pub fn new(
        id: impl Into<String>,
        input_file_id: impl Into<String>,
        completion_window: impl Into<String>,
        created_at: i64,
        expires_at: i64,
    ) -> Self {
        Self {
            id: id.into(),
            object: "batch".into(),
            endpoint: None,
            errors: None,
            input_file_id: input_file_id.into(),
            completion_window: completion_window.into(),
            status: BatchStatus::Validating,
            output_file_id: None,
            error_file_id: None,
            created_at,
            in_progress_at: None,
            expires_at,
            finalizing_at: None,
            completed_at: None,
            failed_at: None,
            expired_at: None,
            cancelling_at: None,
            cancelled_at: None,
            request_counts: RequestCounts::default(),
            metadata: BTreeMap::new(),
        }
    }

    /// Moves to `status`, stamping the matching timestamp with `now`.
    pub fn set_status(&mut self, status: BatchStatus, now: i64) {
        self.status = status;
        let stamp = match status {
            BatchStatus::Validating => return,
            BatchStatus::InProgress => &mut self.in_progress_at,
            BatchStatus::Finalizing => &mut self.finalizing_at,
            BatchStatus::Completed => &mut self.completed_at,
            BatchStatus::Failed => &mut self.failed_at,
            BatchStatus::Expired => &mut self.expired_at,
            BatchStatus::Cancelling => &mut self.cancelling_at,
            BatchStatus::Cancelled => &mut self.cancelled_at,
        };
        stamp.get_or_insert(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_an_input_line() {
        let raw = r#"{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}"#;
        let line: InputLine = serde_json::from_str(raw).unwrap();
        assert_eq!(line.custom_id, "r1");
        assert_eq!(line.method, "POST");
        assert!(ALLOWED_URLS.contains(&line.url.as_ref()));
        assert_eq!(
            line.body.get(),
            r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#
        );
    }

    #[test]
    fn writes_the_reference_output_lines() {
        let body = RawValue::from_string(r#"{"id":"chatcmpl-1"}"#.into()).unwrap();
        let ok = OutputLine {
            id: "batch_req_1".into(),
            custom_id: "r1".into(),
            response: Some(ResponseBody {
                status_code: 200,
                request_id: "batch_req_1".into(),
                body: &body,
            }),
            error: None,
        };
        assert_eq!(
            ok.to_json(),
            r#"{"id":"batch_req_1","custom_id":"r1","response":{"status_code":200,"request_id":"batch_req_1","body":{"id":"chatcmpl-1"}},"error":null}"#
        );
        let expired = OutputLine {
            id: "batch_req_2".into(),
            custom_id: "r2".into(),
            response: None,
            error: Some(ErrorBody {
                code: error_codes::BATCH_EXPIRED.into(),
                message: error_codes::BATCH_EXPIRED_MESSAGE.into(),
            }),
        };
        assert_eq!(
            expired.to_json(),
            r#"{"id":"batch_req_2","custom_id":"r2","response":null,"error":{"code":"batch_expired","message":"This request could not be executed before the completion window expired."}}"#
        );
        let json = expired.to_json();
        let back: OutputLine = serde_json::from_str(&json).unwrap();
        assert_eq!(back.error.unwrap().code, "batch_expired");
    }

    #[test]
    fn batch_object_round_trips_and_stamps() {
        let mut b = Batch::new("batch_1", "in.jsonl", "24h", 100, 86500);
        b.set_status(BatchStatus::InProgress, 101);
        b.set_status(BatchStatus::Completed, 150);
        b.request_counts = RequestCounts {
            total: 3,
            completed: 2,
            failed: 1,
        };
        b.errors = Some(BatchErrors::new(vec![BatchError {
            code: "invalid_url".into(),
            message: "bad".into(),
            param: Some("url".into()),
            line: Some(2),
        }]));
        let json = serde_json::to_string(&b).unwrap();
        assert!(json.contains(r#""status":"completed""#), "{json}");
        assert!(json.contains(r#""object":"batch""#));
        assert!(json.contains(r#""errors":{"object":"list","data":[{"code":"invalid_url","message":"bad","param":"url","line":2}]}"#));
        assert_eq!(b.in_progress_at, Some(101));
        assert_eq!(b.completed_at, Some(150));
        let back: Batch = serde_json::from_str(&json).unwrap();
        assert_eq!(back, b);
        assert!(back.status.is_terminal());
        assert_eq!(BatchStatus::InProgress.as_str(), "in_progress");
    }
}
