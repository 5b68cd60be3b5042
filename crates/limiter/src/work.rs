//! What an answer's length costs: a running fit of `latency = a + b × completion_tokens`, so a
//! window of latencies can be measured per unit of work instead of per answer.
//!
//! An inference answer takes prompt processing plus its tokens times the time per output
//! token, and lengths vary 10-100×: a window of long answers takes several times what a
//! window of short ones takes on an idle server. Per unit of work (one output token, plus
//! the fixed cost counted in tokens, `k = a / b`) both windows cost the same, and only the
//! load changes what a unit costs.

/// Samples the fit remembers (exponential decay).
const MEMORY: f64 = 2048.0;
/// The fixed cost, in tokens, is kept within these bounds: at least one token, so a window of
/// one-token answers is not all fixed cost, and at most this many, where lengths no longer
/// matter (a gateway whose latency ignores the length).
const K_MIN: f64 = 1.0;
const K_MAX: f64 = 10_000.0;

/// The fit, as decayed sums.
#[derive(Debug, Clone, Default)]
pub(crate) struct WorkModel {
    n: f64,
    t: f64,
    y: f64,
    tt: f64,
    ty: f64,
}

impl WorkModel {
    /// Adds one answer of `tokens` output tokens that took `latency` seconds.
    pub(crate) fn add(&mut self, tokens: f64, latency: f64) {
        let keep = 1.0 - 1.0 / MEMORY;
        self.n = self.n * keep + 1.0;
        self.t = self.t * keep + tokens;
        self.y = self.y * keep + latency;
        self.tt = self.tt * keep + tokens * tokens;
        self.ty = self.ty * keep + tokens * latency;
    }

    /// The mean length seen, for answers that report none.
    pub(crate) fn mean_tokens(&self) -> f64 {
        if self.n > 0.0 {
            self.t / self.n
        } else {
            0.0
        }
    }

    /// The fixed cost of an answer in output tokens, `a / b`; [`K_MAX`] while lengths do not
    /// explain the latency (too few samples, no spread, or no positive slope).
    pub(crate) fn fixed_tokens(&self) -> f64 {
        if self.n < 2.0 {
            return K_MAX;
        }
        let mean_t = self.t / self.n;
        let mean_y = self.y / self.n;
        let var = self.tt / self.n - mean_t * mean_t;
        let cov = self.ty / self.n - mean_t * mean_y;
        // Less spread than a tenth of a token: the slope would be noise.
        if var < 0.01 || cov <= 0.0 {
            return K_MAX;
        }
        let b = cov / var;
        let a = mean_y - b * mean_t;
        (a / b).clamp(K_MIN, K_MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_finds_the_fixed_cost_in_tokens() {
        let mut m = WorkModel::default();
        assert_eq!(m.fixed_tokens(), K_MAX);
        // 10 ms + 1 ms per token.
        for t in [3.0, 40.0, 17.0, 120.0, 55.0, 8.0] {
            m.add(t, 0.010 + 0.001 * t);
        }
        assert!(
            (m.fixed_tokens() - 10.0).abs() < 1e-6,
            "{}",
            m.fixed_tokens()
        );
        assert!((m.mean_tokens() - 40.5).abs() < 0.1);
    }

    #[test]
    fn without_spread_or_slope_lengths_do_not_count() {
        let mut same = WorkModel::default();
        let mut flat = WorkModel::default();
        for t in [3.0, 40.0, 17.0, 120.0] {
            same.add(16.0, 0.02 + t * 1e-4);
            flat.add(t, 0.02);
        }
        assert_eq!(same.fixed_tokens(), K_MAX);
        assert_eq!(flat.fixed_tokens(), K_MAX);
    }
}
