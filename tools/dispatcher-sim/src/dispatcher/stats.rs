//! The dispatcher's counters, kept in its own atomics (no global recorder).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde::Serialize;

use crate::prom::Page;

/// A snapshot of the dispatcher's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DispatcherStats {
    /// Messages taken from request queues (v0.9: ZPOPMIN that returned a member; v0.10: claims
    /// won, and invalid members removed).
    pub taken: u64,
    /// HTTP requests sent to a gateway (first attempts and retries).
    pub dispatched: u64,
    /// Members dropped unread: not a valid envelope.
    pub dropped_invalid: u64,
    /// Messages dropped because their deadline had passed (only with [`crate::ExpiredPolicy::Drop`]).
    pub dropped_expired: u64,
    /// Messages put back into their request queue because the gate closed before sending.
    pub gate_refused: u64,
    /// Retries scheduled in the retry sorted set.
    pub retried: u64,
    /// Results pushed a second time by `duplicate_rate`.
    pub duplicated: u64,
    /// Results written, by outcome: the HTTP status (`"200"`) or the error code (`"CANCELLED"`).
    pub results: BTreeMap<String, u64>,
    /// Redis commands that failed (and were retried or skipped).
    pub redis_errors: u64,
    /// Messages being worked on now.
    pub in_flight: u64,
    /// v0.10: expired claims put back into their sorted set by the reclaimer.
    pub reclaimed: u64,
    /// v0.10: results not written because the claim was no longer this dispatcher's (its lease
    /// ran out and the request was reclaimed, so it will be answered again).
    pub claims_lost: u64,
}

impl DispatcherStats {
    /// Results written with `outcome`.
    pub fn results_for(&self, outcome: &str) -> u64 {
        self.results.get(outcome).copied().unwrap_or(0)
    }

    /// Results written, all outcomes.
    pub fn results_total(&self) -> u64 {
        self.results.values().sum()
    }

    /// The Prometheus text page of these counters.
    pub fn to_prometheus(&self) -> String {
        let mut p = Page::default();
        let counters: [(&str, &str, u64); 8] = [
            (
                "dispatcher_taken_total",
                "Messages taken from request queues.",
                self.taken,
            ),
            (
                "dispatcher_dispatched_total",
                "HTTP requests sent to the gateway.",
                self.dispatched,
            ),
            (
                "dispatcher_gate_refused_total",
                "Messages put back because the gate closed.",
                self.gate_refused,
            ),
            (
                "dispatcher_retried_total",
                "Retries scheduled.",
                self.retried,
            ),
            (
                "dispatcher_duplicated_total",
                "Results pushed twice.",
                self.duplicated,
            ),
            (
                "dispatcher_redis_errors_total",
                "Failed Redis commands.",
                self.redis_errors,
            ),
            (
                "dispatcher_reclaimed_total",
                "Expired claims put back (v0.10).",
                self.reclaimed,
            ),
            (
                "dispatcher_claims_lost_total",
                "Results dropped because the claim had been reclaimed (v0.10).",
                self.claims_lost,
            ),
        ];
        for (name, help, v) in counters {
            p.family(name, "counter", help).sample(name, &[], v as f64);
        }
        p.family(
            "dispatcher_dropped_total",
            "counter",
            "Messages dropped without a result.",
        )
        .sample(
            "dispatcher_dropped_total",
            &[("reason", "invalid")],
            self.dropped_invalid as f64,
        )
        .sample(
            "dispatcher_dropped_total",
            &[("reason", "expired")],
            self.dropped_expired as f64,
        );
        p.family(
            "dispatcher_results_total",
            "counter",
            "Results written, by outcome.",
        );
        for (outcome, n) in &self.results {
            p.sample(
                "dispatcher_results_total",
                &[("outcome", outcome)],
                *n as f64,
            );
        }
        p.family("dispatcher_in_flight", "gauge", "Messages being worked on.")
            .sample("dispatcher_in_flight", &[], self.in_flight as f64);
        p.finish()
    }
}

/// The live counters.
#[derive(Default)]
pub(crate) struct Counters {
    pub taken: AtomicU64,
    pub dispatched: AtomicU64,
    pub dropped_invalid: AtomicU64,
    pub dropped_expired: AtomicU64,
    pub gate_refused: AtomicU64,
    pub retried: AtomicU64,
    pub duplicated: AtomicU64,
    pub redis_errors: AtomicU64,
    pub reclaimed: AtomicU64,
    pub claims_lost: AtomicU64,
    results: Mutex<BTreeMap<String, u64>>,
}

impl Counters {
    pub fn bump(counter: &AtomicU64) -> u64 {
        counter.fetch_add(1, Ordering::SeqCst) + 1
    }

    pub fn result(&self, outcome: &str) {
        *self
            .results
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(outcome.to_owned())
            .or_insert(0) += 1;
    }

    pub fn snapshot(&self, in_flight: u64) -> DispatcherStats {
        let get = |c: &AtomicU64| c.load(Ordering::SeqCst);
        DispatcherStats {
            taken: get(&self.taken),
            dispatched: get(&self.dispatched),
            dropped_invalid: get(&self.dropped_invalid),
            dropped_expired: get(&self.dropped_expired),
            gate_refused: get(&self.gate_refused),
            retried: get(&self.retried),
            duplicated: get(&self.duplicated),
            results: self
                .results
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            redis_errors: get(&self.redis_errors),
            in_flight,
            reclaimed: get(&self.reclaimed),
            claims_lost: get(&self.claims_lost),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_counter() {
        let c = Counters::default();
        Counters::bump(&c.taken);
        Counters::bump(&c.taken);
        c.result("200");
        c.result("CANCELLED");
        c.result("200");
        let s = c.snapshot(3);
        assert_eq!(s.taken, 2);
        assert_eq!(s.results_for("200"), 2);
        assert_eq!(s.results_total(), 3);
        let page = s.to_prometheus();
        assert!(page.contains("dispatcher_taken_total 2\n"), "{page}");
        assert!(
            page.contains("dispatcher_results_total{outcome=\"200\"} 2\n"),
            "{page}"
        );
        assert!(
            page.contains("dispatcher_dropped_total{reason=\"expired\"} 0\n"),
            "{page}"
        );
        assert!(page.contains("dispatcher_in_flight 3\n"), "{page}");
    }
}
