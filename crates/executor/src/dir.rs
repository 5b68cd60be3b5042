//! A job directory's own bookkeeping: the lock that makes one process its only writer, and the
//! manifest that ties the directory to one input file and to the result lists its requests name.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use batch_consumer::Holder;
use serde::{Deserialize, Serialize};

use crate::ExecError;

/// The lock file in a job directory.
pub const LOCK_FILE: &str = ".lock";
/// The manifest in a job directory.
pub const MANIFEST_FILE: &str = "job-state.json";

/// An exclusive lock on a job directory, held while a process runs the job.
#[derive(Debug)]
pub(crate) struct DirLock {
    _file: File,
}

impl DirLock {
    /// Locks `dir`, or says which process holds it.
    pub(crate) fn take(dir: &Path) -> Result<Self, ExecError> {
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

impl Manifest {
    pub(crate) fn read(dir: &Path) -> Result<Option<Manifest>, ExecError> {
        let path = dir.join(MANIFEST_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
                ExecError::io(
                    &path,
                    std::io::Error::new(std::io::ErrorKind::InvalidData, e),
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(ExecError::io(&path, e)),
        }
    }

    /// Writes the manifest atomically.
    pub(crate) fn write(&self, dir: &Path) -> Result<(), ExecError> {
        batch_sink::write_json_atomically(dir, MANIFEST_FILE, self)
            .map_err(|e| ExecError::io(&dir.join(MANIFEST_FILE), e))
    }
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
}
