//! The end of a job: its result files go to storage as `batch_output` files, and the record
//! takes its final status with the usage and finer counts the sink counted as it wrote them.

use std::path::{Path, PathBuf};

use batch_sink::Totals;
use batch_state::{now_unix, Change, FileObject, StoredBatch, StoredFile};
use batch_storage::Storage;
use batch_wire::Batch;

use crate::runner::fence::{Fence, RunError};

/// The id of a batch's output (`kind` = `output`) or error file: derived from the batch id, so
/// that finishing again after a crash replaces the same files instead of adding new ones.
pub(crate) fn result_file_id(batch_id: &str, kind: &str) -> String {
    let suffix = batch_id.strip_prefix("batch_").unwrap_or(batch_id);
    format!("file-{suffix}-{kind}")
}

/// Uploads the result files of the job in `dir` to `storage`, records them, and saves `record`
/// with the batch's final status and what the sink counted (`totals`), every write under
/// `fence`.
pub(crate) async fn finish(
    fence: &Fence<'_>,
    storage: &Storage,
    record: &mut StoredBatch,
    batch: &Batch,
    totals: &Totals,
    dir: &Path,
) -> Result<(), RunError> {
    let out = dir.join("out");
    let id = record.id.clone();
    // Also proves the lease still holds before anything is uploaded.
    let results = totals.output_lines + totals.error_lines > 0;
    fence
        .advance(record, Change::Finalizing { batch, results })
        .await?;
    let expires_at = record
        .output_expires_after
        .map(|secs| now_unix() + secs as i64);
    let mut ids = [None, None];
    for (slot, (kind, file, lines)) in ids.iter_mut().zip([
        ("output", batch_sink::OUTPUT_FILE, totals.output_lines),
        ("errors", batch_sink::ERROR_FILE, totals.error_lines),
    ]) {
        if lines == 0 {
            continue;
        }
        let file_id = result_file_id(&id, kind);
        let local: PathBuf = out.join(file);
        // Per epoch: a fenced replica's late upload lands beside the holder's, never on it.
        let key = batch_state::layout::result(&id, fence.lease.epoch, file);
        let bytes = storage.put_file(&key, &local).await?;
        let stored = StoredFile {
            tenant: record.tenant.clone(),
            file: FileObject {
                id: file_id.clone(),
                object: "file".into(),
                bytes,
                created_at: now_unix(),
                // The batch gateway's names, which its users' scripts look for.
                filename: match kind {
                    "output" => format!("batch_output_{id}.jsonl"),
                    _ => format!("batch_error_{id}.jsonl"),
                },
                purpose: "batch_output".into(),
                expires_at,
                status: "processed".into(),
                status_details: None,
            },
            key: Some(key.clone()),
        };
        fence
            .retry("recording a result file", || fence.store.put_file(&stored))
            .await?;
        *slot = Some(file_id);
    }
    let [output, errors] = ids;
    let ended = Change::Ended {
        batch,
        output_file_id: output.as_deref(),
        error_file_id: errors.as_deref(),
        usage: totals.usage,
        cancelled: totals.cancelled,
        expired: totals.expired,
    };
    // Its storage copy (`layout::batch_copy`) is written by the save itself.
    fence.advance(record, ended).await?;
    tracing::info!(job = %id, status = record.status.as_str(), "batch finished");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_file_ids_follow_the_batch() {
        assert_eq!(result_file_id("batch_0abc", "output"), "file-0abc-output");
    }
}
