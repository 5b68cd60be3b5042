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
/// ([`Stop::halt`]) that fires on the first of them, for every wait of a mode's run; and the
/// job's yield ([`Stop::drain`]), which a mode that drains ends gracefully, else a pause.
#[derive(Clone)]
pub struct Stop {
    halt: CancellationToken,
    drain: CancellationToken,
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
    /// Watches the deadline (Unix seconds), `cancel` and `pause`; `yielding` (the job's
    /// [`crate::Job::yield_slot`]) drains the run when the mode `drains`, else pauses it.
    pub(crate) fn new(
        deadline: i64,
        cancel: CancellationToken,
        pause: CancellationToken,
        yielding: CancellationToken,
        drains: bool,
    ) -> Self {
        let halt = CancellationToken::new();
        let pause_on_yield = (!drains).then(|| yielding.clone());
        let cause: Arc<OnceLock<Cause>> = Arc::default();
        let at = UNIX_EPOCH + Duration::from_secs(deadline.max(0) as u64);
        let left = at.duration_since(SystemTime::now()).unwrap_or_default();
        let task = {
            let (halt, cause, pause) = (halt.clone(), cause.clone(), pause.clone());
            tokio::spawn(async move {
                let yielded = async {
                    match pause_on_yield {
                        Some(yielding) => yielding.cancelled().await,
                        None => std::future::pending().await,
                    }
                };
                let first = tokio::select! {
                    biased;
                    _ = pause.cancelled() => Cause::Pause,
                    _ = yielded => Cause::Pause,
                    _ = cancel.cancelled() => Cause::Cancel,
                    _ = tokio::time::sleep(left) => Cause::Deadline,
                };
                let _ = cause.set(first);
                halt.cancel();
            })
        };
        Self {
            halt,
            drain: yielding,
            cause,
            _watch: Arc::new(WatchGuard(task.abort_handle())),
        }
    }

    /// Fires on the first of the deadline, a cancel and a pause: a mode's run returns soon
    /// after, with [`Stop::end`].
    pub fn halt(&self) -> &CancellationToken {
        &self.halt
    }

    /// Fires when the job yields its slot: a mode that drains takes no new line from then and
    /// returns once its requests in flight ended (then [`Stop::end`] is a pause).
    pub fn drain(&self) -> &CancellationToken {
        &self.drain
    }

    /// How the job ends because of the stop, once [`Stop::halt`] or [`Stop::drain`] fired;
    /// `None` before.
    pub fn end(&self) -> Option<End> {
        let cause = self.cause.get().copied().or_else(|| {
            // Fired once the halt did not: a drained run pauses.
            self.drain.is_cancelled().then_some(Cause::Pause)
        });
        cause.map(|c| match c {
            Cause::Deadline => End::Expired,
            Cause::Cancel => End::Cancelled,
            Cause::Pause => End::Paused,
        })
    }
}
