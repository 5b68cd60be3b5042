//! Adaptive concurrency for one inference endpoint.
//!
//! - [`AimdController`]: the reference processor's AIMD rules as pure state. After `limit`
//!   consecutive successes the limit grows by `additive_increase` (capped at `max`); on
//!   backpressure it becomes `max(min, floor(limit × backoff_factor))` and the success count
//!   restarts. It starts at `max`.
//! - [`GradientLimiter`]: tracks the gateway's latency floor, grows while latency stays near
//!   it, shrinks toward `in_flight × floor / latency` when it rises, and on a 429 cuts to the
//!   concurrency that was refused instead of halving.
//! - [`Algorithm::Work`]: the gradient limiter measuring latency per unit of work (each
//!   answer's output tokens plus the fixed cost of an answer, learnt from the answers), so
//!   that answers of varied length are not taken for queueing.
//! - [`Limiter`]: what they implement; [`Algorithm`] picks one by its config name.
//! - [`AdaptiveSemaphore`]: an async, FIFO semaphore whose limit can move while permits are held.
//!   Lowering never interrupts holders (newcomers wait until `holders < limit`); raising wakes
//!   waiters; a permit is released exactly once, when dropped.
//!
//! The caller wires them together: classify each finished request, feed the controller, and
//! copy the controller's limit into the semaphore.
//!
//! ```
//! use batch_limiter::{AdaptiveSemaphore, AimdConfig, AimdController, Change};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), batch_limiter::AimdError> {
//! let mut aimd = AimdController::new(AimdConfig { min: 2, max: 8, backoff_factor: 0.5, additive_increase: 1 })?;
//! let semaphore = AdaptiveSemaphore::new(aimd.limit());
//!
//! let permit = semaphore.acquire().await?;
//! // ... the request came back 429 ...
//! if let Some(change) = aimd.on_overload() {
//!     semaphore.set_limit(change.new_limit());
//! }
//! assert_eq!(aimd.on_overload(), Some(Change::Decreased { from: 4, to: 2 }));
//! semaphore.set_limit(aimd.limit());
//! drop(permit);
//! assert_eq!(semaphore.limit(), 2);
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod controller;
mod gradient;
mod limiter;
mod semaphore;
mod work;

pub use controller::{AimdConfig, AimdController, Change};
pub use gradient::{GradientConfig, GradientLimiter};
pub use limiter::{Algorithm, Limiter, Sample};
pub use semaphore::{AdaptivePermit, AdaptiveSemaphore, MAX_LIMIT};

/// What can go wrong with the controller or the semaphore.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AimdError {
    /// An [`AimdConfig`] breaks a constraint.
    #[error("invalid AIMD config: {0}")]
    InvalidConfig(String),
    /// [`AdaptiveSemaphore::try_acquire`] found no free permit.
    #[error("no permit is free")]
    NoPermits,
    /// The semaphore was closed.
    #[error("the semaphore is closed")]
    Closed,
    /// [`Algorithm`] names no such algorithm.
    #[error("unknown limiter algorithm {0:?} (aimd, gradient, work)")]
    UnknownAlgorithm(String),
}

impl AimdError {
    fn invalid(message: impl Into<String>) -> Self {
        AimdError::InvalidConfig(message.into())
    }
}

/// The bounds every limiter keeps its limit in: `1 <= min <= max`.
fn check_bounds(min: usize, max: usize) -> Result<(), AimdError> {
    if min == 0 {
        return Err(AimdError::invalid("min must be at least 1"));
    }
    if min > max {
        return Err(AimdError::invalid(format!(
            "min ({min}) must not exceed max ({max})"
        )));
    }
    Ok(())
}
