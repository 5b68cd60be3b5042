//! Exact peak RSS of a child process.
//!
//! `ru_maxrss` of a reaped child is not the child's own peak when its parent is large: at
//! `exec` Linux folds the old address space's high-water mark into the process's maximum, and
//! that old address space is the parent's (vfork) or a copy of it (fork). So the processor is
//! started by a small helper process (the bench binary in helper mode, see [`rss_helper`]),
//! whose own footprint is a few MiB: the child's maximum is then its own. The same `wait4`
//! gives the child's CPU time (user + system), its threads included.

use std::ffi::OsString;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::child::log_tail;
use crate::BenchError;

/// The first argument that puts the bench binary in helper mode.
pub const RSS_HELPER_ARG: &str = "__measure-rss";

/// Helper mode: `args` = `RESULT_FILE PROGRAM [ARGS…]`. Runs the program (killed if the helper
/// dies), waits for it, writes `<peak RSS KiB> <exit code> <CPU µs>` to the result file, and
/// returns the exit code (-1 when it was killed by a signal).
pub fn rss_helper(args: &[OsString]) -> Result<i32, BenchError> {
    let [result, program, rest @ ..] = args else {
        return Err(BenchError::Tool(format!(
            "usage: {RSS_HELPER_ARG} RESULT_FILE PROGRAM [ARGS...]"
        )));
    };
    let mut cmd = Command::new(program);
    cmd.args(rest);
    crate::child::die_with_parent(&mut cmd);
    let child = cmd
        .spawn()
        .map_err(|e| BenchError::Tool(format!("{}: {e}", Path::new(program).display())))?;
    let (status, kib, cpu_us) = wait_with_rusage(child.id() as libc::pid_t)?;
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        -1
    };
    let result = Path::new(result);
    std::fs::write(result, format!("{kib} {code} {cpu_us}\n"))
        .map_err(|e| BenchError::io(result, e))?;
    Ok(code)
}

/// Waits for `pid` (blocking) and returns its raw status, `ru_maxrss` (KiB on Linux) and its
/// user + system CPU time in µs.
fn wait_with_rusage(pid: libc::pid_t) -> Result<(libc::c_int, u64, u64), BenchError> {
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: an all-zero rusage is a valid value of this plain C struct.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `pid` is our own unreaped child; both out-pointers are valid for writes.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if r == pid {
            let micros =
                |t: libc::timeval| t.tv_sec.max(0) as u64 * 1_000_000 + t.tv_usec.max(0) as u64;
            let cpu = micros(usage.ru_utime) + micros(usage.ru_stime);
            return Ok((status, usage.ru_maxrss.max(0) as u64, cpu));
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(BenchError::Tool(format!("wait4: {e}")));
        }
    }
}

/// What a finished child used.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Usage {
    /// Peak RSS, MiB.
    pub(crate) peak_mib: f64,
    /// User + system CPU time, seconds.
    pub(crate) cpu_seconds: f64,
}

/// Runs `program args` through `helper` in helper mode, with stdout and stderr into the given
/// files; returns its peak RSS and CPU time, or fails unless it exits 0 within `timeout`.
pub(crate) fn measure(
    helper: &Path,
    program: &Path,
    args: &[OsString],
    stdout: &Path,
    stderr: &Path,
    timeout: Duration,
) -> Result<Usage, BenchError> {
    let result = stdout.with_extension("rss");
    let _ = std::fs::remove_file(&result);
    let file = |p: &Path| std::fs::File::create(p).map_err(|e| BenchError::io(p, e));
    let mut cmd = Command::new(helper);
    cmd.arg(RSS_HELPER_ARG)
        .arg(&result)
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(file(stdout)?)
        .stderr(file(stderr)?);
    crate::child::config_only(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| BenchError::Tool(format!("{}: {e}", helper.display())))?;
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                // The helper's death takes the program with it (PR_SET_PDEATHSIG).
                let _ = child.kill();
                let _ = child.wait();
                return Err(BenchError::Tool(format!(
                    "{} did not finish within {timeout:?}; its log: {}",
                    program.display(),
                    stderr.display()
                )));
            }
            Err(e) => {
                return Err(BenchError::Tool(format!(
                    "waiting for {}: {e}",
                    helper.display()
                )))
            }
        }
    };
    let text = std::fs::read_to_string(&result).unwrap_or_default();
    let mut fields = text.split_whitespace();
    let kib = fields.next().and_then(|f| f.parse::<u64>().ok());
    let code = fields.next().and_then(|f| f.parse::<i32>().ok());
    let cpu_us = fields.next().and_then(|f| f.parse::<u64>().ok());
    match (kib, code, cpu_us) {
        (Some(kib), Some(0), Some(cpu_us)) => Ok(Usage {
            peak_mib: kib as f64 / 1024.0,
            cpu_seconds: cpu_us as f64 / 1e6,
        }),
        _ => Err(BenchError::Tool(format!(
            "{} failed (helper {status}, result {:?}); last lines of its log:\n{}",
            program.display(),
            text.trim(),
            log_tail(stderr)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_helper_reports_its_childs_peak_cpu_time_and_exit_code() {
        let dir = batch_testkit::tempdir().unwrap();
        let result = dir.path().join("r");
        // `sh` allocating about 20 MiB in a variable.
        let script = "x=$(head -c 20000000 /dev/zero | tr '\\0' a); echo ${#x} >/dev/null; exit 3";
        let args: Vec<OsString> = [
            result.as_os_str(),
            "sh".as_ref(),
            "-c".as_ref(),
            script.as_ref(),
        ]
        .into_iter()
        .map(OsString::from)
        .collect();
        assert_eq!(rss_helper(&args).unwrap(), 3);
        let text = std::fs::read_to_string(&result).unwrap();
        let fields: Vec<u64> = text
            .split_whitespace()
            .map(|f| f.parse().unwrap())
            .collect();
        let [kib, code, cpu_us] = fields[..] else {
            panic!("{text}")
        };
        assert!(kib > 19_000, "{kib} KiB");
        assert_eq!(code, 3, "{text}");
        // The shell's own time to build a 20 MB string; the children it waited for count too.
        assert!(cpu_us > 1_000, "{cpu_us} µs");
        assert!(rss_helper(&[]).is_err());
    }
}
