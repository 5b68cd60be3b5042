//! Parsers for the scalar formats a config value may take.

use std::time::Duration;

/// Parses a duration written with a unit: `10ms`, `5s`, `1m`, `24h`, `1h 30m`.
///
/// A bare number is refused: `5` could mean seconds or milliseconds, and guessing wrong is the kind of
/// silent surprise a config must not have.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(batch_config::parse_duration("1m"), Ok(Duration::from_secs(60)));
/// assert!(batch_config::parse_duration("5").unwrap_err().contains("expected a duration such as 5s"));
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("expected a duration such as 5s, got an empty string".to_owned());
    }
    if text.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return Err(format!(
            "expected a duration such as 5s, got the bare number {text} (add a unit: ms, s, m or h)"
        ));
    }
    humantime::parse_duration(text)
        .map_err(|e| format!("expected a duration such as 5s, got {text:?} ({e})"))
}

/// Parses a byte count: `1048576`, `512KiB`, `200MiB`, `1GB` (KB/MB/GB are powers of 1000).
pub fn parse_byte_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let bad = || format!("expected a size such as 200MiB or 1048576, got {text:?}");
    let number: u64 = digits.parse().map_err(|_| bad())?;
    let factor: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        _ => return Err(bad()),
    };
    number
        .checked_mul(factor)
        .ok_or_else(|| format!("size {text:?} is too large"))
}

/// Checks a gateway URL: `http://` or `https://`, a host, an optional numeric port.
///
/// The URL is not echoed back: it may carry credentials in its user-info part.
pub(crate) fn check_http_url(url: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or("expected an http:// or https:// URL")?;
    if url.chars().any(char::is_whitespace) {
        return Err("the URL contains whitespace".to_owned());
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_port = authority.rsplit('@').next().unwrap_or_default();
    let (host, port) = if let Some(v6) = host_port.strip_prefix('[') {
        let (host, after) = v6.split_once(']').ok_or("unclosed '[' in the URL's host")?;
        (host, after.strip_prefix(':'))
    } else {
        match host_port.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (host_port, None),
        }
    };
    if host.is_empty() {
        return Err("the URL has no host".to_owned());
    }
    if let Some(port) = port {
        if port.parse::<u16>().is_err() {
            return Err("the URL's port is not a number between 0 and 65535".to_owned());
        }
    }
    Ok(())
}

/// Checks a Redis URL with the connection library's own parser, so the config accepts exactly
/// what connecting accepts. The URL is not echoed back: it may carry a password.
pub(crate) fn check_redis_url(url: &str) -> Result<batch_redis::RedisUrl, String> {
    batch_redis::parse_url(url)
        .map_err(|e| format!("does not hold a Redis URL this processor accepts: {e}"))
}

/// The allowed key closest to a mistyped one, if it is close enough to be a typo.
pub(crate) fn closest<'a>(key: &str, allowed: &[&'a str]) -> Option<&'a str> {
    allowed
        .iter()
        .map(|candidate| (edit_distance(key, candidate), *candidate))
        .filter(|(distance, candidate)| *distance <= 2.max(candidate.len() / 3))
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, candidate)| candidate)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != *cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_need_a_unit() {
        assert_eq!(parse_duration("10ms"), Ok(Duration::from_millis(10)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration(" 1m "), Ok(Duration::from_secs(60)));
        for bad in ["5", "0", "", "1.5", "five seconds"] {
            let err = parse_duration(bad).unwrap_err();
            assert!(
                err.contains("expected a duration such as 5s"),
                "{bad:?}: {err}"
            );
        }
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_byte_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_byte_size("200MiB"), Ok(200 << 20));
        assert_eq!(parse_byte_size("1 GB"), Ok(1_000_000_000));
        assert!(parse_byte_size("12 parsecs").is_err());
        assert!(parse_byte_size("-1").is_err());
        assert!(parse_byte_size("99999999999999GiB").is_err());
    }

    #[test]
    fn gateway_urls() {
        for good in [
            "http://127.0.0.1:8000",
            "https://gateway.example/v1",
            "http://[::1]:80/",
            "http://user:pw@host",
        ] {
            assert_eq!(check_http_url(good), Ok(()), "{good}");
        }
        for bad in [
            "127.0.0.1:8000",
            "ftp://host",
            "http://",
            "http://:80",
            "http://host:port",
            "http://ho st",
            "http://[::1",
        ] {
            assert!(check_http_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn redis_urls() {
        assert!(check_redis_url("redis://127.0.0.1:6379").is_ok());
        assert!(check_redis_url("rediss://user:pw@host:6380/2").is_ok());
        assert!(check_redis_url("redis-cluster://h:1?node=h:2").is_ok());
        assert!(check_redis_url("redis-sentinel://h?sentinelServiceName=m").is_ok());
        assert!(check_redis_url("127.0.0.1:6379").is_err());
        assert!(check_redis_url("http://host").is_err());
        assert!(check_redis_url("redis://").is_err());
        // Forms the old scheme list let through and the client then refused.
        assert!(check_redis_url("unix:///tmp/redis.sock").is_err());
        assert!(check_redis_url("redis-sentinel://h:26379").is_err());
        assert!(check_redis_url("redis://h?node=h:2").is_err());
    }

    #[test]
    fn typo_suggestions() {
        let keys = ["global", "per_endpoint", "aimd"];
        assert_eq!(closest("globl", &keys), Some("global"));
        assert_eq!(closest("per-endpoint", &keys), Some("per_endpoint"));
        assert_eq!(closest("something_else", &keys), None);
    }
}
