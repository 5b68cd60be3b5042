#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod controller;
mod gradient;
mod limiter;
mod semaphore;
mod turns;
mod work;

pub use controller::{AimdConfig, AimdController, Change};
pub use gradient::{GradientConfig, GradientLimiter};
pub use limiter::{Algorithm, Limiter, Sample};
pub use semaphore::{AdaptivePermit, AdaptiveSemaphore, MAX_LIMIT};
pub use turns::{Flow, USAGE_HALF_LIFE};

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
