//! The end of a job: its result files go to storage as `batch_output` files, usage and finer
//! counts are read off them, and the record takes its final status.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use batch_state::{now_unix, Change, FileObject, StoredBatch, StoredFile, Usage};
use batch_storage::Storage;
use batch_wire::{error_codes, Batch};
use serde::Deserialize;

use crate::runner::fence::{Fence, RunError};

/// What a pass over the result files found.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Scan {
    pub output_lines: u64,
    pub error_lines: u64,
    pub usage: Usage,
    pub cancelled: u64,
    pub expired: u64,
}

#[derive(Deserialize)]
struct OutputLine {
    #[serde(default)]
    response: Option<Response>,
}

#[derive(Deserialize)]
struct Response {
    #[serde(default)]
    body: Option<Body>,
}

#[derive(Deserialize)]
struct Body {
    #[serde(default)]
    usage: Option<RawUsage>,
}

/// Chat/completions name tokens `prompt`/`completion`, the Responses API `input`/`output`.
#[derive(Deserialize, Default)]
struct RawUsage {
    #[serde(default, alias = "input_tokens")]
    prompt_tokens: u64,
    #[serde(default, alias = "output_tokens")]
    completion_tokens: u64,
    #[serde(default)]
    total_tokens: Option<u64>,
    #[serde(default, alias = "input_tokens_details")]
    prompt_tokens_details: Option<Details>,
    #[serde(default, alias = "output_tokens_details")]
    completion_tokens_details: Option<Details>,
}

#[derive(Deserialize, Default)]
struct Details {
    #[serde(default)]
    cached_tokens: u64,
    #[serde(default)]
    reasoning_tokens: u64,
}

#[derive(Deserialize)]
struct ErrorLine {
    #[serde(default)]
    error: Option<ErrorBody>,
}

#[derive(Deserialize)]
struct ErrorBody {
    #[serde(default)]
    code: String,
}

/// Reads `output.jsonl` and `error.jsonl` of `out` (either may be missing).
pub(crate) fn scan(out: &Path) -> std::io::Result<Scan> {
    let mut s = Scan::default();
    for_each_line(&out.join(batch_sink::OUTPUT_FILE), |line| {
        s.output_lines += 1;
        let usage = serde_json::from_str::<OutputLine>(line)
            .ok()
            .and_then(|l| l.response?.body?.usage);
        if let Some(u) = usage {
            s.usage.input_tokens += u.prompt_tokens;
            s.usage.output_tokens += u.completion_tokens;
            s.usage.total_tokens += u
                .total_tokens
                .unwrap_or(u.prompt_tokens + u.completion_tokens);
            s.usage.input_tokens_details.cached_tokens +=
                u.prompt_tokens_details.map_or(0, |d| d.cached_tokens);
            s.usage.output_tokens_details.reasoning_tokens += u
                .completion_tokens_details
                .map_or(0, |d| d.reasoning_tokens);
        }
    })?;
    for_each_line(&out.join(batch_sink::ERROR_FILE), |line| {
        s.error_lines += 1;
        let code = serde_json::from_str::<ErrorLine>(line)
            .ok()
            .and_then(|l| l.error)
            .map(|e| e.code);
        match code.as_deref() {
            Some(error_codes::BATCH_CANCELLED) => s.cancelled += 1,
            Some(error_codes::BATCH_EXPIRED) => s.expired += 1,
            _ => {}
        }
    })?;
    Ok(s)
}

fn for_each_line(path: &Path, mut f: impl FnMut(&str)) -> std::io::Result<()> {
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let mut reader = std::io::BufReader::with_capacity(256 * 1024, file);
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let trimmed = line.trim_end();
        if !trimmed.is_empty() {
            f(trimmed);
        }
    }
}

/// The id of a batch's output (`kind` = `output`) or error file: derived from the batch id, so
/// that finishing again after a crash replaces the same files instead of adding new ones.
pub(crate) fn result_file_id(batch_id: &str, kind: &str) -> String {
    let suffix = batch_id.strip_prefix("batch_").unwrap_or(batch_id);
    format!("file-{suffix}-{kind}")
}

/// Uploads the result files of the job in `dir` to `storage`, records them, and saves `record`
/// with the batch's final status, every write under `fence`.
pub(crate) async fn finish(
    fence: &Fence<'_>,
    storage: &Storage,
    record: &mut StoredBatch,
    batch: &Batch,
    dir: &Path,
) -> Result<(), RunError> {
    let out = dir.join("out");
    let id = record.batch.batch.id.clone();
    let scanned = {
        let dir = out.clone();
        tokio::task::spawn_blocking(move || scan(&dir))
            .await
            .map_err(|e| RunError::Other(format!("scanning results panicked: {e}")))?
            .map_err(|e| RunError::Other(format!("{}: {e}", out.display())))?
    };
    // Also proves the lease still holds before anything is uploaded.
    let results = scanned.output_lines + scanned.error_lines > 0;
    fence
        .advance(record, Change::Finalizing { batch, results })
        .await?;
    let expires_at = record
        .output_expires_after
        .map(|secs| now_unix() + secs as i64);
    let mut ids = [None, None];
    for (slot, (kind, file, lines)) in ids.iter_mut().zip([
        ("output", batch_sink::OUTPUT_FILE, scanned.output_lines),
        ("errors", batch_sink::ERROR_FILE, scanned.error_lines),
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
        usage: scanned.usage,
        cancelled: scanned.cancelled,
        expired: scanned.expired,
    };
    // Its storage copy (`layout::batch_copy`) is written by the save itself.
    fence.advance(record, ended).await?;
    tracing::info!(job = %id, status = record.batch.status().as_str(), "batch finished");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_and_codes_are_read_off_the_files() {
        let dir = batch_testkit::tempdir().unwrap();
        std::fs::write(
            dir.path().join("output.jsonl"),
            concat!(
                r#"{"id":"a","custom_id":"1","response":{"status_code":200,"body":{"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7,"prompt_tokens_details":{"cached_tokens":1}}}}}"#, "\n",
                r#"{"id":"b","custom_id":"2","response":{"status_code":200,"body":{"usage":{"input_tokens":10,"output_tokens":5,"output_tokens_details":{"reasoning_tokens":2}}}}}"#, "\n",
                r#"{"id":"c","custom_id":"3","response":{"status_code":400,"body":{"error":{}}}}"#, "\n",
            ),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("error.jsonl"),
            concat!(
                r#"{"id":"d","custom_id":"4","error":{"code":"batch_cancelled","message":"x"}}"#,
                "\n",
                r#"{"id":"e","custom_id":"5","error":{"code":"batch_expired","message":"x"}}"#,
                "\n",
                r#"{"id":"f","custom_id":"6","error":{"code":"server_error","message":"x"}}"#,
                "\n",
            ),
        )
        .unwrap();
        let s = scan(dir.path()).unwrap();
        assert_eq!(s.output_lines, 3);
        assert_eq!(s.error_lines, 3);
        assert_eq!((s.cancelled, s.expired), (1, 1));
        assert_eq!(s.usage.input_tokens, 13);
        assert_eq!(s.usage.output_tokens, 9);
        assert_eq!(s.usage.total_tokens, 22);
        assert_eq!(s.usage.input_tokens_details.cached_tokens, 1);
        assert_eq!(s.usage.output_tokens_details.reasoning_tokens, 2);
    }

    #[test]
    fn result_file_ids_follow_the_batch() {
        assert_eq!(result_file_id("batch_0abc", "output"), "file-0abc-output");
    }
}
