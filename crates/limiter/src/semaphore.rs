//! An async semaphore whose limit can move while permits are held.
//!
//! Built on tokio's FIFO [`Semaphore`]: raising the limit adds permits; lowering it forgets the
//! permits that are free and records the rest as a debt that released permits pay off before
//! they return to the pool. So holders are never interrupted, new acquirers wait until
//! `holders < limit`, and waiters are served in arrival order within a flow
//! ([`AdaptiveSemaphore::acquire_in`]), flows in turn within their group, and the group served
//! least lately first ([`crate::turns`]).
//!
//! Accounting, under one lock: `available + outstanding - debt == limit`, where `outstanding`
//! counts tokio permits handed out. A permit is only registered as held when the debt is zero,
//! so at that moment `holders <= outstanding == limit - available <= limit`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError};

use crate::turns::{Flow, Turns};
use crate::AimdError;

/// The largest limit a semaphore accepts; higher values are clamped to it.
pub const MAX_LIMIT: usize = Semaphore::MAX_PERMITS;

#[derive(Debug)]
struct State {
    limit: usize,
    holders: usize,
    debt: usize,
}

#[derive(Debug)]
struct Inner {
    permits: Arc<Semaphore>,
    state: Mutex<State>,
    waiting: AtomicUsize,
    turns: Turns,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // No code path panics while holding the lock; recover anyway rather than cascade.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `permit` as held, or spends it on the debt (`None`) when the limit dropped
    /// after tokio handed it out.
    fn register(
        self: &Arc<Self>,
        state: &mut State,
        permit: OwnedSemaphorePermit,
    ) -> Option<AdaptivePermit> {
        if state.debt > 0 {
            state.debt -= 1;
            permit.forget();
            return None;
        }
        state.holders += 1;
        Some(AdaptivePermit {
            inner: Arc::clone(self),
            permit: Some(permit),
            limit_at_acquire: state.limit,
            holders_at_acquire: state.holders,
        })
    }
}

/// An async semaphore whose limit can be changed at any time. Cheap to clone (shared state).
///
/// ```
/// use batch_limiter::AdaptiveSemaphore;
///
/// let semaphore = AdaptiveSemaphore::new(2);
/// let a = semaphore.try_acquire().unwrap();
/// let b = semaphore.try_acquire().unwrap();
/// semaphore.set_limit(1); // a and b keep their permits
/// a.release();
/// assert!(semaphore.try_acquire().is_err(), "one holder left, limit 1");
/// drop(b);
/// assert!(semaphore.try_acquire().is_ok());
/// ```
///
/// A permit cannot be released twice: [`AdaptivePermit::release`] consumes it.
///
/// ```compile_fail
/// let semaphore = batch_limiter::AdaptiveSemaphore::new(1);
/// let permit = semaphore.try_acquire().unwrap();
/// permit.release();
/// permit.release();
/// ```
#[derive(Debug, Clone)]
pub struct AdaptiveSemaphore {
    inner: Arc<Inner>,
}

impl AdaptiveSemaphore {
    /// A semaphore with `limit` permits (clamped to [`MAX_LIMIT`]); 0 admits nobody until raised.
    pub fn new(limit: usize) -> Self {
        let limit = limit.min(MAX_LIMIT);
        Self {
            inner: Arc::new(Inner {
                permits: Arc::new(Semaphore::new(limit)),
                state: Mutex::new(State {
                    limit,
                    holders: 0,
                    debt: 0,
                }),
                waiting: AtomicUsize::new(0),
                turns: Turns::default(),
            }),
        }
    }

    /// Waits for a permit, first come first served among the callers of this method (one flow
    /// of [`acquire_in`](Self::acquire_in), which takes its turns beside the others).
    ///
    /// Cancel-safe: dropping the future gives up the place in the queue and leaks nothing.
    /// Fails only after [`close`](Self::close).
    pub async fn acquire(&self) -> Result<AdaptivePermit, AimdError> {
        self.acquire_in(Flow::default()).await
    }

    /// Waits for a permit as a waiter of `flow`: of the groups with waiters, the one with the
    /// fewest permits lately (a count halving every [`USAGE_HALF_LIFE`](crate::USAGE_HALF_LIFE))
    /// is served next, so groups that keep waiting take turns, one permit each, and a group
    /// that arrives beside a busy one has the permits until it catches up; within a group its
    /// flows take turns, and a flow's waiters keep their arrival order (see [`Flow`]). A flow
    /// that queued many waiters (a batch job with a wide window) thus does not take all of its
    /// queue before a flow that came later with few; alone it gets every permit the limit gives.
    ///
    /// Cancel-safe, and fails only after [`close`](Self::close), as [`acquire`](Self::acquire).
    pub async fn acquire_in(&self, flow: Flow<'_>) -> Result<AdaptivePermit, AimdError> {
        let _waiting = WaitingGuard::enter(&self.inner.waiting);
        let mut place = self.inner.turns.join(flow);
        place.turn().await;
        // Only the waiter whose turn it is queues below; its place, dropped on return, passes
        // the turn on.
        loop {
            let permit = Arc::clone(&self.inner.permits)
                .acquire_owned()
                .await
                .map_err(|_| AimdError::Closed)?;
            let mut state = self.inner.lock();
            if let Some(permit) = self.inner.register(&mut state, permit) {
                return Ok(permit);
            }
            // The permit paid for a lowered limit; queue again.
        }
    }

    /// Takes a permit if one is free now (and nobody is queued before us).
    pub fn try_acquire(&self) -> Result<AdaptivePermit, AimdError> {
        let mut state = self.inner.lock();
        if !self.inner.turns.is_idle() && !self.inner.permits.is_closed() {
            // A permit just freed goes to the waiter whose turn it is.
            return Err(AimdError::NoPermits);
        }
        loop {
            match Arc::clone(&self.inner.permits).try_acquire_owned() {
                Ok(permit) => {
                    if let Some(permit) = self.inner.register(&mut state, permit) {
                        return Ok(permit);
                    }
                }
                Err(TryAcquireError::NoPermits) => return Err(AimdError::NoPermits),
                Err(TryAcquireError::Closed) => return Err(AimdError::Closed),
            }
        }
    }

    /// Moves the limit (clamped to [`MAX_LIMIT`]). Lowering never touches current holders;
    /// raising wakes as many waiters as there are new free permits.
    pub fn set_limit(&self, limit: usize) {
        let limit = limit.min(MAX_LIMIT);
        let mut state = self.inner.lock();
        if limit > state.limit {
            let up = limit - state.limit;
            let repaid = up.min(state.debt);
            state.debt -= repaid;
            self.inner.permits.add_permits(up - repaid);
        } else if limit < state.limit {
            let down = state.limit - limit;
            let taken = self.inner.permits.forget_permits(down);
            state.debt += down - taken;
        }
        state.limit = limit;
    }

    /// The limit in force.
    pub fn limit(&self) -> usize {
        self.inner.lock().limit
    }

    /// Permits currently held. May exceed [`limit`](Self::limit) right after a decrease.
    pub fn in_use(&self) -> usize {
        self.inner.lock().holders
    }

    /// Tasks currently inside [`acquire`](Self::acquire) (queued, or about to return).
    pub fn waiting(&self) -> usize {
        self.inner.waiting.load(Ordering::SeqCst)
    }

    /// Makes every pending and future [`acquire`](Self::acquire) fail with
    /// [`AimdError::Closed`]. Held permits stay valid.
    pub fn close(&self) {
        self.inner.permits.close();
    }
}

/// A held permit of an [`AdaptiveSemaphore`]; dropping it (or [`release`](Self::release))
/// gives it back exactly once.
#[derive(Debug)]
#[must_use = "the permit is released as soon as it is dropped"]
pub struct AdaptivePermit {
    inner: Arc<Inner>,
    permit: Option<OwnedSemaphorePermit>,
    limit_at_acquire: usize,
    holders_at_acquire: usize,
}

impl AdaptivePermit {
    /// The semaphore's limit at the instant this permit was granted.
    pub fn limit_at_acquire(&self) -> usize {
        self.limit_at_acquire
    }

    /// Holders (this one included) at the instant this permit was granted; never above
    /// [`limit_at_acquire`](Self::limit_at_acquire).
    pub fn holders_at_acquire(&self) -> usize {
        self.holders_at_acquire
    }

    /// Gives the permit back (same as dropping it, spelled out).
    pub fn release(self) {}
}

impl Drop for AdaptivePermit {
    fn drop(&mut self) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        let mut state = self.inner.lock();
        debug_assert!(
            state.holders > 0,
            "permit released with no holder on record"
        );
        state.holders = state.holders.saturating_sub(1);
        if state.debt > 0 {
            state.debt -= 1;
            permit.forget();
        } else {
            drop(permit);
        }
    }
}

struct WaitingGuard<'a>(&'a AtomicUsize);

impl<'a> WaitingGuard<'a> {
    fn enter(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Self(counter)
    }
}

impl Drop for WaitingGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn lowering_keeps_holders_and_blocks_newcomers_until_below_the_limit() {
        let s = AdaptiveSemaphore::new(4);
        let held: Vec<_> = (0..4).map(|_| s.try_acquire().unwrap()).collect();
        s.set_limit(2);
        assert_eq!(s.in_use(), 4, "nobody was interrupted");
        let mut held = held.into_iter();
        drop(held.next());
        assert!(s.try_acquire().is_err(), "3 holders, limit 2");
        drop(held.next());
        assert!(s.try_acquire().is_err(), "2 holders, limit 2");
        drop(held.next());
        let p = s.try_acquire().expect("1 holder, limit 2");
        assert_eq!(p.limit_at_acquire(), 2);
        assert_eq!(p.holders_at_acquire(), 2);
    }

    #[test]
    fn raising_repays_debt_before_adding_permits() {
        let s = AdaptiveSemaphore::new(4);
        let held: Vec<_> = (0..4).map(|_| s.try_acquire().unwrap()).collect();
        s.set_limit(1); // debt 3
        s.set_limit(3); // debt 1, still no free permit
        assert!(s.try_acquire().is_err());
        drop(held);
        let again: Vec<_> = (0..3).map(|_| s.try_acquire().unwrap()).collect();
        assert!(s.try_acquire().is_err());
        assert_eq!(again.len(), 3);
    }

    #[test]
    fn zero_limit_admits_nobody() {
        let s = AdaptiveSemaphore::new(0);
        assert!(matches!(s.try_acquire(), Err(AimdError::NoPermits)));
        s.set_limit(1);
        assert!(s.try_acquire().is_ok());
    }

    /// A waiter of each of `flows`, each queued before the next comes; each sends its index
    /// once granted and keeps its permit.
    async fn queue_in_order(
        s: &AdaptiveSemaphore,
        flows: &[&'static str],
    ) -> (
        Vec<tokio::task::JoinHandle<AdaptivePermit>>,
        tokio::sync::mpsc::UnboundedReceiver<usize>,
    ) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for (i, &flow) in flows.iter().enumerate() {
            let (waiter, tx) = (s.clone(), tx.clone());
            tasks.push(tokio::spawn(async move {
                let p = waiter.acquire_in(Flow::alone(flow)).await.unwrap();
                tx.send(i).unwrap();
                p
            }));
            while s.waiting() < i + 1 {
                tokio::task::yield_now().await;
            }
        }
        (tasks, rx)
    }

    /// Whether `rx` stays silent for a while.
    async fn silent(rx: &mut tokio::sync::mpsc::UnboundedReceiver<usize>) -> bool {
        tokio::time::timeout(Duration::from_millis(50), rx.recv())
            .await
            .is_err()
    }

    #[tokio::test]
    async fn raising_wakes_waiters_in_arrival_order() {
        let s = AdaptiveSemaphore::new(1);
        let first = s.try_acquire().unwrap();
        // `acquire` is the flow "".
        let (tasks, mut rx) = queue_in_order(&s, &["", "", ""]).await;
        s.set_limit(3);
        let mut order = vec![rx.recv().await.unwrap(), rx.recv().await.unwrap()];
        assert!(
            silent(&mut rx).await,
            "limit 3 with one holder admits exactly two waiters"
        );
        drop(first);
        order.push(rx.recv().await.unwrap());
        assert_eq!(order, vec![0, 1, 2]);
        for t in tasks {
            drop(t.await.unwrap());
        }
        assert_eq!(s.in_use(), 0);
    }

    /// A flow that queued many waiters first gets permits in turns beside flows that came
    /// later, not all of its queue before them; each flow's waiters keep their order.
    #[tokio::test]
    async fn flows_are_served_in_turn() {
        let s = AdaptiveSemaphore::new(1);
        let held = s.try_acquire().unwrap();
        let flows = ["a", "a", "a", "a", "b", "b", "c"];
        let (tasks, mut rx) = queue_in_order(&s, &flows).await;
        // Five more permits, the first taken by a0, whose turn it was before b and c came.
        s.set_limit(6);
        let mut order = Vec::new();
        for _ in 0..5 {
            order.push(rx.recv().await.unwrap());
        }
        assert!(silent(&mut rx).await, "six holders, limit 6");
        assert!(s.try_acquire().is_err(), "the waiters are first");
        drop(held);
        order.push(rx.recv().await.unwrap());
        let mut tasks = tasks.into_iter();
        drop(tasks.next().unwrap().await.unwrap());
        order.push(rx.recv().await.unwrap());
        // a0, then b0 and c0, who had no turn yet, then a1 beside b1, then a2 and a3; first
        // come first served would have been a0..a3 before b0.
        let served: Vec<_> = order.iter().map(|&i| flows[i]).collect();
        assert_eq!(order, [0, 4, 6, 1, 5, 2, 3], "{served:?}");
        for t in tasks {
            drop(t.await.unwrap());
        }
        assert_eq!((s.in_use(), s.waiting()), (0, 0));
        assert!(s.try_acquire().is_ok());
    }

    #[tokio::test]
    async fn cancelled_acquire_leaks_nothing() {
        let s = AdaptiveSemaphore::new(1);
        let held = s.try_acquire().unwrap();
        let waiter = tokio::time::timeout(Duration::from_millis(20), s.acquire()).await;
        assert!(waiter.is_err(), "it had to wait");
        assert_eq!(s.waiting(), 0);
        drop(held);
        let p = s.try_acquire().expect("the cancelled waiter took nothing");
        assert!(s.try_acquire().is_err());
        drop(p);
    }

    #[tokio::test]
    async fn close_fails_waiters() {
        let s = AdaptiveSemaphore::new(0);
        let waiter = tokio::spawn({
            let s = s.clone();
            async move { s.acquire().await.map(|_| ()) }
        });
        while s.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        s.close();
        assert!(matches!(waiter.await.unwrap(), Err(AimdError::Closed)));
    }
}
