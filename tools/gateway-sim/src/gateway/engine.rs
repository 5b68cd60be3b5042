//! vLLM mode's scheduler: `max_num_seqs` requests run at once, the rest wait in the server's
//! own queue, which is what an online request meets behind a batch that filled the server.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// The running count and the waiting queue of one simulated model server.
#[derive(Default)]
pub(super) struct Engine {
    queue: Mutex<Queue>,
}

#[derive(Default)]
struct Queue {
    running: usize,
    waiting: BinaryHeap<Reverse<Waiter>>,
    arrivals: u64,
}

/// A waiting request, served by `(priority, arrival)`: lower first.
struct Waiter {
    priority: i64,
    arrival: u64,
    wake: oneshot::Sender<()>,
}

impl PartialEq for Waiter {
    fn eq(&self, other: &Self) -> bool {
        (self.priority, self.arrival) == (other.priority, other.arrival)
    }
}
impl Eq for Waiter {}
impl PartialOrd for Waiter {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Waiter {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.priority, self.arrival).cmp(&(other.priority, other.arrival))
    }
}

/// Where a request stands after [`Engine::arrive`].
pub(super) enum Arrival {
    /// It runs now.
    Running(RunSlot),
    /// It waits; [`Pending::run`] resolves when a slot is handed to it.
    Waiting(Pending),
    /// The waiting queue is full.
    Refused,
}

/// A running request's slot; dropping it hands the slot to the next waiter.
pub(super) struct RunSlot(Arc<Engine>);

/// A waiting request's claim on the next free slot.
pub(super) struct Pending {
    engine: Arc<Engine>,
    /// Its place in the queue, to leave it by.
    arrival: u64,
    wake: Option<oneshot::Receiver<()>>,
}

impl Arrival {
    /// The request's slot, once it runs; `None` if it was refused.
    pub(super) async fn slot(self) -> Option<RunSlot> {
        match self {
            Arrival::Running(slot) => Some(slot),
            Arrival::Waiting(pending) => Some(pending.run().await),
            Arrival::Refused => None,
        }
    }
}

impl Engine {
    /// Running and waiting requests now.
    pub(super) fn counts(&self) -> (usize, usize) {
        let q = self.lock();
        (q.running, q.waiting.len())
    }

    /// A request arrives: it runs if a slot is free and nobody waits, else it queues (unless
    /// `max_waiting` are waiting already).
    pub(super) fn arrive(
        self: &Arc<Self>,
        max_num_seqs: usize,
        max_waiting: Option<usize>,
        priority: i64,
    ) -> Arrival {
        let mut q = self.lock();
        if q.running < max_num_seqs && q.waiting.is_empty() {
            q.running += 1;
            return Arrival::Running(RunSlot(self.clone()));
        }
        if max_waiting.is_some_and(|m| q.waiting.len() >= m) {
            return Arrival::Refused;
        }
        let (wake, woken) = oneshot::channel();
        let arrival = q.arrivals;
        q.arrivals += 1;
        q.waiting.push(Reverse(Waiter {
            priority,
            arrival,
            wake,
        }));
        Arrival::Waiting(Pending {
            engine: self.clone(),
            arrival,
            wake: Some(woken),
        })
    }

    /// A slot came free: the first waiter still there takes it, else the running count drops.
    fn release(&self) {
        let mut q = self.lock();
        while let Some(Reverse(next)) = q.waiting.pop() {
            if next.wake.send(()).is_ok() {
                return;
            }
        }
        q.running = q.running.saturating_sub(1);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Pending {
    /// Waits for a slot. The sender is only dropped with the engine, so an error cannot
    /// happen while the engine lives; it is taken as a slot all the same.
    pub(super) async fn run(mut self) -> RunSlot {
        if let Some(woken) = self.wake.as_mut() {
            let _ = woken.await;
        }
        // The slot is this request's now: dropping the claim must not hand it on.
        self.wake = None;
        RunSlot(self.engine.clone())
    }
}

impl Drop for Pending {
    /// A client that leaves while waiting (also while [`Pending::run`] waits) leaves the queue,
    /// so the waiting count no longer shows it; one that leaves just after a slot was handed to
    /// it gives the slot back.
    fn drop(&mut self) {
        if let Some(mut woken) = self.wake.take() {
            woken.close();
            if woken.try_recv().is_ok() {
                self.engine.release();
            } else {
                let arrival = self.arrival;
                self.engine
                    .lock()
                    .waiting
                    .retain(|Reverse(w)| w.arrival != arrival);
            }
        }
    }
}

impl Drop for RunSlot {
    fn drop(&mut self) {
        self.0.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running(a: Arrival) -> RunSlot {
        match a {
            Arrival::Running(slot) => slot,
            _ => panic!("expected to run"),
        }
    }

    fn waiting(a: Arrival) -> Pending {
        match a {
            Arrival::Waiting(p) => p,
            _ => panic!("expected to wait"),
        }
    }

    #[tokio::test]
    async fn runs_up_to_max_num_seqs_then_queues_by_priority_then_arrival() {
        let engine = Arc::new(Engine::default());
        let first = running(engine.arrive(1, None, 0));
        let late_batch = waiting(engine.arrive(1, None, 10));
        let online = waiting(engine.arrive(1, None, 0));
        let online_2 = waiting(engine.arrive(1, None, 0));
        assert_eq!(engine.counts(), (1, 3));
        drop(first);
        let slot = tokio::time::timeout(std::time::Duration::from_secs(1), online.run())
            .await
            .expect("the online request runs first");
        assert_eq!(engine.counts(), (1, 2));
        drop(online_2);
        drop(slot);
        let _slot = late_batch.run().await;
        assert_eq!(engine.counts(), (1, 0));
    }

    #[tokio::test]
    async fn a_full_queue_refuses_and_a_leaver_gives_its_slot_back() {
        let engine = Arc::new(Engine::default());
        let first = running(engine.arrive(1, Some(1), 0));
        let leaver = waiting(engine.arrive(1, Some(1), 0));
        assert!(matches!(engine.arrive(1, Some(1), 0), Arrival::Refused));
        // One that leaves while still waiting leaves the queue at once.
        let waiting_run = tokio::spawn(waiting(engine.arrive(1, Some(2), 0)).run());
        tokio::task::yield_now().await;
        assert_eq!(engine.counts(), (1, 2));
        waiting_run.abort();
        let _ = waiting_run.await;
        assert_eq!(engine.counts(), (1, 1));
        drop(first);
        // The slot was handed to the waiter, who leaves without running.
        drop(leaver);
        assert_eq!(engine.counts(), (0, 0));
        let _again = running(engine.arrive(1, Some(1), 0));
    }
}
