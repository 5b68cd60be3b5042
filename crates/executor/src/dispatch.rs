//! The seam between the executor and a dispatch mode: what a mode does with a job's requests
//! and results. The executor prepares a job (its plan, its result files), hands it to the mode,
//! and finishes it however the mode's run ends; the mode only gets lines answered.
//!
//! A mode reads the requests still without a result ([`Job::unresolved_records`],
//! [`Job::read_lines`]), writes what comes back ([`Job::record_all`]) and returns when every
//! line has one or [`Stop`] fires. What only one mode has (the sync mode's endpoint limits, the
//! async mode's consumer counters) are methods of its own type, reached through
//! [`crate::Executor::mode`].

use std::any::Any;
use std::sync::Arc;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::{End, ExecError, Job, Stop};

/// One way of getting a job's requests answered (sync: HTTP to the gateways; async: the
/// dispatcher's queues; dry run: answered locally). The executor drives jobs through it without
/// knowing which.
///
/// Every method but [`Dispatch::run`] has a default that does nothing, for a mode that keeps
/// nothing outside its runs.
pub trait Dispatch: Any + Send + Sync {
    /// Tightens the checks of a job's input for what the mode cannot carry (the async mode
    /// refuses lines the dispatcher would re-encode). Called before a job is planned.
    fn check_input(&self, _limits: &mut batch_plan::Limits) {}

    /// Makes a prepared job known before it runs (results of a resumed job may be waiting).
    fn register(&self, _job: &Arc<Job>) {}

    /// Forgets a job that ended.
    fn unregister(&self, _job: &Job) {}

    /// Gets every line of `job` without a result answered, or stops when `stop` fires, and says
    /// how the job's dispatch ended: [`End::Completed`] once no line is left, the end of the
    /// stop ([`Stop::end`]) when it fired, [`End::Failed`] when the mode cannot go on.
    fn run<'a>(&'a self, job: &'a Arc<Job>, stop: &'a Stop) -> BoxFuture<'a, End>;

    /// Whether the mode's run ends a yielding job itself ([`Stop::drain`]): it takes no new
    /// line and returns once its requests in flight ended. A mode that does not is stopped by
    /// a yield as by a pause ([`Stop::halt`]).
    fn drains(&self) -> bool {
        false
    }

    /// Takes back what is pending of a job that expired or was cancelled, before the executor
    /// closes its open lines; gives up when `stop` fires.
    fn withdraw<'a>(
        &'a self,
        _job: &'a Arc<Job>,
        _stop: &'a CancellationToken,
    ) -> BoxFuture<'a, Result<(), ExecError>> {
        Box::pin(async { Ok(()) })
    }

    /// Stops background work (the async mode's result consumers) and lets go of what it holds.
    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}
