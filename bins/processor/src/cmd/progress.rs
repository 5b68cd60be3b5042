//! Progress of running jobs: bars on a terminal, a log line every few seconds otherwise.

use std::time::Duration;

use batch_executor::JobProgress;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use tokio::sync::watch;

const LOG_EVERY: Duration = Duration::from_secs(5);

/// Shows the progress of every job of the run.
pub struct Display {
    bars: Option<MultiProgress>,
}

/// Shows one job until [`Watcher::finish`].
pub struct Watcher {
    task: tokio::task::JoinHandle<()>,
    stop: tokio::sync::oneshot::Sender<()>,
}

impl Display {
    /// Bars when `bars`, log lines otherwise.
    pub fn new(bars: bool) -> Self {
        Self {
            bars: bars.then(MultiProgress::new),
        }
    }

    /// Starts showing one job.
    pub fn watch(&self, mut rx: watch::Receiver<JobProgress>) -> Watcher {
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let bar = self.bars.as_ref().map(|multi| {
            let bar = multi.add(ProgressBar::new(rx.borrow().counts.total));
            bar.set_style(
                ProgressStyle::with_template(
                    "{prefix} [{elapsed_precise}] {bar:30} {pos}/{len} {per_sec} {msg}",
                )
                .expect("valid template"),
            );
            bar.set_prefix(rx.borrow().job_id.clone());
            bar
        });
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(LOG_EVERY);
            loop {
                let p = rx.borrow_and_update().clone();
                let done = p.counts.completed + p.counts.failed;
                if let Some(bar) = &bar {
                    bar.set_position(done);
                    bar.set_message(format!(
                        "{} ({} failed)",
                        p.status.as_str(),
                        p.counts.failed
                    ));
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
                bar.finish();
            }
        });
        Watcher { task, stop }
    }
}

impl Watcher {
    /// Stops showing the job.
    pub async fn finish(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}
