//! Progress of running jobs: one bar per job on a terminal, a log line every few seconds
//! otherwise.
//!
//! While bars are drawn, log lines go through [`LogWriter`], which lifts the bars, prints the
//! line and draws them again below it, so the bars stay at the bottom of the screen.

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use batch_executor::JobProgress;
use indicatif::{MultiProgress, ProgressBar, ProgressState, ProgressStyle};
use tokio::sync::watch;

const LOG_EVERY: Duration = Duration::from_secs(5);
/// The bar is dropped before it gets narrower than this.
const MIN_BAR: usize = 10;
/// Job ids longer than this are shortened: `batch_` and 16 of the 32 hex digits tell jobs
/// apart, and bars of generated ids line up.
const MAX_LABEL: usize = 22;
/// Job ids are shortened to this when the line is too narrow for `MAX_LABEL`.
const MIN_LABEL: usize = 14;

/// The bars of this process, once [`enable_bars`] was called.
static BARS: OnceLock<MultiProgress> = OnceLock::new();
/// Set when the bars are done: log lines then go straight to stderr again.
static CLOSED: AtomicBool = AtomicBool::new(false);

/// Draws bars from now on; call before logging starts so log lines go through them.
pub fn enable_bars() {
    BARS.get_or_init(MultiProgress::new);
}

fn bars() -> Option<&'static MultiProgress> {
    BARS.get().filter(|_| !CLOSED.load(Ordering::Relaxed))
}

/// A `tracing` writer for stderr that prints each log line above the bars, if any.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogWriter;

/// One log line, buffered until it is complete.
pub struct LogLine(Vec<u8>);

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogLine;

    fn make_writer(&'a self) -> LogLine {
        LogLine(Vec::with_capacity(160))
    }
}

impl std::io::Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        // A failed write to stderr has nowhere to be reported.
        let write = || {
            let _ = std::io::stderr().lock().write_all(&self.0);
        };
        match bars() {
            Some(multi) => multi.suspend(write),
            None => write(),
        }
    }
}

/// Shows the progress of every job of the run.
pub struct Display {
    bars: Option<&'static MultiProgress>,
    /// Every bar, kept until the end: indicatif forgets a dropped bar at the next redraw, and a
    /// finished job's bar should stay on the screen.
    kept: Mutex<Vec<ProgressBar>>,
}

/// Shows one job until [`Watcher::finish`].
pub struct Watcher {
    task: tokio::task::JoinHandle<()>,
    stop: tokio::sync::oneshot::Sender<()>,
}

/// What the bar's line shows besides what indicatif tracks.
#[derive(Debug, Default)]
struct Extra {
    failed: u64,
    status: &'static str,
}

impl Display {
    /// Bars when `bars` (and [`enable_bars`] was called), log lines otherwise.
    pub fn new(bars: bool) -> Self {
        if bars {
            enable_bars();
        }
        Self {
            bars: self::bars().filter(|_| bars),
            kept: Mutex::default(),
        }
    }

    /// Starts showing one job.
    pub fn watch(&self, mut rx: watch::Receiver<JobProgress>) -> Watcher {
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let extra = Arc::new(Mutex::new(Extra::default()));
        let bar = self.bars.map(|multi| {
            let first = rx.borrow();
            let bar = multi.add(ProgressBar::new(first.counts.total));
            bar.set_style(style(first.job_id.clone(), extra.clone()));
            self.kept
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(bar.clone());
            bar
        });
        let show = move |bar: &ProgressBar, p: &JobProgress| {
            *extra.lock().unwrap_or_else(|e| e.into_inner()) = Extra {
                failed: p.counts.failed,
                status: p.status.as_str(),
            };
            bar.set_position(p.counts.completed + p.counts.failed);
        };
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(LOG_EVERY);
            loop {
                let p = rx.borrow_and_update().clone();
                let done = p.counts.completed + p.counts.failed;
                if let Some(bar) = &bar {
                    show(bar, &p);
                }
                tokio::select! {
                    _ = &mut stopped => break,
                    changed = rx.changed() => if changed.is_err() { break },
                    _ = tick.tick(), if bar.is_none() => tracing::info!(
                        job = %p.job_id,
                        status = p.status.as_str(),
                        done,
                        total = p.counts.total,
                        completed = p.counts.completed,
                        failed = p.counts.failed,
                        dispatched = p.dispatched,
                        "progress"
                    ),
                }
            }
            if let Some(bar) = bar {
                // The job's last state (`completed`, ...) may have come with the stop.
                show(&bar, &rx.borrow());
                bar.finish();
            }
        });
        Watcher { task, stop }
    }

    /// Leaves the finished bars on the screen as they are; what is printed from now on goes
    /// below them.
    pub fn close(&self) {
        if self.bars.is_some() {
            CLOSED.store(true, Ordering::Relaxed);
        }
    }
}

impl Watcher {
    /// Stops showing the job.
    pub async fn finish(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// `label [====>     ] 1234/20000 805/s eta 12s 3 failed`, fitted to the terminal's width at
/// each redraw: the bar takes what is left, the label is shortened before the bar goes.
fn style(label: String, extra: Arc<Mutex<Extra>>) -> ProgressStyle {
    let line = move |state: &ProgressState| {
        let extra = extra.lock().unwrap_or_else(|e| e.into_inner());
        let width = console::Term::stderr().size().1 as usize;
        Line::fit(width, &label, &stats(state, &extra))
    };
    // Head and tail are rendered one after the other and the rate or the failed count may move
    // in between; indicatif sizes the bar from what both rendered, so the bar absorbs it.
    let head_line = line.clone();
    ProgressStyle::with_template("{head}{wide_bar}{tail}")
        .expect("valid template")
        .progress_chars("=> ")
        .with_key(
            "head",
            move |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = w.write_str(&head_line(s).head);
            },
        )
        .with_key(
            "tail",
            move |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = w.write_str(&line(s).tail);
            },
        )
}

/// The text right of the bar.
fn stats(state: &ProgressState, extra: &Extra) -> String {
    let mut text = match state.len() {
        Some(len) => format!("{}/{len}", state.pos()),
        None => state.pos().to_string(),
    };
    let _ = write!(text, " {:.0}/s", state.per_sec());
    if state.is_finished() {
        let _ = write!(text, " in {}", short(state.elapsed()));
    } else if state.pos() > 0 && state.per_sec() > 0.0 {
        let _ = write!(text, " eta {}", short(state.eta()));
    } else {
        text.push_str(" eta ?");
    }
    let _ = write!(text, " {} failed", extra.failed);
    if !matches!(extra.status, "in_progress" | "") {
        let _ = write!(text, " {}", extra.status);
    }
    text
}

/// `45s`, `3m05s`, `2h03m`.
fn short(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

/// The text left and right of the bar, which gets the rest of the width.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Line {
    head: String,
    tail: String,
}

impl Line {
    /// Fits `label [bar] stats` into `width` columns.
    fn fit(width: usize, label: &str, stats: &str) -> Line {
        let label = &shorten(label, MAX_LABEL);
        let tail = format!("] {stats}");
        let fixed = 2 + tail.chars().count(); // " [" and the tail
        if fixed + MIN_BAR + label.chars().count() <= width {
            return Line {
                head: format!("{label} ["),
                tail,
            };
        }
        if fixed + MIN_BAR + MIN_LABEL <= width {
            let room = width - fixed - MIN_BAR;
            return Line {
                head: format!("{} [", shorten(label, room)),
                tail,
            };
        }
        // No room for a bar: the label and the stats, cut or padded to the width so that
        // indicatif's bar gets no column.
        let text = format!("{} {stats}", shorten(label, MIN_LABEL));
        Line {
            head: format!("{:width$}", text.chars().take(width).collect::<String>()),
            tail: String::new(),
        }
    }
}

/// `label` cut to `max` characters, the cut marked with `…`.
fn shorten(label: &str, max: usize) -> String {
    if label.chars().count() <= max {
        return label.to_owned();
    }
    let mut cut: String = label.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "batch_0123456789abcdef0123456789abcdef";

    #[test]
    fn a_wide_terminal_shows_a_long_id_shortened_and_a_bar() {
        let line = Line::fit(120, ID, "5/10 3/s eta 2s 0 failed");
        assert_eq!(line.head, "batch_0123456789abcde… [");
        assert_eq!(line.tail, "] 5/10 3/s eta 2s 0 failed");
        let line = Line::fit(120, "my-job", "5/10 3/s eta 2s 0 failed");
        assert_eq!(line.head, "my-job [");
    }

    #[test]
    fn the_id_is_shortened_before_the_bar_goes() {
        let stats = "12345/20000 805/s eta 12m05s 12345 failed cancelling";
        let line = Line::fit(80, ID, stats);
        let used = line.head.chars().count() + line.tail.chars().count();
        assert!(80 - used >= MIN_BAR, "{line:?}");
        assert!(line.head.starts_with("batch_0123") && line.head.ends_with("… ["));
    }

    #[test]
    fn a_narrow_terminal_drops_the_bar_and_cuts_the_line() {
        for width in [10, 30, 45] {
            let line = Line::fit(width, ID, "12345/20000 805/s eta 12s 3 failed");
            assert_eq!(line.head.chars().count(), width, "{line:?}");
            assert!(line.tail.is_empty());
        }
    }

    #[test]
    fn durations_are_short() {
        assert_eq!(short(Duration::from_secs(45)), "45s");
        assert_eq!(short(Duration::from_secs(185)), "3m05s");
        assert_eq!(short(Duration::from_secs(7380)), "2h03m");
    }
}
