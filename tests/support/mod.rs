//! Shared by the tests that drive the `processor` binary: the binary run, killed and run again,
//! on the rig of `batch_testkit::e2e` (re-exported here: input files, configs, the simulator, and
//! checks on the result files that every test repeats).
#![allow(dead_code)]

pub mod batches;
pub mod serve;

use std::path::Path;
use std::time::Duration;

pub use batch_testkit::e2e::*;

/// The processor binary built for these tests.
pub const PROCESSOR: &str = env!("CARGO_BIN_EXE_processor");

/// A child process killed when dropped.
pub struct Child(pub std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `processor run` of `input` into `out`, kills it (SIGKILL) once `kill_at` answers are
/// out, runs it again to its end, and checks that it resumed, completed, and wrote each of
/// `lines` once with its own answer.
pub async fn kill_9_and_rerun(
    config: &Path,
    input: &Path,
    out: &Path,
    lines: &[String],
    kill_at: usize,
) {
    let mut first = Child(
        run_cmd(config, input, out)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually("some results", Duration::from_secs(60), || {
        output_lines(out) >= kill_at
    })
    .await;
    first.0.kill().unwrap(); // SIGKILL
    first.0.wait().unwrap();
    assert!(
        output_lines(out) < lines.len(),
        "killed too late to prove anything"
    );
    // Results keep arriving while no processor runs.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let second = run_cmd(config, input, out)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(second.status.success(), "{stderr}");
    assert!(stderr.contains("resuming job"), "{stderr}");
    let results = Results::read(out);
    results.assert_each_once(lines);
    results.assert_answers_match(lines);
    let batch = batch_json(out);
    assert_eq!(batch["status"], "completed");
    assert_eq!(batch["request_counts"]["completed"], lines.len());
}

/// Starts `processor run` of the env's `in.jsonl` into `out` (its stdout and stderr made by
/// `stdio`), and returns it once all `n` requests of its job are in pool-a's queue.
pub async fn run_until_queued(
    env: &Env,
    config: &Path,
    out: &Path,
    n: usize,
    stdio: fn() -> std::process::Stdio,
) -> Child {
    // Wrapped at once: a failed wait below kills it.
    let child = Child(
        run_cmd(config, &env.path("in.jsonl"), out)
            .stdout(stdio())
            .stderr(stdio())
            .spawn()
            .unwrap(),
    );
    let queued = format!(":{n}");
    eventually("the job enqueued", Duration::from_secs(30), || {
        env.redis.command(&["ZCARD", "llm-d-async:requests:pool-a"]) == queued
    })
    .await;
    child
}

/// Runs `processor run` to its end ([`run_cmd`]); panics with its stderr unless it succeeded.
#[track_caller]
pub fn run_ok(config: &Path, input: &Path, out: &Path) -> std::process::Output {
    let run = run_cmd(config, input, out).output().unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    run
}

/// `processor run --config C --input I --output-dir O`, logging at INFO, no stdin.
pub fn run_cmd(config: &Path, input: &Path, out: &Path) -> std::process::Command {
    let mut cmd = std::process::Command::new(PROCESSOR);
    cmd.arg("run")
        .arg("--config")
        .arg(config)
        .arg("--input")
        .arg(input)
        .arg("--output-dir")
        .arg(out)
        .env("RUST_LOG", "info")
        .stdin(std::process::Stdio::null());
    cmd
}

/// Starts `processor run` on each (input, output dir) of `jobs`, stderr captured.
pub fn spawn_runs<'a>(
    config: &Path,
    jobs: impl IntoIterator<Item = (&'a Path, &'a Path)>,
) -> Vec<Child> {
    jobs.into_iter()
        .map(|(input, out)| {
            Child(
                run_cmd(config, input, out)
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap(),
            )
        })
        .collect()
}
