//! Wire formats shared by the processor, the dispatcher and the simulator.
//!
//! - [`Envelope`] and [`RequestMessage`]: what goes into the dispatcher's request sorted set. The
//!   member is the whole envelope; the real dispatcher drops a member without `request_kind` or
//!   `data` without ever writing a result, so [`Envelope::parse`] refuses exactly those.
//! - [`ResultMessage`]: what the dispatcher LPUSHes onto a result list. It carries no `metadata`,
//!   so results are routed by [`request_id`], which encodes the job and line reversibly.
//! - [`InputLine`], [`OutputLine`], [`Batch`]: the OpenAI batch file formats and Batch object.
//!
//! ```
//! use batch_wire::{parse_request_id, request_id, Envelope, ResultMessage};
//!
//! let member = r#"{"internal":{},"request_kind":"plain",
//!     "data":{"id":"batch_req_batch_abc_42","created":1700000000,"deadline":1700086400,
//!             "payload":{"model":"m","max_tokens":128}}}"#;
//! let envelope = Envelope::parse(member)?;
//! assert_eq!(envelope.data.deadline, 1700086400);
//! assert_eq!(envelope.data.payload.get(), r#"{"model":"m","max_tokens":128}"#);
//!
//! let id = request_id("batch_abc", 42);
//! assert_eq!(parse_request_id(&id), Some(("batch_abc".to_owned(), 42)));
//!
//! let result = ResultMessage::parse(r#"{"id":"x","status_code":200,"payload":"{}","request_token":"t"}"#)?;
//! assert_eq!(result.status_code, Some(200));
//! # Ok::<(), batch_wire::WireError>(())
//! ```

mod batch;
mod envelope;
pub mod hash;
mod id;
mod raw;
mod result;

/// The fast JSON passes (the [`batch_json`] crate), under the name the wire formats use.
pub use batch_json as json;

pub use batch::{
    deadline, error_codes, Batch, BatchError, BatchErrors, BatchStatus, CachedTokens, ErrorBody,
    InputLine, OutputLine, ReasoningTokens, RequestCounts, ResponseBody, Usage, ALLOWED_URLS,
    BATCH_FILE, ERROR_FILE, MAX_COMPLETION_WINDOW, OUTPUT_FILE,
};
pub use envelope::{Envelope, Internal, RequestKind, RequestMessage};
pub use id::{
    parse_request_id, request_id, request_id_prefix, split_request_id, REQUEST_ID_PREFIX,
};
pub use raw::RawResult;
pub use result::{dispatcher_error_codes, Outcome, ResultMessage};

/// serde reads a JSON array into a struct's fields in order; the formats here are objects only.
fn expect_object(raw: &str) -> Result<(), WireError> {
    match raw.trim_start().starts_with('{') {
        true => Ok(()),
        false => Err(WireError::Invalid("expected a JSON object".into())),
    }
}

/// Re-exported so users can build payloads without naming serde_json themselves.
pub use serde_json::value::RawValue;

/// Why a message could not be read.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Not JSON, or JSON of the wrong shape (serde's message names the field).
    ///
    /// serde's error is part of the message, not a `source()`, so a printed chain shows it once.
    #[error("malformed message: {0}")]
    Json(serde_json::Error),
    /// JSON of the right shape that the dispatcher still refuses.
    #[error("invalid message: {0}")]
    Invalid(String),
}

impl From<serde_json::Error> for WireError {
    fn from(error: serde_json::Error) -> Self {
        Self::Json(error)
    }
}
