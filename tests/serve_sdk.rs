//! The official OpenAI Python SDK against `processor serve`: a real redis-server, the simulated
//! dispatcher and gateway, the `processor serve` binary with two tenants' API keys, and the
//! suite tests/compat/test_openai_sdk.py run with the virtualenv's python (made by
//! `bash scripts/test.sh`: `$BATCH_VENV`, default `<repo>/target/venv`).

mod support;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dispatcher_sim::GatewayConfig;
use support::*;

/// One gateway answer takes this long per output token: the suite's normal lines ask for one
/// token, its slow lines (the batch it cancels while running) for `SLOW_MAX_TOKENS`.
const LATENCY_PER_TOKEN: Duration = Duration::from_millis(1);
const SLOW_MAX_TOKENS: u64 = 4000;
/// `input.max_requests`: above the suite's largest batch (200 lines), low enough to upload past.
const MAX_REQUESTS: u64 = 1000;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The virtualenv's python, or a panic that says how to make it: the suite is never skipped.
fn venv_python() -> PathBuf {
    let venv = std::env::var_os("BATCH_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/venv"));
    let python = venv.join("bin/python");
    assert!(
        python.exists(),
        "no virtualenv with the openai package at {}: run `bash scripts/test.sh` (it makes one), \
         or set BATCH_VENV to one",
        venv.display()
    );
    python
}

/// `processor serve`, killed when dropped (and by the kernel if this test dies).
struct Service {
    child: Child,
    base_url: String,
    log: PathBuf,
}

impl Service {
    fn start(config: &Path, log: PathBuf) -> Service {
        let mut cmd = Command::new(PROCESSOR);
        cmd.arg("serve")
            .arg("--config")
            .arg(config)
            .args(["--listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("creating the service's log"));
        kill_with_parent(&mut cmd);
        let mut child = Child(cmd.spawn().expect("starting processor serve"));
        let stdout = child.0.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_default();
        let Some(base_url) = line.trim().strip_prefix("listening on ") else {
            panic!(
                "processor serve printed {line:?}, not `listening on http://...`; its log:\n{}",
                read_log(&log)
            );
        };
        Service {
            base_url: base_url.trim_end_matches('/').to_owned(),
            child,
            log,
        }
    }

    /// SIGTERM, then the exit status, which must come within the spec's 10 s (given 30 here:
    /// the machine may be loaded).
    fn stop(mut self) -> std::process::ExitStatus {
        // SAFETY: a signal to our own child process.
        unsafe { libc::kill(self.child.0.id() as i32, libc::SIGTERM) };
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.0.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < until,
                "processor serve did not stop within 30 s of SIGTERM; its log:\n{}",
                read_log(&self.log)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[cfg(target_os = "linux")]
fn kill_with_parent(cmd: &mut Command) {
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
fn kill_with_parent(_cmd: &mut Command) {}

/// The last 200 lines of a log file.
fn read_log(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(200)..].join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_openai_python_sdk_drives_the_service() {
    let python = venv_python();
    let env = Env::start(GatewayConfig {
        latency_per_token: LATENCY_PER_TOKEN,
        ..GatewayConfig::default()
    })
    .await;
    let sim = env.dispatcher(&["pool-a"], |_| {}).await;

    let key_a = format!("sk-a-{}", std::process::id());
    let key_b = format!("sk-b-{}", std::process::id());
    let keys = env.path("api-keys");
    std::fs::write(
        &keys,
        format!("# key tenant\n{key_a} tenant-a\n\n{key_b} tenant-b\n"),
    )
    .unwrap();
    // `ghost` has no gateway: the suite's lines for it must end as model_not_found.
    let config = env.async_config(&[("llama-3", "pool-a")], "");
    let mut yaml = std::fs::read_to_string(&config).unwrap();
    yaml.push_str(&format!(
        "input:\n  max_requests: {MAX_REQUESTS}\nserve:\n  api_keys_file: {}\n  storage: file://{}\n  max_active_jobs: 16\n  reaper_interval: 200ms\n",
        keys.display(),
        env.path("storage").display()
    ));
    std::fs::write(&config, yaml).unwrap();

    let service = Service::start(&config, env.path("serve.log"));
    let mut suite = Command::new(&python);
    suite
        .arg(repo_root().join("tests/compat/test_openai_sdk.py"))
        .env("OPENAI_BASE_URL", format!("{}/v1", service.base_url))
        .env("KEY_A", &key_a)
        .env("KEY_B", &key_b)
        .env("SLOW_MAX_TOKENS", SLOW_MAX_TOKENS.to_string())
        .env("MAX_REQUESTS", MAX_REQUESTS.to_string())
        .env("MODEL", "llama-3")
        .env("MISSING_MODEL", "ghost")
        // The SDK must not pick up a developer's own settings.
        .env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_ORG_ID")
        .env_remove("OPENAI_PROJECT_ID")
        .env("PYTHONUNBUFFERED", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null());
    let output = tokio::task::spawn_blocking(move || suite.output())
        .await
        .unwrap()
        .expect("running the python suite");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    println!("{report}");
    let log = service.log.clone();
    let status = service.stop();
    assert!(
        output.status.success(),
        "the OpenAI SDK suite failed ({}; processor serve then exited with {status}):\n{report}\n\
         --- processor serve's log (last lines):\n{}",
        output.status,
        read_log(&log)
    );
    assert!(
        report.contains(" passed, 0 failed"),
        "the suite's summary is missing:\n{report}"
    );
    assert!(
        status.success(),
        "processor serve exited with {status} after SIGTERM; its log:\n{}",
        read_log(&log)
    );
    sim.shutdown().await;
}
