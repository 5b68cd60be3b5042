//! What the figures were measured on: machine, versions, date.

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

/// The machine and software a report's figures come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    /// CPU model name.
    pub cpu: String,
    /// Logical cores available to this process.
    pub cores: usize,
    /// Total RAM, in MiB.
    pub ram_mib: u64,
    /// `uname -sr`-like kernel name and release.
    pub os: String,
    /// `rustc --version`.
    pub rustc: String,
    /// `redis-server --version`, shortened to the version.
    pub redis: String,
    /// Version of this workspace's crates.
    pub crate_version: String,
    /// `git rev-parse --short HEAD`, with `+dirty` when the tree has changes.
    pub commit: String,
    /// When the run started, UTC (`YYYY-MM-DD HH:MM UTC`).
    pub date: String,
}

impl Machine {
    /// Probes the machine; what cannot be found reads `unknown`.
    pub fn probe() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == "model name").then(|| v.trim().to_owned())
            })
            .unwrap_or_else(unknown);
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let ram_kib = meminfo
            .lines()
            .find_map(|l| {
                let rest = l.strip_prefix("MemTotal:")?;
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(0);
        let os = format!(
            "{} {}",
            read_trimmed("/proc/sys/kernel/ostype").unwrap_or_else(|| std::env::consts::OS.into()),
            read_trimmed("/proc/sys/kernel/osrelease").unwrap_or_default()
        );
        let redis = output("redis-server", &["--version"])
            .and_then(|v| {
                v.split_whitespace()
                    .find_map(|w| w.strip_prefix("v=").map(str::to_owned))
            })
            .unwrap_or_else(unknown);
        let commit = match output("git", &["rev-parse", "--short", "HEAD"]) {
            Some(c) => {
                let dirty =
                    output("git", &["status", "--porcelain"]).is_some_and(|s| !s.is_empty());
                if dirty {
                    format!("{c}+dirty")
                } else {
                    c
                }
            }
            None => unknown(),
        };
        Self {
            cpu,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            ram_mib: ram_kib / 1024,
            os: os.trim().to_owned(),
            rustc: output("rustc", &["--version"]).unwrap_or_else(unknown),
            redis,
            crate_version: env!("CARGO_PKG_VERSION").to_owned(),
            commit,
            date: utc_date(SystemTime::now()),
        }
    }
}

fn unknown() -> String {
    "unknown".into()
}

fn read_trimmed(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

/// The trimmed stdout of a command that succeeded.
fn output(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// `YYYY-MM-DD HH:MM UTC` of `t`.
pub fn utc_date(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60
    )
}

/// Gregorian (year, month, day) of a count of days since 1970-01-01 (Howard Hinnant's method).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn dates_are_gregorian_utc() {
        assert_eq!(utc_date(UNIX_EPOCH), "1970-01-01 00:00 UTC");
        // 2024-02-29 13:45:10 UTC, a leap day.
        let t = UNIX_EPOCH + Duration::from_secs(1_709_214_310);
        assert_eq!(utc_date(t), "2024-02-29 13:45 UTC");
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(utc_date(t), "2000-02-29 00:00 UTC");
    }

    #[test]
    fn probing_finds_the_basics() {
        let m = Machine::probe();
        assert!(m.cores >= 1);
        assert_eq!(m.crate_version, env!("CARGO_PKG_VERSION"));
        assert!(m.date.ends_with(" UTC"));
    }
}
