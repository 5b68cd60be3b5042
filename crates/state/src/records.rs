//! The records the service keeps: OpenAI's File object with the tenant that owns it, and the
//! service's own batch record, from which the API's Batch object is built.

use std::collections::BTreeMap;

use batch_wire::{Batch, BatchError, BatchErrors, BatchStatus, RequestCounts, Usage};
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

/// A batch and what the service needs to run it, as stored: the service's own record, flat,
/// in its own field names. The API's Batch object is built from it ([`StoredBatch::view`]), so
/// the API may change without rewriting what Redis and storage hold.
///
/// Records written before this shape (`{"tenant", "batch": <the Batch object>, …}`) are still
/// read: [`StoredBatch::from_json`] accepts both, and the scripts that read a record's status
/// look in both places. A record is written again in this shape at its next change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBatch {
    /// `batch_…`.
    pub id: String,
    /// The owning tenant.
    pub tenant: String,
    /// Where the batch stands.
    pub status: BatchStatus,
    /// The input file's id.
    pub input_file_id: String,
    /// The endpoint of its requests.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// The completion window as asked, e.g. `24h`.
    pub completion_window: String,
    /// The completion window in seconds.
    pub window_secs: u64,
    /// Seconds after which the output and error files expire; `None`: never.
    #[serde(default)]
    pub output_expires_after: Option<u64>,
    /// The tenant's metadata.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Headers of the create request named by `serve.pass_through_headers` (lower-case names),
    /// sent on each of the batch's inference requests.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// The model, when every request names the same one.
    #[serde(default)]
    pub model: Option<String>,
    /// Unix seconds.
    pub created_at: i64,
    /// Unix seconds: the SLO deadline of every request.
    pub expires_at: i64,
    /// When it reached each status (Unix seconds).
    #[serde(default)]
    pub times: StatusTimes,
    /// The output file's id, once uploaded.
    #[serde(default)]
    pub output_file_id: Option<String>,
    /// The error file's id, once uploaded.
    #[serde(default)]
    pub error_file_id: Option<String>,
    /// Validation or system errors (`None`: none reported).
    #[serde(default)]
    pub errors: Option<Vec<BatchError>>,
    /// Requests: every one, answered, failed.
    #[serde(default)]
    pub counts: Counts,
    /// Finer counts (see [`FineCounts`]).
    #[serde(default)]
    pub fine_counts: FineCounts,
    /// Summed token counts; set once the batch ended.
    #[serde(default)]
    pub usage: Option<Usage>,
}

/// When a batch reached each status, Unix seconds (`None`: not yet).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusTimes {
    /// `in_progress`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_progress: Option<i64>,
    /// `finalizing`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finalizing: Option<i64>,
    /// `completed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed: Option<i64>,
    /// `failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<i64>,
    /// `expired`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expired: Option<i64>,
    /// `cancelling`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancelling: Option<i64>,
    /// `cancelled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancelled: Option<i64>,
}

impl StatusTimes {
    /// The time of `status`, which `validating` has none of.
    pub fn of(&mut self, status: BatchStatus) -> Option<&mut Option<i64>> {
        Some(match status {
            BatchStatus::Validating => return None,
            BatchStatus::InProgress => &mut self.in_progress,
            BatchStatus::Finalizing => &mut self.finalizing,
            BatchStatus::Completed => &mut self.completed,
            BatchStatus::Failed => &mut self.failed,
            BatchStatus::Expired => &mut self.expired,
            BatchStatus::Cancelling => &mut self.cancelling,
            BatchStatus::Cancelled => &mut self.cancelled,
        })
    }
}

/// A batch's requests: the API's `request_counts`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Every request line of the input.
    pub total: u64,
    /// Answered with HTTP 200.
    pub completed: u64,
    /// Every other result.
    pub failed: u64,
}

impl From<RequestCounts> for Counts {
    fn from(c: RequestCounts) -> Self {
        Self {
            total: c.total,
            completed: c.completed,
            failed: c.failed,
        }
    }
}

impl From<Counts> for RequestCounts {
    fn from(c: Counts) -> Self {
        Self {
            total: c.total,
            completed: c.completed,
            failed: c.failed,
        }
    }
}

impl StoredBatch {
    /// A new batch in `validating`, of `tenant`, reading `input_file_id`, created at
    /// `created_at` with a completion window of `window_secs` (`completion_window` as asked)
    /// ending at `expires_at`.
    pub fn new(
        id: &str,
        tenant: &str,
        input_file_id: &str,
        completion_window: &str,
        window_secs: u64,
        created_at: i64,
        expires_at: i64,
    ) -> Self {
        Self {
            id: id.to_owned(),
            tenant: tenant.to_owned(),
            status: BatchStatus::Validating,
            input_file_id: input_file_id.to_owned(),
            endpoint: None,
            completion_window: completion_window.to_owned(),
            window_secs,
            output_expires_after: None,
            metadata: BTreeMap::new(),
            headers: BTreeMap::new(),
            model: None,
            created_at,
            expires_at,
            times: StatusTimes::default(),
            output_file_id: None,
            error_file_id: None,
            errors: None,
            counts: Counts::default(),
            fine_counts: FineCounts::default(),
            usage: None,
        }
    }

    /// Reads a record as stored, in this shape or the one before it.
    pub fn from_json(json: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str::<Self>(json).or_else(|flat| {
            serde_json::from_str::<EarlierBatch>(json)
                .map(Self::from)
                .map_err(|_| flat)
        })
    }

    /// Moves to `status`, stamping its time with `now` unless it has one.
    pub fn set_status(&mut self, status: BatchStatus, now: i64) {
        self.status = status;
        if let Some(at) = self.times.of(status) {
            at.get_or_insert(now);
        }
    }

    /// The Batch object the API shows.
    pub fn view(&self) -> BatchObject {
        let t = self.times;
        BatchObject {
            batch: Batch {
                id: self.id.clone(),
                object: "batch".into(),
                endpoint: self.endpoint.clone(),
                errors: self.errors.clone().map(BatchErrors::new),
                input_file_id: self.input_file_id.clone(),
                completion_window: self.completion_window.clone(),
                status: self.status,
                output_file_id: self.output_file_id.clone(),
                error_file_id: self.error_file_id.clone(),
                created_at: self.created_at,
                in_progress_at: t.in_progress,
                expires_at: self.expires_at,
                finalizing_at: t.finalizing,
                completed_at: t.completed,
                failed_at: t.failed,
                expired_at: t.expired,
                cancelling_at: t.cancelling,
                cancelled_at: t.cancelled,
                request_counts: self.counts.into(),
                metadata: self.metadata.clone(),
            },
            model: self.model.clone(),
            usage: self.usage,
            x_request_counts: self.fine_counts,
        }
    }
}

/// A batch record as stored before [`StoredBatch`] was flat: the API's Batch object under
/// `batch`, the service's fields beside it. Only read, never written.
#[derive(Deserialize)]
struct EarlierBatch {
    tenant: String,
    batch: EarlierObject,
    window_secs: u64,
    #[serde(default)]
    output_expires_after: Option<u64>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

/// The Batch object as [`EarlierBatch`] held it.
#[derive(Deserialize)]
struct EarlierObject {
    #[serde(flatten)]
    batch: Batch,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    x_request_counts: FineCounts,
}

impl From<EarlierBatch> for StoredBatch {
    fn from(old: EarlierBatch) -> Self {
        let b = old.batch.batch;
        Self {
            id: b.id,
            tenant: old.tenant,
            status: b.status,
            input_file_id: b.input_file_id,
            endpoint: b.endpoint,
            completion_window: b.completion_window,
            window_secs: old.window_secs,
            output_expires_after: old.output_expires_after,
            metadata: b.metadata,
            headers: old.headers,
            model: old.batch.model,
            created_at: b.created_at,
            expires_at: b.expires_at,
            times: StatusTimes {
                in_progress: b.in_progress_at,
                finalizing: b.finalizing_at,
                completed: b.completed_at,
                failed: b.failed_at,
                expired: b.expired_at,
                cancelling: b.cancelling_at,
                cancelled: b.cancelled_at,
            },
            output_file_id: b.output_file_id,
            error_file_id: b.error_file_id,
            errors: b.errors.map(|e| e.data),
            counts: b.request_counts.into(),
            fine_counts: old.batch.x_request_counts,
            usage: old.batch.usage,
        }
    }
}

/// One page of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page<T> {
    /// The items, in the order asked for.
    pub data: Vec<T>,
    /// Whether more follow the last one.
    pub has_more: bool,
}
