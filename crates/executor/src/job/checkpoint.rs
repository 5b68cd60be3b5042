//! A consistent cut of a running job's files, and a directory restored from one.

use std::path::Path;

use super::Job;
use crate::dir::JobDir;
use crate::ExecError;

/// A cut of a running job's files (see [`Job::checkpoint`]); [`restore_checkpoint`] writes
/// the small files back into a directory where the result files' prefixes were put.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// Bytes of `output.jsonl` that hold whole lines.
    pub output_len: u64,
    /// Bytes of `error.jsonl` that hold whole lines.
    pub error_len: u64,
    /// `batch.json`.
    pub batch: Vec<u8>,
    /// `job-state.json` (the input's digest, the result lists the job's requests name).
    pub manifest: Vec<u8>,
}

/// Writes a checkpoint's `batch.json` and `job-state.json` into `dir`, which then resumes like
/// the directory the checkpoint was taken from (its result files are the caller's to put back).
pub fn restore_checkpoint(dir: &Path, batch: &[u8], manifest: &[u8]) -> Result<(), ExecError> {
    JobDir::restore(dir, batch, manifest)
}

impl Job {
    /// A consistent cut of the job's files, to copy elsewhere while it runs: the result files
    /// up to lengths that hold whole lines only, and the job's own small files as they are.
    pub fn checkpoint(&self) -> Result<Checkpoint, ExecError> {
        let (output_len, error_len) = {
            let mut sink = self.sink.lock().expect("sink lock");
            sink.flush()?;
            sink.committed_lengths()
        };
        let batch = serde_json::to_vec(&*self.batch.lock().expect("batch lock"))
            .expect("a batch serializes");
        let manifest = self.dir.manifest_bytes()?;
        Ok(Checkpoint {
            output_len,
            error_len,
            batch,
            manifest,
        })
    }

    /// The whole lines result file `file` (`output.jsonl`, `error.jsonl`) holds so far: the
    /// file opened at its start and the length they take, the sink's last flushed line (one
    /// being written is never in it); `None` for another name.
    pub fn result_lines(&self, file: &str) -> Result<Option<(std::fs::File, u64)>, ExecError> {
        let (output_len, error_len) = self.sink.lock().expect("sink lock").committed_lengths();
        let len = match file {
            batch_sink::OUTPUT_FILE => output_len,
            _ => error_len,
        };
        Ok(self.dir.open_result(file)?.map(|opened| (opened, len)))
    }
}
