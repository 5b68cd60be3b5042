//! When to retry and how long to wait: pure functions, so the rules are tested without a clock.

use std::time::{Duration, SystemTime};

/// Why the previous attempt is being retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RetryCause {
    /// No response: connection failure, reset, or timeout.
    Network,
    /// A retryable status (429 or 5xx).
    Status(u16),
}

/// Whether an answer with this status may be retried: 429 and 5xx, never other statuses.
pub(crate) fn is_retryable_status(status: u16) -> bool {
    status == 429 || (500..600).contains(&status)
}

/// The endpoint's backoff settings.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Backoff {
    /// The wait before retry number `retry` (0 = the first retry).
    ///
    /// `retry_after` (already parsed) wins, capped at `max`. Otherwise `initial × 2^retry`,
    /// tripled for a 429, capped at `max` (`max / 2` for 502/503/504), then scaled by `jitter`
    /// (drawn from [0.5, 1.5]) and capped again so the cap is a hard maximum.
    pub fn delay(
        &self,
        retry: u32,
        cause: RetryCause,
        retry_after: Option<Duration>,
        jitter: f64,
    ) -> Duration {
        if let (Some(wait), RetryCause::Status(_)) = (retry_after, cause) {
            return wait.min(self.max);
        }
        let exponential = self
            .initial
            .checked_mul(1u32.checked_shl(retry).unwrap_or(u32::MAX))
            .unwrap_or(Duration::MAX);
        let (base, cap) = match cause {
            RetryCause::Status(429) => (exponential.saturating_mul(3), self.max),
            RetryCause::Status(502..=504) => (exponential, self.max / 2),
            _ => (exponential, self.max),
        };
        base.min(cap).mul_f64(jitter.clamp(0.0, 2.0)).min(cap)
    }
}

/// A jitter factor uniformly drawn from [0.5, 1.5] (±50 %).
pub(crate) fn jitter() -> f64 {
    use rand::Rng;
    rand::rng().random_range(0.5..=1.5)
}

/// Reads a `Retry-After` value: delay-seconds or an HTTP date (a past date means now).
pub(crate) fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn backoff() -> Backoff {
        Backoff {
            initial: 100 * MS,
            max: 10_000 * MS,
        }
    }

    #[test]
    fn exponential_doubles_per_retry() {
        let b = backoff();
        let delays: Vec<_> = (0..4)
            .map(|n| b.delay(n, RetryCause::Network, None, 1.0))
            .collect();
        assert_eq!(delays, vec![100 * MS, 200 * MS, 400 * MS, 800 * MS]);
        assert_eq!(b.delay(0, RetryCause::Status(500), None, 1.0), 100 * MS);
    }

    #[test]
    fn jitter_scales_by_half_either_way() {
        let b = backoff();
        assert_eq!(b.delay(1, RetryCause::Network, None, 0.5), 100 * MS);
        assert_eq!(b.delay(1, RetryCause::Network, None, 1.5), 300 * MS);
        for _ in 0..1000 {
            let j = jitter();
            assert!((0.5..=1.5).contains(&j));
        }
    }

    #[test]
    fn a_429_without_retry_after_waits_three_times_the_base() {
        assert_eq!(
            backoff().delay(1, RetryCause::Status(429), None, 1.0),
            600 * MS
        );
    }

    #[test]
    fn gateway_errors_cap_at_half_the_max_backoff() {
        let b = backoff();
        for status in [502, 503, 504] {
            assert_eq!(
                b.delay(10, RetryCause::Status(status), None, 1.5),
                5_000 * MS
            );
        }
        assert_eq!(b.delay(10, RetryCause::Status(500), None, 1.0), 10_000 * MS);
        assert_eq!(b.delay(10, RetryCause::Network, None, 1.5), 10_000 * MS);
        // At the cap the jitter still spreads retries downwards.
        assert_eq!(b.delay(10, RetryCause::Status(503), None, 0.5), 2_500 * MS);
    }

    #[test]
    fn retry_after_wins_and_is_capped() {
        let b = backoff();
        let two = Some(Duration::from_secs(2));
        assert_eq!(b.delay(0, RetryCause::Status(429), two, 1.5), 2_000 * MS);
        assert_eq!(b.delay(0, RetryCause::Status(503), two, 0.5), 2_000 * MS);
        let long = Some(Duration::from_secs(3600));
        assert_eq!(b.delay(0, RetryCause::Status(429), long, 1.0), 10_000 * MS);
    }

    #[test]
    fn huge_retry_counts_saturate() {
        let b = backoff();
        assert_eq!(b.delay(200, RetryCause::Network, None, 1.0), 10_000 * MS);
        assert_eq!(
            b.delay(200, RetryCause::Status(429), None, 1.0),
            10_000 * MS
        );
    }

    #[test]
    fn retry_after_parses_seconds_and_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(parse_retry_after("3", now), Some(Duration::from_secs(3)));
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(7));
        assert_eq!(parse_retry_after(&later, now), Some(Duration::from_secs(7)));
        let earlier = httpdate::fmt_http_date(now - Duration::from_secs(7));
        assert_eq!(parse_retry_after(&earlier, now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-1", now), None);
        assert_eq!(parse_retry_after("", now), None);
    }

    #[test]
    fn only_429_and_5xx_are_retryable() {
        for s in [429, 500, 502, 503, 504, 599] {
            assert!(is_retryable_status(s), "{s}");
        }
        for s in [200, 201, 301, 400, 401, 403, 404, 408, 413, 422, 600] {
            assert!(!is_retryable_status(s), "{s}");
        }
    }
}
