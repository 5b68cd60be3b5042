//! A job's output directory, owned by [`JobDir`]: its layout (`.lock`, `job-state.json`,
//! `batch.json`, `output.jsonl`, `error.jsonl`), the lock that makes one process its only
//! writer, the manifest that ties it to one input file (and keeps the dispatch mode's record),
//! the atomic writes of its small files, and the result files' sink.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use batch_consumer::Holder;
use batch_sink::{JobSink, BATCH_FILE, ERROR_FILE, OUTPUT_FILE};
use batch_wire::Batch;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::ExecError;

/// The lock file in a job directory.
pub const LOCK_FILE: &str = ".lock";
/// The manifest in a job directory.
pub const MANIFEST_FILE: &str = "job-state.json";

/// A job's output directory, locked by this process: every read and write of its files goes
/// through it. The reads that need no lock (a directory's `batch.json` before its job is run)
/// are its associated functions taking a path.
#[derive(Debug)]
pub(crate) struct JobDir {
    path: PathBuf,
    _lock: DirLock,
}

impl JobDir {
    /// Creates `path` if needed and locks it, or says which process holds it.
    pub(crate) fn open(path: &Path) -> Result<Self, ExecError> {
        std::fs::create_dir_all(path).map_err(|e| ExecError::io(path, e))?;
        Ok(Self {
            _lock: DirLock::take(path)?,
            path: path.to_owned(),
        })
    }

    /// The directory.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The directory's `batch.json`, `None` before its job's first run.
    pub(crate) fn batch(&self) -> Result<Option<Batch>, ExecError> {
        Self::batch_at(&self.path)
    }

    /// Writes `batch.json` atomically.
    pub(crate) fn write_batch(&self, batch: &Batch) -> Result<(), ExecError> {
        self.write_json(BATCH_FILE, batch)
    }

    /// The directory's manifest, `None` before its job's first run.
    pub(crate) fn manifest(&self) -> Result<Option<Manifest>, ExecError> {
        Self::manifest_at(&self.path)
    }

    /// Writes the manifest atomically.
    pub(crate) fn write_manifest(&self, manifest: &Manifest) -> Result<(), ExecError> {
        self.write_json(MANIFEST_FILE, manifest)
    }

    /// The manifest's bytes as they are (for a checkpoint).
    pub(crate) fn manifest_bytes(&self) -> Result<Vec<u8>, ExecError> {
        let path = self.path.join(MANIFEST_FILE);
        std::fs::read(&path).map_err(|e| ExecError::io(&path, e))
    }

    /// The manifest of the job's first run; on a resume, the input (`record`) must be the file
    /// the job started with.
    pub(crate) fn tie_to_input(
        &self,
        job_id: &str,
        input: &Path,
        record: InputRecord,
    ) -> Result<Manifest, ExecError> {
        match self.manifest()? {
            Some(m) if m.input.bytes != record.bytes || m.input.xxh3 != record.xxh3 => {
                Err(ExecError::InputChanged {
                    dir: self.path.clone(),
                    input: input.to_owned(),
                    was: m.input.bytes,
                    now: record.bytes,
                })
            }
            Some(m) => Ok(m),
            None => {
                let m = Manifest {
                    job_id: job_id.to_owned(),
                    input: record,
                    mode: serde_json::Map::new(),
                };
                self.write_manifest(&m)?;
                Ok(m)
            }
        }
    }

    /// Opens (creating or resuming) the result files of job `job_id` of `total` requests.
    pub(crate) fn open_sink(&self, job_id: &str, total: u64) -> Result<JobSink, ExecError> {
        Ok(JobSink::open(&self.path, job_id, total)?)
    }

    /// Result file `file` (`output.jsonl`, `error.jsonl`) opened for reading at its start;
    /// `None` for another name.
    pub(crate) fn open_result(&self, file: &str) -> Result<Option<File>, ExecError> {
        if file != OUTPUT_FILE && file != ERROR_FILE {
            return Ok(None);
        }
        let path = self.path.join(file);
        File::open(&path)
            .map(Some)
            .map_err(|e| ExecError::io(&path, e))
    }

    /// `batch.json` of the directory `path`, `None` when there is none. No lock is needed: the
    /// file is only ever replaced whole.
    pub(crate) fn batch_at(path: &Path) -> Result<Option<Batch>, ExecError> {
        read_json(&path.join(BATCH_FILE))
    }

    /// The manifest of the directory `path`, `None` when there is none (replaced whole, too).
    pub(crate) fn manifest_at(path: &Path) -> Result<Option<Manifest>, ExecError> {
        read_json(&path.join(MANIFEST_FILE))
    }

    /// Writes a checkpoint's `batch.json` and `job-state.json` into the directory `path`
    /// (created if needed), each atomically.
    pub(crate) fn restore(path: &Path, batch: &[u8], manifest: &[u8]) -> Result<(), ExecError> {
        std::fs::create_dir_all(path).map_err(|e| ExecError::io(path, e))?;
        for (name, bytes) in [(BATCH_FILE, batch), (MANIFEST_FILE, manifest)] {
            write_atomically(path, name, bytes)?;
        }
        Ok(())
    }

    fn write_json<T: Serialize>(&self, name: &str, value: &T) -> Result<(), ExecError> {
        let mut json = serde_json::to_vec_pretty(value)
            .map_err(|e| ExecError::io(&self.path.join(name), std::io::Error::other(e)))?;
        json.push(b'\n');
        write_atomically(&self.path, name, &json)
    }
}

/// Writes `bytes` into `dir/name` so that a reader (or a crash) sees the old file or the new
/// one whole: a temporary file beside it, synced, then renamed over it.
fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), ExecError> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, dir.join(name))
    };
    write().map_err(|e| ExecError::io(&dir.join(name), e))
}

/// The JSON file at `path`, `None` when there is none.
fn read_json<T: DeserializeOwned>(path: &Path) -> Result<Option<T>, ExecError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            ExecError::io(
                path,
                std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ExecError::io(path, e)),
    }
}

/// An exclusive lock on a job directory, held while a process runs the job.
#[derive(Debug)]
struct DirLock {
    _file: File,
}

impl DirLock {
    /// Locks `dir`, or says which process holds it.
    fn take(dir: &Path) -> Result<Self, ExecError> {
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| ExecError::io(&path, e))?;
        // SAFETY: flock on a file descriptor we own; no memory is shared.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(ExecError::io(&path, err));
            }
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            return Err(ExecError::Locked {
                dir: dir.to_owned(),
                holder: holder.trim().to_owned(),
            });
        }
        let me = format!(
            "pid {} on {}",
            std::process::id(),
            Holder::this_process().host
        );
        let write = (|| {
            file.set_len(0)?;
            file.rewind()?;
            file.write_all(me.as_bytes())
        })();
        write.map_err(|e| ExecError::io(&path, e))?;
        Ok(Self { _file: file })
    }
}

/// What a job directory remembers besides its Batch object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Manifest {
    /// The job.
    pub job_id: String,
    /// The input file as first planned.
    pub input: InputRecord,
    /// The dispatch mode's own record of the job (see [`crate::Job::mode_state`]), its fields
    /// beside the manifest's own.
    #[serde(flatten)]
    pub mode: serde_json::Map<String, serde_json::Value>,
}

/// Where the input was and what it held.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct InputRecord {
    /// The input file, absolute.
    pub path: PathBuf,
    /// Its size.
    pub bytes: u64,
    /// XXH3-64 of its content, hex.
    pub xxh3: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_names_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let held = DirLock::take(dir.path()).unwrap();
        let err = DirLock::take(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        drop(held);
        DirLock::take(dir.path()).expect("free again once released");
    }

    #[test]
    fn batch_json_is_replaced_atomically() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = JobDir::open(&tmp.path().join("job")).unwrap();
        assert!(dir.batch().unwrap().is_none());
        let mut batch = Batch::new("job", "in.jsonl", "24h", 1, 86401);
        dir.write_batch(&batch).unwrap();
        batch.set_status(batch_wire::BatchStatus::Completed, 5);
        dir.write_batch(&batch).unwrap();
        assert_eq!(JobDir::batch_at(dir.path()).unwrap().unwrap(), batch);
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, [LOCK_FILE, BATCH_FILE], "no temporary file left");
    }
}
