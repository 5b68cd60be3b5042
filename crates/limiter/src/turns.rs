//! Whose turn it is to queue for an [`AdaptiveSemaphore`](crate::AdaptiveSemaphore)'s next
//! permit: its waiters belong to flows (a batch job, a tenant), served in turn, one waiter of
//! each flow with waiters, and in arrival order within a flow.
//!
//! One waiter at a time, the one whose turn it is, queues at the FIFO semaphore below; the
//! others wait for their turn here. A flow that queued many waiters early then gets the permits
//! as they free up only in its turns, beside a flow that came later, rather than all of them
//! before it: first come first served over every waiter would serve the flows one after
//! another in quanta as large as each one's queue.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

use tokio::sync::oneshot;

/// The flows' waiters and the turn.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    queue: Mutex<Queue>,
}

#[derive(Debug, Default)]
struct Queue {
    next_ticket: u64,
    /// The waiters of each flow that has some, in arrival order.
    flows: HashMap<Box<str>, VecDeque<Waiter>>,
    /// The flows of `flows`, in the order their next waiters get the turn.
    order: VecDeque<Box<str>>,
    /// The waiter whose turn it is, until it has its permit or gives up.
    turn: Option<u64>,
}

#[derive(Debug)]
struct Waiter {
    ticket: u64,
    wake: oneshot::Sender<()>,
}

impl Queue {
    /// Gives the turn to the next flow's first waiter, when nobody has it.
    fn advance(&mut self) {
        while self.turn.is_none() {
            let Some(flow) = self.order.pop_front() else {
                return;
            };
            let Some(waiters) = self.flows.get_mut(&flow) else {
                continue;
            };
            let next = waiters.pop_front();
            if waiters.is_empty() {
                self.flows.remove(&flow);
            } else {
                self.order.push_back(flow);
            }
            // A waiter whose receiver is gone is being dropped: its place finds itself neither
            // queued nor holding the turn, and the turn goes on to the next.
            if let Some(Waiter { ticket, wake }) = next {
                if wake.send(()).is_ok() {
                    self.turn = Some(ticket);
                }
            }
        }
    }

    /// Takes `ticket` out of `flow`'s waiters, and the flow out of the order when it has no
    /// other.
    fn remove(&mut self, flow: &str, ticket: u64) {
        let Some(waiters) = self.flows.get_mut(flow) else {
            return;
        };
        waiters.retain(|w| w.ticket != ticket);
        if waiters.is_empty() {
            self.flows.remove(flow);
            self.order.retain(|f| &**f != flow);
        }
    }
}

impl Turns {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // No code path panics while holding the lock; recover anyway rather than cascade.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a waiter of `flow`; its [`Place::turn`] comes when the flows before it had theirs.
    pub(crate) fn join(&self, flow: &str) -> Place<'_> {
        let (wake, woken) = oneshot::channel();
        let mut queue = self.lock();
        let ticket = queue.next_ticket;
        queue.next_ticket += 1;
        match queue.flows.get_mut(flow) {
            Some(waiters) => waiters.push_back(Waiter { ticket, wake }),
            None => {
                queue
                    .flows
                    .insert(flow.into(), VecDeque::from([Waiter { ticket, wake }]));
                queue.order.push_back(flow.into());
            }
        }
        queue.advance();
        Place {
            turns: self,
            flow: flow.into(),
            ticket,
            woken: Some(woken),
        }
    }

    /// Nobody waits for a turn or holds one.
    pub(crate) fn is_idle(&self) -> bool {
        let queue = self.lock();
        queue.turn.is_none() && queue.order.is_empty()
    }
}

/// A waiter's place; dropping it (with its permit taken, or giving up) passes the turn on.
#[derive(Debug)]
pub(crate) struct Place<'a> {
    turns: &'a Turns,
    flow: Box<str>,
    ticket: u64,
    woken: Option<oneshot::Receiver<()>>,
}

impl Place<'_> {
    /// Waits for this place's turn. Cancel-safe: the place is kept, or dropped with the future.
    pub(crate) async fn turn(&mut self) {
        if let Some(woken) = self.woken.as_mut() {
            // The sender is only dropped after a send or with this place: either way, go on.
            let _ = woken.await;
            self.woken = None;
        }
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut queue = self.turns.lock();
        if queue.turn == Some(self.ticket) {
            queue.turn = None;
            queue.advance();
        } else {
            queue.remove(&self.flow, self.ticket);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `place` has its turn (told once).
    fn has_turn(place: &mut Place<'_>) -> bool {
        let woken = place.woken.as_mut().expect("not told yet");
        woken.try_recv().is_ok()
    }

    #[test]
    fn flows_take_turns_and_each_flow_keeps_its_order() {
        let turns = Turns::default();
        // a queues four before b and c come.
        let mut a: Vec<_> = (0..4).map(|_| Some(turns.join("a"))).collect();
        let mut b: Vec<_> = (0..2).map(|_| Some(turns.join("b"))).collect();
        let mut c = vec![Some(turns.join("c"))];
        let mut served = Vec::new();
        for _ in 0..7 {
            let mut next = None;
            for (name, places) in [("a", &mut a), ("b", &mut b), ("c", &mut c)] {
                for (i, slot) in places.iter_mut().enumerate() {
                    if let Some(place) = slot {
                        if has_turn(place) {
                            assert!(next.is_none(), "one turn at a time");
                            next = Some((name, i));
                        }
                    }
                }
            }
            let (name, i) = next.expect("someone has the turn");
            served.push(format!("{name}{i}"));
            // It got its permit: its place goes, and the turn with it.
            match name {
                "a" => a[i] = None,
                "b" => b[i] = None,
                _ => c[i] = None,
            }
        }
        assert_eq!(served, ["a0", "a1", "b0", "c0", "a2", "b1", "a3"]);
        assert!(turns.is_idle());
    }

    #[test]
    fn a_waiter_that_gives_up_passes_its_turn_or_leaves_its_queue() {
        let turns = Turns::default();
        let first = turns.join("a");
        let mut queued = turns.join("b");
        let gone = turns.join("b");
        let mut last = turns.join("c");
        drop(gone);
        drop(first);
        assert!(has_turn(&mut queued));
        drop(queued);
        assert!(has_turn(&mut last));
        assert!(!turns.is_idle());
        drop(last);
        assert!(turns.is_idle());
    }
}
