//! What every child process of the bench gets: a clean environment, death with its parent,
//! and the end of its log in errors.

use std::path::Path;
use std::process::Command;

/// Drops every `PROCESSOR_*` variable from `cmd`'s environment, so only the config file
/// decides, not an override from the caller's environment.
pub(crate) fn config_only(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("PROCESSOR_") {
            cmd.env_remove(key);
        }
    }
}

/// Has `cmd`'s process killed when the thread that spawns it dies (`PR_SET_PDEATHSIG`).
pub(crate) fn die_with_parent(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// The last 15 lines of a log file (none when it cannot be read).
pub(crate) fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}
