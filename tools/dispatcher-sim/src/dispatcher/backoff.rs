//! The retry backoff of the contract: about 2–4 s, 4–8, 8–16, 16–32, then 30–60 s, with jitter;
//! a longer `Retry-After` wins.

use std::time::{Duration, SystemTime};

use rand::Rng;

/// The jitter window, in seconds, before retry number `attempt + 1`.
pub fn window(attempt: u32) -> (f64, f64) {
    match attempt {
        0 => (2.0, 4.0),
        1 => (4.0, 8.0),
        2 => (8.0, 16.0),
        3 => (16.0, 32.0),
        _ => (30.0, 60.0),
    }
}

/// The unscaled wait before retry number `attempt + 1`.
pub fn delay(attempt: u32, retry_after: Option<Duration>, rng: &mut impl Rng) -> Duration {
    let (lo, hi) = window(attempt);
    let jittered = Duration::from_secs_f64(rng.random_range(lo..hi));
    retry_after.map_or(jittered, |ra| ra.max(jittered))
}

/// A `Retry-After` value: delta seconds or an HTTP date.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn windows_double_then_cap() {
        let mut rng = StdRng::seed_from_u64(7);
        for (attempt, lo, hi) in [
            (0, 2.0, 4.0),
            (1, 4.0, 8.0),
            (2, 8.0, 16.0),
            (3, 16.0, 32.0),
            (4, 30.0, 60.0),
            (40, 30.0, 60.0),
        ] {
            for _ in 0..200 {
                let d = delay(attempt, None, &mut rng).as_secs_f64();
                assert!((lo..hi).contains(&d), "attempt {attempt}: {d}");
            }
        }
    }

    #[test]
    fn a_longer_retry_after_wins_a_shorter_one_does_not() {
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(
            delay(0, Some(Duration::from_secs(10)), &mut rng),
            Duration::from_secs(10)
        );
        let d = delay(0, Some(Duration::from_secs(1)), &mut rng);
        assert!(d >= Duration::from_secs(2), "{d:?}");
    }

    #[test]
    fn retry_after_seconds_and_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(parse_retry_after(" 3 ", now), Some(Duration::from_secs(3)));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(20));
        assert_eq!(
            parse_retry_after(&later, now),
            Some(Duration::from_secs(20))
        );
        let past = httpdate::fmt_http_date(now - Duration::from_secs(20));
        assert_eq!(parse_retry_after(&past, now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("soon", now), None);
    }
}
