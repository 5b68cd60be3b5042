//! The AIMD rules, as pure state: no clock, no locks, no I/O.

use crate::AimdError;

/// Parameters of an [`AimdController`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AimdConfig {
    /// The floor: a decrease never goes below it. At least 1.
    pub min: usize,
    /// The ceiling and the initial limit (`concurrency.per_endpoint`).
    pub max: usize,
    /// A decrease multiplies the limit by this, then floors; in (0, 1).
    pub backoff_factor: f64,
    /// An increase adds this, capped at `max`; at least 1.
    pub additive_increase: usize,
}

impl Default for AimdConfig {
    /// The reference processor's defaults: min 5, max 10, factor 0.5, increase 1.
    fn default() -> Self {
        Self {
            min: 5,
            max: 10,
            backoff_factor: 0.5,
            additive_increase: 1,
        }
    }
}

impl AimdConfig {
    /// Checks the constraints the rules rely on (they keep the limit in `[min, max]` and above 0).
    pub fn validate(&self) -> Result<(), AimdError> {
        crate::check_bounds(self.min, self.max)?;
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return Err(AimdError::invalid(format!(
                "backoff_factor must be in (0, 1), got {}",
                self.backoff_factor
            )));
        }
        if self.additive_increase == 0 {
            return Err(AimdError::invalid("additive_increase must be at least 1"));
        }
        Ok(())
    }
}

/// A move of the limit, returned by the controller so the caller can apply it and count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// A full window of successes raised the limit.
    Increased {
        /// The limit before.
        from: usize,
        /// The limit after.
        to: usize,
    },
    /// Backpressure lowered the limit.
    Decreased {
        /// The limit before.
        from: usize,
        /// The limit after.
        to: usize,
    },
}

impl Change {
    /// The limit after the change.
    pub fn new_limit(&self) -> usize {
        match *self {
            Change::Increased { to, .. } | Change::Decreased { to, .. } => to,
        }
    }
}

/// Additive-increase / multiplicative-decrease of a concurrency limit.
///
/// The window is the current limit: after `limit` consecutive successes the limit grows by
/// `additive_increase` (capped at `max`); on backpressure it becomes
/// `max(min, floor(limit × backoff_factor))` and the success count restarts, even at the floor.
#[derive(Debug, Clone)]
pub struct AimdController {
    config: AimdConfig,
    limit: usize,
    successes: usize,
    epoch: u64,
}

impl AimdController {
    /// A controller starting at `config.max`, after checking `config`.
    pub fn new(config: AimdConfig) -> Result<Self, AimdError> {
        config.validate()?;
        Ok(Self {
            config,
            limit: config.max,
            successes: 0,
            epoch: 0,
        })
    }

    /// The limit in force.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Consecutive successes counted toward the next increase.
    pub fn successes(&self) -> usize {
        self.successes
    }

    /// The parameters.
    pub fn config(&self) -> &AimdConfig {
        &self.config
    }

    /// Records a success; returns the increase when this success completed a window.
    pub fn on_success(&mut self) -> Option<Change> {
        self.successes += 1;
        if self.successes < self.limit {
            return None;
        }
        self.successes = 0;
        let from = self.limit;
        let to = from
            .saturating_add(self.config.additive_increase)
            .min(self.config.max);
        if to == from {
            return None;
        }
        self.limit = to;
        Some(Change::Increased { from, to })
    }

    /// How many overloads have been applied so far. A request notes it when admitted and hands
    /// it back to [`AimdController::on_overload_since`].
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Records backpressure met by a request admitted at `epoch`: ignored when an overload has
    /// been applied since. The requests that were in flight under the old, higher limit all
    /// meet the same overload; cutting the limit once per episode keeps them from driving it
    /// to the floor in one burst.
    pub fn on_overload_since(&mut self, epoch: u64) -> Option<Change> {
        if epoch != self.epoch {
            return None;
        }
        self.on_overload()
    }

    /// Records backpressure; returns the decrease unless the limit was already at the floor.
    pub fn on_overload(&mut self) -> Option<Change> {
        self.epoch += 1;
        self.successes = 0;
        let from = self.limit;
        // Limits are small integers, so the f64 round trip is exact.
        let scaled = (from as f64 * self.config.backoff_factor).floor() as usize;
        let to = scaled.max(self.config.min);
        if to == from {
            return None;
        }
        self.limit = to;
        Some(Change::Decreased { from, to })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn controller(min: usize, max: usize, factor: f64, inc: usize) -> AimdController {
        AimdController::new(AimdConfig {
            min,
            max,
            backoff_factor: factor,
            additive_increase: inc,
        })
        .unwrap()
    }

    #[test]
    fn one_overload_episode_cuts_once() {
        let mut c = controller(2, 32, 0.5, 1);
        let admitted = c.epoch();
        // 32 requests were in flight when the gateway filled up; all of them meet a 429.
        assert_eq!(
            c.on_overload_since(admitted),
            Some(Change::Decreased { from: 32, to: 16 })
        );
        for _ in 0..31 {
            assert_eq!(c.on_overload_since(admitted), None);
        }
        assert_eq!(c.limit(), 16);
        // A request admitted after the cut reports a new episode.
        let later = c.epoch();
        assert_eq!(
            c.on_overload_since(later),
            Some(Change::Decreased { from: 16, to: 8 })
        );
    }

    #[test]
    fn starts_at_max() {
        assert_eq!(controller(5, 10, 0.5, 1).limit(), 10);
    }

    #[test]
    fn decrease_multiplies_floors_and_clamps_to_min() {
        let mut c = controller(5, 20, 0.5, 1);
        assert_eq!(
            c.on_overload(),
            Some(Change::Decreased { from: 20, to: 10 })
        );
        assert_eq!(c.on_overload(), Some(Change::Decreased { from: 10, to: 5 }));
        assert_eq!(c.on_overload(), None, "at the floor");
        assert_eq!(c.limit(), 5);

        let mut odd = controller(1, 7, 0.5, 1);
        assert_eq!(
            odd.on_overload(),
            Some(Change::Decreased { from: 7, to: 3 })
        );
        let mut thirds = controller(1, 10, 0.7, 1);
        thirds.on_overload();
        assert_eq!(thirds.limit(), 7, "floor(10 × 0.7)");
    }

    #[test]
    fn increase_after_a_full_window_of_successes() {
        let mut c = controller(2, 10, 0.5, 1);
        c.on_overload();
        c.on_overload();
        c.on_overload();
        assert_eq!(c.limit(), 2);
        assert_eq!(c.on_success(), None);
        assert_eq!(c.on_success(), Some(Change::Increased { from: 2, to: 3 }));
        assert_eq!(c.successes(), 0);
        // The next window is the new limit: 3 successes.
        assert_eq!(c.on_success(), None);
        assert_eq!(c.on_success(), None);
        assert_eq!(c.on_success(), Some(Change::Increased { from: 3, to: 4 }));
    }

    #[test]
    fn increase_is_capped_at_max() {
        let mut c = controller(1, 10, 0.9, 5);
        c.on_overload(); // 9
        for _ in 0..8 {
            assert_eq!(c.on_success(), None);
        }
        assert_eq!(c.on_success(), Some(Change::Increased { from: 9, to: 10 }));
        for _ in 0..10 {
            assert_eq!(c.on_success(), None, "at max nothing moves");
        }
        assert_eq!(c.limit(), 10);
    }

    #[test]
    fn overload_resets_the_window_even_at_the_floor() {
        let mut c = controller(5, 5, 0.5, 1);
        for _ in 0..4 {
            c.on_success();
        }
        assert_eq!(c.successes(), 4);
        assert_eq!(c.on_overload(), None);
        assert_eq!(c.successes(), 0);
    }

    #[test]
    fn worked_defaults_take_180_successes_back_to_max() {
        let mut c = controller(5, 20, 0.5, 1);
        c.on_overload();
        c.on_overload();
        let mut n = 0;
        while c.limit() < 20 {
            c.on_success();
            n += 1;
        }
        assert_eq!(n, (5..20).sum::<usize>());
        assert_eq!(n, 180);
    }

    #[test]
    fn sawtooth() {
        // Overload whenever the limit reaches 8: the limit must cycle 8 → 4 → … → 8.
        let mut c = controller(2, 16, 0.5, 1);
        c.on_overload(); // 8
        let mut trace = vec![c.limit()];
        for _ in 0..3 {
            c.on_overload();
            trace.push(c.limit());
            while c.limit() < 8 {
                if let Some(change) = c.on_success() {
                    trace.push(change.new_limit());
                }
            }
        }
        assert_eq!(
            trace,
            vec![8, 4, 5, 6, 7, 8, 4, 5, 6, 7, 8, 4, 5, 6, 7, 8],
            "a regular sawtooth"
        );
    }

    #[test]
    fn invalid_configs_are_refused() {
        let ok = AimdConfig::default();
        assert!(ok.validate().is_ok());
        for bad in [
            AimdConfig { min: 0, ..ok },
            AimdConfig { min: 11, ..ok },
            AimdConfig {
                backoff_factor: 0.0,
                ..ok
            },
            AimdConfig {
                backoff_factor: 1.0,
                ..ok
            },
            AimdConfig {
                backoff_factor: f64::NAN,
                ..ok
            },
            AimdConfig {
                additive_increase: 0,
                ..ok
            },
        ] {
            assert!(AimdController::new(bad).is_err(), "{bad:?}");
        }
    }
}
