//! The limiter interface both algorithms implement, and the choice between them.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::{AimdConfig, AimdController, AimdError, Change, GradientConfig, GradientLimiter};

/// The work limiter's tolerance: per unit of work a window's cost varies little with the mix
/// of lengths, so queueing is taken for what it is sooner than by the plain gradient (1.3);
/// a model server past its knee is held within about a fifth of its unloaded time per token
/// (measured: 1.20 × in docs/benchmarks.md). Two queued windows in a row are needed, so the
/// machine's own hiccups are not taken for queueing.
const WORK_TOLERANCE: f64 = 1.15;

/// What one answer tells a limiter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// How long the answer took, send to last byte.
    pub latency: Duration,
    /// The gateway pushed back (429 or 5xx).
    pub overloaded: bool,
    /// Requests of this endpoint in flight when this one was sent, itself included.
    pub in_flight: usize,
    /// For an overload, the requests in flight when its answer came, itself included
    /// (requests sent after it may have reached the gateway first, and the ones it was
    /// refused beside leave one at a time); 0 when not known, as `in_flight` then.
    pub in_flight_at_answer: usize,
    /// The limiter's [`Limiter::epoch`] when the request was sent.
    pub epoch: u64,
    /// The answer's `usage.completion_tokens`, when it has one.
    pub tokens: Option<u64>,
}

/// A concurrency limit moved by the answers of the requests it admits.
///
/// The caller notes [`epoch`](Limiter::epoch) when it sends a request and hands it back in the
/// [`Sample`]: an overload met by a request sent before the last cut belongs to that cut.
pub trait Limiter: fmt::Debug + Send {
    /// The limit in force.
    fn limit(&self) -> usize;
    /// How many overload cuts have been applied.
    fn epoch(&self) -> u64;
    /// Feeds one answer; returns the move of the limit it caused, if any.
    fn on_result(&mut self, sample: Sample) -> Option<Change>;
    /// Which algorithm this is.
    fn algorithm(&self) -> Algorithm;
}

impl Limiter for AimdController {
    fn limit(&self) -> usize {
        AimdController::limit(self)
    }

    fn epoch(&self) -> u64 {
        AimdController::epoch(self)
    }

    /// The reference rules: latency and the in-flight count are not used.
    fn on_result(&mut self, sample: Sample) -> Option<Change> {
        if sample.overloaded {
            self.on_overload_since(sample.epoch)
        } else {
            self.on_success()
        }
    }

    fn algorithm(&self) -> Algorithm {
        Algorithm::Aimd
    }
}

/// The limiter algorithms (`concurrency.aimd.algorithm`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// The reference processor's AIMD ([`AimdController`]), fed once per dispatch.
    #[default]
    Aimd,
    /// [`GradientLimiter`]: latency floor and in-flight count, fed once per attempt.
    Gradient,
    /// The gradient limiter's rules on latency per unit of work ([`GradientConfig::per_work`]):
    /// each answer's time is weighed by its `usage.completion_tokens` plus the fixed cost of an
    /// answer, learnt from the answers, so that answers of varied length do not look like
    /// queueing; a 429/5xx is the decisive signal. Fed once per attempt.
    Work,
}

impl Algorithm {
    /// Every algorithm, in the order the docs list them.
    pub const ALL: [Algorithm; 3] = [Algorithm::Aimd, Algorithm::Gradient, Algorithm::Work];

    /// The name used in the config.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Aimd => "aimd",
            Algorithm::Gradient => "gradient",
            Algorithm::Work => "work",
        }
    }

    /// Whether the limiter hears every attempt (and a request gives its permits back while it
    /// backs off), rather than the final answer of each dispatch as the reference does.
    pub fn per_attempt(self) -> bool {
        self != Algorithm::Aimd
    }

    /// A limiter of this algorithm for `config`. The reference starts at `max`; the gradient
    /// and work limiters start at `min` and slow-start, and ignore `backoff_factor`
    /// (`additive_increase` is their first step).
    pub fn build(self, config: AimdConfig) -> Result<Box<dyn Limiter>, AimdError> {
        let gradient = GradientConfig {
            min: config.min,
            max: config.max,
            initial: config.min,
            initial_step: config.additive_increase,
            ..GradientConfig::default()
        };
        Ok(match self {
            Algorithm::Aimd => Box::new(AimdController::new(config)?),
            Algorithm::Gradient => Box::new(GradientLimiter::new(gradient)?),
            Algorithm::Work => Box::new(GradientLimiter::new(GradientConfig {
                per_work: true,
                tolerance: WORK_TOLERANCE,
                confirm_windows: 2,
                ..gradient
            })?),
        })
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = AimdError;

    fn from_str(s: &str) -> Result<Self, AimdError> {
        Algorithm::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| AimdError::UnknownAlgorithm(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for a in Algorithm::ALL {
            assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
        }
        let err = "vegas".parse::<Algorithm>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown limiter algorithm \"vegas\" (aimd, gradient, work)"
        );
    }

    #[test]
    fn the_reference_behind_the_trait_keeps_its_rules() {
        let mut l = Algorithm::Aimd.build(AimdConfig::default()).unwrap();
        assert_eq!(l.algorithm(), Algorithm::Aimd);
        let sample = |overloaded, epoch| Sample {
            latency: Duration::from_millis(1),
            overloaded,
            in_flight: 10,
            in_flight_at_answer: 0,
            epoch,
            tokens: None,
        };
        assert_eq!(
            l.on_result(sample(true, 0)),
            Some(Change::Decreased { from: 10, to: 5 })
        );
        assert_eq!(l.on_result(sample(true, 0)), None, "same episode");
        for _ in 0..4 {
            assert_eq!(l.on_result(sample(false, 1)), None);
        }
        assert_eq!(
            l.on_result(sample(false, 1)),
            Some(Change::Increased { from: 5, to: 6 })
        );
    }

    #[test]
    fn the_gradient_limiter_starts_at_min() {
        let l = Algorithm::Gradient.build(AimdConfig::default()).unwrap();
        assert_eq!((l.algorithm(), l.limit()), (Algorithm::Gradient, 5));
        let bad = AimdConfig {
            min: 0,
            ..AimdConfig::default()
        };
        assert!(Algorithm::Gradient.build(bad).is_err());
    }
}
