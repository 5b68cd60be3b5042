//! Why a running job stops before its last line: its deadline, a cancel, or a pause.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_util::sync::CancellationToken;

use crate::job::End;

/// What ended a job early, first come first kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    Deadline,
    Cancel,
    Pause,
}

/// The three ways a running job is stopped (its deadline, a cancel, a pause), and one token
/// ([`Stop::halt`]) that fires on the first of them, for every wait of a mode's run.
#[derive(Clone)]
pub struct Stop {
    halt: CancellationToken,
    cause: Arc<OnceLock<Cause>>,
    _watch: Arc<WatchGuard>,
}

struct WatchGuard(tokio::task::AbortHandle);

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Stop {
    /// Watches the deadline (Unix seconds), `cancel` and `pause`.
    pub(crate) fn new(deadline: i64, cancel: CancellationToken, pause: CancellationToken) -> Self {
        let halt = CancellationToken::new();
        let cause: Arc<OnceLock<Cause>> = Arc::default();
        let at = UNIX_EPOCH + Duration::from_secs(deadline.max(0) as u64);
        let left = at.duration_since(SystemTime::now()).unwrap_or_default();
        let task = {
            let (halt, cause, pause) = (halt.clone(), cause.clone(), pause.clone());
            tokio::spawn(async move {
                let first = tokio::select! {
                    biased;
                    _ = pause.cancelled() => Cause::Pause,
                    _ = cancel.cancelled() => Cause::Cancel,
                    _ = tokio::time::sleep(left) => Cause::Deadline,
                };
                let _ = cause.set(first);
                halt.cancel();
            })
        };
        Self {
            halt,
            cause,
            _watch: Arc::new(WatchGuard(task.abort_handle())),
        }
    }

    /// Fires on the first of the deadline, a cancel and a pause: a mode's run returns soon
    /// after, with [`Stop::end`].
    pub fn halt(&self) -> &CancellationToken {
        &self.halt
    }

    /// How the job ends because of the stop, once [`Stop::halt`] fired; `None` before.
    pub fn end(&self) -> Option<End> {
        self.cause.get().map(|c| match c {
            Cause::Deadline => End::Expired,
            Cause::Cancel => End::Cancelled,
            Cause::Pause => End::Paused,
        })
    }
}
