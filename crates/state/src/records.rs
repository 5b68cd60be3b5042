//! The records the service keeps: OpenAI's File and Batch objects, with the tenant that owns them.

use batch_wire::{Batch, BatchStatus, Usage};
use serde::{Deserialize, Serialize};

use crate::layout;

/// OpenAI's File object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileObject {
    /// `file-…`.
    pub id: String,
    /// Always `file`.
    pub object: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Unix seconds.
    pub created_at: i64,
    /// The uploaded file's name.
    pub filename: String,
    /// `batch` (inputs) or `batch_output` (a batch's output and error files).
    pub purpose: String,
    /// Unix seconds; `None`: never.
    pub expires_at: Option<i64>,
    /// Deprecated by OpenAI, still read by old clients: `processed`.
    pub status: String,
    /// Deprecated by OpenAI: always `None`.
    pub status_details: Option<String>,
}

/// A file and who owns it, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredFile {
    /// The owning tenant.
    pub tenant: String,
    /// The object the API shows.
    pub file: FileObject,
    /// Where its bytes are, when not at [`layout::upload`] of its id (result files: per lease
    /// epoch, so that a fenced replica's late upload never replaces the holder's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

impl StoredFile {
    /// The storage key of its bytes.
    pub fn storage_key(&self) -> String {
        self.key
            .clone()
            .unwrap_or_else(|| layout::upload(&self.file.id))
    }
}

/// Finer counts than OpenAI's `request_counts`, as Anthropic's Message Batches give them; the
/// Batch object carries them under [`FINE_COUNTS_KEY`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FineCounts {
    /// Requests without a result yet.
    pub processing: u64,
    /// Requests answered (an output line).
    pub succeeded: u64,
    /// Requests that failed (an error line), other than cancelled and expired ones.
    pub errored: u64,
    /// Requests closed by a cancel.
    pub cancelled: u64,
    /// Requests closed by the deadline.
    pub expired: u64,
}

/// The extension key of [`FineCounts`] in the Batch object.
pub const FINE_COUNTS_KEY: &str = "x_request_counts";

/// OpenAI's Batch object as the API shows it: the executor's batch plus what the service adds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchObject {
    /// The fields every batch has.
    #[serde(flatten)]
    pub batch: Batch,
    /// The model, when every request names the same one.
    #[serde(default)]
    pub model: Option<String>,
    /// Summed token counts; set once the batch ended.
    #[serde(default)]
    pub usage: Option<Usage>,
    /// Finer counts (see [`FineCounts`]).
    #[serde(default)]
    pub x_request_counts: FineCounts,
}

impl BatchObject {
    /// The status.
    pub fn status(&self) -> BatchStatus {
        self.batch.status
    }
}

/// A batch and what the service needs to run it, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBatch {
    /// The owning tenant.
    pub tenant: String,
    /// The object the API shows.
    pub batch: BatchObject,
    /// The completion window in seconds.
    pub window_secs: u64,
    /// Seconds after which the output and error files expire; `None`: never.
    #[serde(default)]
    pub output_expires_after: Option<u64>,
    /// Headers of the create request named by `serve.pass_through_headers` (lower-case names),
    /// sent on each of the batch's inference requests.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub headers: std::collections::BTreeMap<String, String>,
}

/// One page of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page<T> {
    /// The items, in the order asked for.
    pub data: Vec<T>,
    /// Whether more follow the last one.
    pub has_more: bool,
}
