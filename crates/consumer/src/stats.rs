use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use tokio::sync::watch;

use crate::WriteReport;

/// Counters of one consumer, also exported as `batch_consumer_results_total{outcome}`.
#[derive(Debug)]
pub struct ConsumerStats {
    received: AtomicU64,
    written: AtomicU64,
    duplicates: AtomicU64,
    mismatched: AtomicU64,
    unknown_job: AtomicU64,
    parked: AtomicU64,
    handed_on: AtomicU64,
    malformed: AtomicU64,
    recovered: AtomicU64,
    redis_errors: AtomicU64,
    handler_errors: AtomicU64,
    empty_polls: watch::Sender<u64>,
}

impl Default for ConsumerStats {
    fn default() -> Self {
        Self {
            received: AtomicU64::new(0),
            written: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            mismatched: AtomicU64::new(0),
            unknown_job: AtomicU64::new(0),
            parked: AtomicU64::new(0),
            handed_on: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            recovered: AtomicU64::new(0),
            redis_errors: AtomicU64::new(0),
            handler_errors: AtomicU64::new(0),
            empty_polls: watch::Sender::new(0),
        }
    }
}

fn count(outcome: &'static str, n: u64) {
    metrics::counter!("batch_consumer_results_total", "outcome" => outcome).increment(n);
}

impl ConsumerStats {
    pub(crate) fn received(&self, n: u64) {
        self.received.fetch_add(n, Relaxed);
    }

    pub(crate) fn report(&self, r: &WriteReport) {
        self.written.fetch_add(r.written, Relaxed);
        self.duplicates.fetch_add(r.duplicates, Relaxed);
        count("written", r.written);
        count("duplicate", r.duplicates);
        if r.mismatched > 0 {
            self.mismatched.fetch_add(r.mismatched, Relaxed);
            count("token_mismatch", r.mismatched);
        }
    }

    pub(crate) fn parked_and_dropped(&self, parked: u64, dropped: u64) {
        self.parked.fetch_add(parked, Relaxed);
        self.unknown_job.fetch_add(dropped, Relaxed);
        count("parked", parked);
        count("unknown_job", dropped);
    }

    pub(crate) fn handed_on(&self, n: u64) {
        self.handed_on.fetch_add(n, Relaxed);
        count("handed_on", n);
    }

    pub(crate) fn malformed(&self) {
        self.malformed.fetch_add(1, Relaxed);
        count("malformed", 1);
    }

    pub(crate) fn add_recovered(&self, n: u64) {
        self.recovered.fetch_add(n, Relaxed);
    }

    pub(crate) fn redis_error(&self) {
        self.redis_errors.fetch_add(1, Relaxed);
    }

    pub(crate) fn handler_error(&self) {
        self.handler_errors.fetch_add(1, Relaxed);
    }

    pub(crate) fn empty_poll(&self) {
        self.empty_polls.send_modify(|n| *n += 1);
    }

    /// Results taken from the list (including malformed ones).
    pub fn received_total(&self) -> u64 {
        self.received.load(Relaxed)
    }
    /// Results written to a job.
    pub fn written_total(&self) -> u64 {
        self.written.load(Relaxed)
    }
    /// Results whose line existed already.
    pub fn duplicates_total(&self) -> u64 {
        self.duplicates.load(Relaxed)
    }
    /// Results dropped because their `request_token` was not their line's.
    pub fn mismatched_total(&self) -> u64 {
        self.mismatched.load(Relaxed)
    }
    /// Results dropped because their job exists nowhere (not here, not registered).
    pub fn unknown_job_total(&self) -> u64 {
        self.unknown_job.load(Relaxed)
    }
    /// Results of jobs registered but running elsewhere, kept in their jobs' parked lists.
    pub fn parked_total(&self) -> u64 {
        self.parked.load(Relaxed)
    }
    /// Results of jobs whose requests name another list, pushed onto that list.
    pub fn handed_on_total(&self) -> u64 {
        self.handed_on.load(Relaxed)
    }
    /// Messages that were not results, or named no job.
    pub fn malformed_total(&self) -> u64 {
        self.malformed.load(Relaxed)
    }
    /// Results found in flight at start.
    pub fn recovered_total(&self) -> u64 {
        self.recovered.load(Relaxed)
    }
    /// Redis errors met (each retried).
    pub fn redis_errors_total(&self) -> u64 {
        self.redis_errors.load(Relaxed)
    }
    /// Handler failures met (each retried).
    pub fn handler_errors_total(&self) -> u64 {
        self.handler_errors.load(Relaxed)
    }

    /// Resolves once the consumer has found its list empty after this call: everything that
    /// was in the list when it was called has been handled. When the consumer is idle, this
    /// can take up to one poll timeout.
    pub async fn drained(&self) {
        let mut rx = self.empty_polls.subscribe();
        let start = *rx.borrow_and_update();
        // The sender lives as long as `self`, so this cannot fail while we borrow it.
        let _ = rx.wait_for(|&n| n > start).await;
    }
}
