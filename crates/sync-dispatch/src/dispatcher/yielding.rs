//! The task that sets an endpoint's limit from the pool's load ([`crate::load`]), and hands
//! the endpoint back to its limiter while no fresh reading comes.

use std::collections::VecDeque;
use std::sync::Weak;

use super::*;
use crate::load::{self, LoadOptions, Yield};

/// Counts of the batch's attempts in flight kept, one per reading: at the default 100 ms, the
/// last 30 s, more than a Prometheus scrape interval.
const OURS_KEPT: usize = 300;

/// Reads the load every `options.interval` until the endpoint is dropped.
pub(super) async fn follow(endpoint: Weak<Endpoint>, options: LoadOptions, limits: LimitOptions) {
    // Before the pool's capacity is known the batch starts low (the limiter's floor) and
    // grows while nothing waits: starting at the limiter's bound could fill a small pool's
    // queue ahead of online requests at the first reading.
    let start = limits.aimd_min.min(limits.per_endpoint);
    let mut rule = Yield::new(
        options.max_running_per_pod,
        options.headroom,
        limits.global,
        start,
    );
    // A reading may be late by a few intervals (a slow scrape, a busy pod); past this the
    // batch would go on by a picture of the pool that is no longer true.
    let stale_after = (options.interval * 3).max(Duration::from_secs(1));
    let mut last_good = Instant::now();
    // The batch's attempts in flight at each tick, for readings as old as Prometheus's scrape.
    let mut ours_then: VecDeque<(SystemTime, usize)> = VecDeque::new();
    let mut ticker = tokio::time::interval(options.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let Some((client, now)) = endpoint
            .upgrade()
            .map(|e| (e.client.clone(), e.attempts.load(Ordering::SeqCst)))
        else {
            return;
        };
        ours_then.push_back((SystemTime::now(), now));
        while ours_then.len() > OURS_KEPT {
            ours_then.pop_front();
        }
        let reading = load::read(&client, &options, stale_after).await;
        let Some(e) = endpoint.upgrade() else { return };
        match reading {
            Ok((pods, taken)) => {
                let ours = match taken {
                    Some(taken) => ours_when(&ours_then, taken),
                    None => e.attempts.load(Ordering::SeqCst),
                };
                follow_reading(&e, &mut rule, &pods, ours);
                last_good = Instant::now();
            }
            Err(error) if last_good.elapsed() >= stale_after => {
                hand_back_to_limiter(&e, &limits, &error);
            }
            Err(error) => {
                tracing::debug!(endpoint = %e.name, %error, "a load reading failed");
            }
        }
    }
}

/// The batch's attempts in flight when a reading was `taken`: the last count at or before the
/// scrape (the oldest kept if it is older).
fn ours_when(ours_then: &VecDeque<(SystemTime, usize)>, taken: SystemTime) -> usize {
    ours_then
        .iter()
        .rev()
        .find(|(at, _)| *at <= taken)
        .or(ours_then.front())
        .map_or(0, |(_, n)| *n)
}

/// Sets the endpoint's limit from a fresh reading of the pool's `pods`, `ours` of whose
/// requests are the batch's.
fn follow_reading(e: &Endpoint, rule: &mut Yield, pods: &[load::PodLoad], ours: usize) {
    let limit = rule.limit(pods, ours);
    let pool: f64 = pods.iter().map(|p| p.running + p.waiting).sum();
    if !e.load_fresh.swap(true, Ordering::SeqCst) {
        tracing::info!(endpoint = %e.name, pods = pods.len(), "the pool's load sets the limit");
        metrics::gauge!(names::LOAD_FOLLOWED, "endpoint" => e.name.clone()).set(1.0);
    }
    e.semaphore.set_limit(limit);
    metrics::gauge!(names::AIMD_CONCURRENCY_LIMIT, "endpoint" => e.name.clone()).set(limit as f64);
    metrics::gauge!(names::POOL_ONLINE_REQUESTS, "endpoint" => e.name.clone())
        .set((pool - ours as f64).max(0.0));
}

/// With no fresh reading for too long, gives the endpoint's limit back to its limiter (once,
/// until readings come again).
fn hand_back_to_limiter(e: &Endpoint, limits: &LimitOptions, error: &str) {
    if e.load_fresh.swap(false, Ordering::SeqCst) {
        let limit = e.limiter.as_ref().map_or(limits.per_endpoint, |l| {
            l.lock().unwrap_or_else(|p| p.into_inner()).limit()
        });
        e.semaphore.set_limit(limit);
        metrics::gauge!(names::LOAD_FOLLOWED, "endpoint" => e.name.clone()).set(0.0);
        metrics::gauge!(names::AIMD_CONCURRENCY_LIMIT, "endpoint" => e.name.clone())
            .set(limit as f64);
        tracing::warn!(
            endpoint = %e.name,
            %error,
            limit,
            "no fresh reading of the pool's load: the limiter sets the limit until readings come again"
        );
    }
}
