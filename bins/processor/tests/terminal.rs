//! What a person sees: `processor run` in a real 80×24 pseudo-terminal, against a real Redis
//! and the simulated dispatcher. The bytes the processor writes are fed to a terminal emulator
//! (vt100), and the screen is read while the jobs run and at the end.

#[path = "../../../tests/support/mod.rs"]
mod support;

use std::io::Read;
use std::num::NonZeroU16;
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dispatcher_sim::GatewayConfig;
use support::*;

const ROWS: u16 = 24;
const COLS: u16 = 80;

/// A pseudo-terminal of `ROWS`×`COLS`: the processor gets the slave side as stdin, stdout and
/// stderr; a thread collects what arrives on the master side.
struct Pty {
    slave: OwnedFd,
    output: Arc<Mutex<Vec<u8>>>,
    reader: std::thread::JoinHandle<()>,
}

impl Pty {
    fn open() -> Pty {
        let (mut master, mut slave) = (-1, -1);
        let size = libc::winsize {
            ws_row: ROWS,
            ws_col: COLS,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: openpty writes two fds into the out-pointers; name and termios may be null.
        let rc = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                &size,
            )
        };
        assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
        for fd in [master, slave] {
            // SAFETY: fcntl on fds we own; the processor must not inherit the master side.
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        }
        // SAFETY: openpty gave us these fds and nothing else owns them.
        let (master, slave) =
            unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        let output = Arc::new(Mutex::new(Vec::new()));
        let sink = output.clone();
        let reader = std::thread::spawn(move || {
            let mut master = std::fs::File::from(master);
            let mut buf = [0u8; 8192];
            // Ends with EIO once every slave fd is closed, i.e. the processor exited.
            while let Ok(n @ 1..) = master.read(&mut buf) {
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Pty {
            slave,
            output,
            reader,
        }
    }

    fn stdio(&self) -> Stdio {
        Stdio::from(self.slave.try_clone().expect("dup of the pty slave"))
    }
}

/// The rows of a screen, and whether any of them is the first part of a wrapped line.
fn rows(parser: &vt100::Parser) -> (Vec<String>, Vec<usize>) {
    let screen = parser.screen();
    let rows: Vec<String> = screen.rows(0, COLS).collect();
    let wrapped = (0..rows.len())
        .filter(|&r| screen.row_wrapped(r as u16))
        .collect();
    (rows, wrapped)
}

/// The processor on the pty, killed when dropped.
fn spawn(
    pty: &Pty,
    env: &Env,
    config: &std::path::Path,
    inputs: &[&str],
    log: Option<&str>,
) -> Child {
    let mut cmd = Command::new(PROCESSOR);
    cmd.arg("run").arg("--config").arg(config);
    for input in inputs {
        cmd.arg("--input").arg(env.path(input));
    }
    cmd.arg("--output-dir")
        .arg(env.path("out"))
        .env("TERM", "xterm-256color")
        .env("COLUMNS", COLS.to_string())
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .stdin(pty.stdio())
        .stdout(pty.stdio())
        .stderr(pty.stdio());
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("PROCESSOR_") {
            cmd.env_remove(name);
        }
    }
    if let Some(filter) = log {
        cmd.env("RUST_LOG", filter);
    }
    // SAFETY: only prctl between fork and exec: the processor dies with this test.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    Child(cmd.spawn().expect("spawning the processor"))
}

/// Rows showing the bar of the job of `total` lines: `… 123/600 …/s … failed`.
fn bar_rows(rows: &[String], total: u64) -> Vec<&String> {
    let marker = format!("/{total} ");
    rows.iter()
        .filter(|r| r.contains(&marker) && r.contains(" failed"))
        .collect()
}

/// `done` of a bar row's `done/total`.
fn done_of(row: &str, total: u64) -> u64 {
    let marker = format!("/{total} ");
    let head = &row[..row.find(&marker).unwrap()];
    head.rsplit(' ').next().unwrap().parse().unwrap()
}

/// What every screen, at any moment, must hold to: no line wider than the terminal, at most
/// one bar line per job, each whole on its row, and no INFO line unless asked for (long log
/// lines may wrap then).
///
/// indicatif pads each bar line to the full width and lets the terminal move on to the next
/// row, so bar rows count as wrapped by design; they are checked for being whole instead.
fn check_screen(parser: &vt100::Parser, totals: &[u64], info_allowed: bool, when: &str) {
    let (rows, wrapped) = rows(parser);
    let text = rows.join("\n");
    let mut bar_row_numbers = Vec::new();
    for &total in totals {
        let bars = bar_rows(&rows, total);
        assert!(
            bars.len() <= 1,
            "{when}: {} bars of the {total}-line job:\n{text}",
            bars.len()
        );
        for bar in bars {
            assert!(
                bar.starts_with("batch_") && bar.contains(" [") && bar.contains("] "),
                "{when}: a bar not whole on its row: {bar:?}\n{text}"
            );
            bar_row_numbers.push(rows.iter().position(|r| r == bar).unwrap());
        }
    }
    if !info_allowed {
        let other: Vec<_> = wrapped
            .iter()
            .filter(|r| !bar_row_numbers.contains(r))
            .collect();
        assert!(other.is_empty(), "{when}: rows {other:?} wrap:\n{text}");
    }
    if !info_allowed {
        assert!(
            !text.contains(" INFO "),
            "{when}: INFO lines on the screen:\n{text}"
        );
    }
    // Log lines keep to their own rows: none is written into a bar.
    for row in rows
        .iter()
        .filter(|r| r.contains(" INFO ") || r.contains(" WARN "))
    {
        assert!(
            !row.contains("] "),
            "{when}: a log line torn by a bar: {row:?}\n{text}"
        );
    }
}

/// Two jobs through the simulator, paced so that the bars are visible for a few seconds.
async fn two_jobs(log: Option<&str>) -> (Env, Vec<String>) {
    let mut env = Env::start(GatewayConfig {
        latency_fixed: Duration::from_millis(40),
        ..GatewayConfig::default()
    })
    .await;
    // A Redis that keeps its data, as in production: one without is worth a warning at start,
    // which this test would count as a stray line.
    env.redis = batch_testkit::RedisServer::builder().aof(true).start();
    env.redis_url_file = env.redis.write_url_file(env.dir.path());
    write_input(&env.path("small.jsonl"), 600, &["llama-3"]);
    // A quarter of the big job names a model nobody serves: those lines fail at once.
    write_input(
        &env.path("big.jsonl"),
        1200,
        &["llama-3", "llama-3", "llama-3", "ghost"],
    );
    let config = env.async_config(&[("llama-3", "pool-a")], "");
    let sim = env
        .dispatcher(&["pool-a"], |c| {
            c.concurrency = 8;
            c.batch_size = 20;
        })
        .await;
    let pty = Pty::open();
    let mut child = spawn(&pty, &env, &config, &["small.jsonl", "big.jsonl"], log);
    // Only the processor holds the slave side now, so the reader ends when it exits.
    let Pty {
        slave,
        output,
        reader,
    } = pty;
    drop(slave);
    let pty = PtyView { output };

    let started = Instant::now();
    let mut running_screens = 0;
    let status = loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "the processor did not finish:\n{}",
            pty.screen().0.screen().contents()
        );
        let (screen, history) = pty.screen();
        check_screen(&screen, &[600, 1200], log.is_some(), "while running");
        check_screen(
            &history,
            &[600, 1200],
            log.is_some(),
            "while running (history)",
        );
        let (rows, _) = self::rows(&screen);
        // A moment where both bars are on the screen and the big job is under way.
        let small = bar_rows(&rows, 600);
        let big = bar_rows(&rows, 1200);
        if small.len() == 1 && big.len() == 1 && done_of(big[0], 1200) < 1200 {
            // Under way, the bar says when it should be done.
            assert!(big[0].contains(" eta "), "{:?}", big[0]);
            running_screens += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    reader.join().unwrap();
    assert!(
        status.success(),
        "exit {status:?}:\n{}",
        pty.screen().1.screen().contents()
    );
    assert!(
        running_screens >= 3,
        "the bars were seen under way only {running_screens} times"
    );
    sim.shutdown().await;

    let (screen, history) = pty.screen();
    check_screen(&screen, &[600, 1200], log.is_some(), "at the end");
    check_screen(
        &history,
        &[600, 1200],
        log.is_some(),
        "at the end (history)",
    );
    let (rows, _) = self::rows(&history);
    (env, rows)
}

/// What the processor printed so far.
struct PtyView {
    output: Arc<Mutex<Vec<u8>>>,
}

impl PtyView {
    /// The screen as a person sees it now, and the whole history on a screen tall enough to
    /// hold every line ever printed (cursor moves are relative, so both see the same lines).
    fn screen(&self) -> (vt100::Parser, vt100::Parser) {
        let bytes = self.output.lock().unwrap();
        let size = |n| NonZeroU16::new(n).unwrap();
        let mut screen = vt100::Parser::new(size(ROWS), size(COLS), 0);
        let mut history = vt100::Parser::new(size(2000), size(COLS), 0);
        screen.process(&bytes);
        history.process(&bytes);
        (screen, history)
    }
}

/// The final bar of the job of `total` lines, which must be on the screen once.
fn final_bar(rows: &[String], total: u64) -> String {
    let bars = bar_rows(rows, total);
    assert_eq!(bars.len(), 1, "{}", rows.join("\n"));
    bars[0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_80_column_terminal_shows_one_bar_per_job_and_no_info_lines() {
    let (env, rows) = two_jobs(None).await;
    let text = rows.join("\n");
    eprintln!("--- the final screen's history ---\n{}", text.trim_end());

    let small = final_bar(&rows, 600);
    assert!(
        small.contains(" 600/600 ") && small.contains(" 0 failed"),
        "{small:?}"
    );
    let big = final_bar(&rows, 1200);
    assert!(
        big.contains(" 1200/1200 ") && big.contains(" 300 failed"),
        "{big:?}"
    );
    for bar in [&small, &big] {
        // An integer rate, and the job's time once it is done.
        let rate = bar.split(' ').find(|w| w.ends_with("/s")).expect("a rate");
        assert!(
            rate.trim_end_matches("/s").parse::<u64>().is_ok(),
            "{bar:?}"
        );
        assert!(
            bar.contains(" in ") && bar.trim_end().ends_with("completed"),
            "{bar:?}"
        );
    }
    // The summary, in lines that fit.
    assert_eq!(text.matches(": completed\n").count(), 2, "{text}");
    assert!(
        text.contains("  600 requests: 600 completed, 0 failed"),
        "{text}"
    );
    assert!(
        text.contains("  1200 requests: 900 completed, 300 failed"),
        "{text}"
    );
    assert!(text.contains(&format!(
        "  results in {}",
        env.path("out").join("big").display()
    )));
    // The Batch objects are for programs, not for the terminal.
    assert!(!text.contains("{\"id\""), "{text}");
    // Nothing but the bars, the summary, blank lines and warnings if something went wrong
    // (a loaded machine may make Redis retry).
    let other: Vec<_> = rows
        .iter()
        .filter(|r| !r.trim().is_empty() && !r.contains(" WARN "))
        .filter(|r| bar_rows(std::slice::from_ref(r), 600).is_empty())
        .filter(|r| bar_rows(std::slice::from_ref(r), 1200).is_empty())
        .filter(|r| !r.starts_with("job batch_") && !r.starts_with("  "))
        .collect();
    assert!(other.is_empty(), "unexpected lines {other:?}:\n{text}");
    assert_eq!(
        batch_json(&env.path("out").join("big"))["request_counts"]["completed"],
        900
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_lines_asked_for_scroll_above_the_bars() {
    let (_env, rows) = two_jobs(Some("info")).await;
    let text = rows.join("\n");
    // The info lines are there, each on its own rows (check_screen), and the bars were never
    // copied: one line per job in the whole history.
    assert!(text.contains("job finished"), "{text}");
    assert!(text.contains("result consumer started"), "{text}");
    final_bar(&rows, 600);
    final_bar(&rows, 1200);
    // The last job to finish logged its end above the bars.
    let last_finished = rows
        .iter()
        .rposition(|r| r.contains("job finished"))
        .unwrap();
    let bar = rows
        .iter()
        .position(|r| !bar_rows(std::slice::from_ref(r), 1200).is_empty())
        .unwrap();
    assert!(last_finished < bar, "{text}");
}
