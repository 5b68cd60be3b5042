//! A server process a test owns: killed when asked or dropped, waited for until it is ready.

use std::process::Child;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A child server process, or none while it is stopped. Killed (as `kill -9` would) when
/// dropped, so no server outlives the value that started it.
#[derive(Debug, Default)]
pub(crate) struct Process(Mutex<Option<Child>>);

impl Process {
    /// Owns `child` from now on, killing the one held before.
    pub(crate) fn set(&self, child: Child) {
        self.kill();
        *self.lock() = Some(child);
    }

    /// Kills and reaps the process, if there is one.
    pub(crate) fn kill(&self) {
        if let Some(mut child) = self.lock().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether there is a process and it has not exited.
    pub(crate) fn is_running(&self) -> bool {
        matches!(self.lock().as_mut().map(Child::try_wait), Some(Ok(None)))
    }

    /// Whether a process was started and not killed since (it may have exited).
    pub(crate) fn is_held(&self) -> bool {
        self.lock().is_some()
    }

    /// The process id, while there is a process.
    pub(crate) fn id(&self) -> Option<u32> {
        self.lock().as_ref().map(Child::id)
    }

    /// Asks `ready` every `poll` until it says yes; an error naming `what` (the server) when the
    /// process exits first, or `sign` (what `ready` looks for) when `limit` passes.
    pub(crate) fn wait_ready(
        &self,
        what: &str,
        sign: &str,
        limit: Duration,
        poll: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(Ok(Some(status))) = self.lock().as_mut().map(Child::try_wait) {
                return Err(format!("{what} exited with {status}"));
            }
            if ready() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("no {sign} within {} s", limit.as_secs()));
            }
            std::thread::sleep(poll);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        // A panic while the lock was held leaves the child as it was: still ours to kill.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}
