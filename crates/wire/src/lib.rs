#![doc = include_str!("../README.md")]

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
