//! Median and spread of repeated measurements.

/// The runs of one figure: median and the range min–max.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Every run's value, in run order.
    pub runs: Vec<f64>,
}

impl Summary {
    /// Summarizes `runs` (in run order).
    pub fn new(runs: Vec<f64>) -> Self {
        Self { runs }
    }

    /// A figure measured once.
    pub fn one(value: f64) -> Self {
        Self { runs: vec![value] }
    }

    fn sorted(&self) -> Vec<f64> {
        let mut v: Vec<f64> = self.runs.iter().copied().filter(|x| !x.is_nan()).collect();
        v.sort_by(f64::total_cmp);
        v
    }

    /// The median (mean of the two middle values for an even count); NaN without runs.
    pub fn median(&self) -> f64 {
        let v = self.sorted();
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }

    /// The smallest run; NaN without runs.
    pub fn min(&self) -> f64 {
        self.sorted().first().copied().unwrap_or(f64::NAN)
    }

    /// The largest run; NaN without runs.
    pub fn max(&self) -> f64 {
        self.sorted().last().copied().unwrap_or(f64::NAN)
    }

    /// Index (in run order) of the run closest to the median, for picking a representative run.
    pub fn median_run(&self) -> Option<usize> {
        let m = self.median();
        (0..self.runs.len()).min_by(|&a, &b| {
            (self.runs[a] - m)
                .abs()
                .total_cmp(&(self.runs[b] - m).abs())
        })
    }
}

/// The setting whose runs have the highest median, and that median: `(1, NaN)` without any.
pub fn best_median(settings: &[(usize, Summary)]) -> (usize, f64) {
    settings
        .iter()
        .max_by(|a, b| a.1.median().total_cmp(&b.1.median()))
        .map(|(setting, runs)| (*setting, runs.median()))
        .unwrap_or((1, f64::NAN))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(Summary::new(vec![3.0, 1.0, 2.0]).median(), 2.0);
        assert_eq!(Summary::new(vec![4.0, 1.0, 2.0, 3.0]).median(), 2.5);
        assert!(Summary::new(vec![]).median().is_nan());
    }

    #[test]
    fn spread_and_representative_run() {
        let s = Summary::new(vec![10.0, 30.0, 20.0, 21.0, 5.0]);
        assert_eq!((s.min(), s.max()), (5.0, 30.0));
        assert_eq!(s.median(), 20.0);
        assert_eq!(s.median_run(), Some(2));
        assert_eq!(Summary::new(vec![]).median_run(), None);
    }
}
