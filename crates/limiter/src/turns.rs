//! Whose turn it is to queue for an [`AdaptiveSemaphore`](crate::AdaptiveSemaphore)'s next
//! permit: its waiters belong to flows (a batch job) in groups (a tenant); the groups with
//! waiters are served in turn, one waiter each, within a group its flows in turn, and within a
//! flow its waiters in arrival order.
//!
//! One waiter at a time, the one whose turn it is, queues at the FIFO semaphore below; the
//! others wait for their turn here. A flow that queued many waiters early then gets the permits
//! as they free up only in its turns, beside a flow that came later, rather than all of them
//! before it: first come first served over every waiter would serve the flows one after
//! another in quanta as large as each one's queue.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

use tokio::sync::oneshot;

/// Whom a waiter of an [`AdaptiveSemaphore`](crate::AdaptiveSemaphore) waits for
/// ([`acquire_in`](crate::AdaptiveSemaphore::acquire_in)): the groups with waiters get permits
/// in turn, one each; within a group, its flows in turn; within a flow, its waiters in arrival
/// order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Flow<'a> {
    /// The group (a tenant): its flows together get one turn in each round.
    pub group: &'a str,
    /// The flow within its group (a batch job).
    pub name: &'a str,
}

impl<'a> Flow<'a> {
    /// The flow `name`, a group of its own.
    pub fn alone(name: &'a str) -> Self {
        Flow { group: name, name }
    }
}

/// The flows' waiters and the turn.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    queue: Mutex<Queue>,
}

#[derive(Debug, Default)]
struct Queue {
    next_ticket: u64,
    /// Every waiter, by group and flow.
    waiters: Rounds<Rounds<VecDeque<Waiter>>>,
    /// The waiter whose turn it is, until it has its permit or gives up.
    turn: Option<u64>,
}

#[derive(Debug)]
struct Waiter {
    ticket: u64,
    wake: oneshot::Sender<()>,
}

/// Waiters in a line: one queue, or queues served in turn.
trait Line: Default {
    /// The next waiter, taken out.
    fn pop(&mut self) -> Option<Waiter>;
    fn is_empty(&self) -> bool;
}

impl Line for VecDeque<Waiter> {
    fn pop(&mut self) -> Option<Waiter> {
        self.pop_front()
    }

    fn is_empty(&self) -> bool {
        VecDeque::is_empty(self)
    }
}

/// Lines served in turn, one waiter each: only lines with waiters are kept.
#[derive(Debug)]
struct Rounds<T> {
    lines: HashMap<Box<str>, T>,
    /// The keys of `lines`, in the order their next waiters get the turn.
    order: VecDeque<Box<str>>,
}

impl<T> Default for Rounds<T> {
    fn default() -> Self {
        Self {
            lines: HashMap::new(),
            order: VecDeque::new(),
        }
    }
}

impl<T: Line> Line for Rounds<T> {
    fn pop(&mut self) -> Option<Waiter> {
        let key = self.order.pop_front()?;
        let line = self.lines.get_mut(&key)?;
        let next = line.pop();
        if line.is_empty() {
            self.lines.remove(&key);
        } else {
            // Served: to the back of the round.
            self.order.push_back(key);
        }
        next
    }

    fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

impl<T: Line> Rounds<T> {
    /// The line `key`, put at the back of the round when it had no waiter.
    fn line(&mut self, key: &str) -> &mut T {
        if !self.lines.contains_key(key) {
            self.order.push_back(key.into());
        }
        self.lines.entry(key.into()).or_default()
    }

    /// Takes something out of the line `key` with `take`, and the line out of the round when
    /// nothing is left in it.
    fn take_from(&mut self, key: &str, take: impl FnOnce(&mut T)) {
        let Some(line) = self.lines.get_mut(key) else {
            return;
        };
        take(line);
        if line.is_empty() {
            self.lines.remove(key);
            self.order.retain(|k| &**k != key);
        }
    }
}

impl Queue {
    /// Gives the turn to the next waiter, when nobody has it.
    fn advance(&mut self) {
        while self.turn.is_none() {
            let Some(Waiter { ticket, wake }) = self.waiters.pop() else {
                return;
            };
            // A waiter whose receiver is gone is being dropped: its place finds itself neither
            // queued nor holding the turn, and the turn goes on to the next.
            if wake.send(()).is_ok() {
                self.turn = Some(ticket);
            }
        }
    }
}

impl Turns {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // No code path panics while holding the lock; recover anyway rather than cascade.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a waiter of `flow`; its [`Place::turn`] comes when the flows before it had theirs.
    pub(crate) fn join(&self, flow: Flow<'_>) -> Place<'_> {
        let (wake, woken) = oneshot::channel();
        let mut queue = self.lock();
        let ticket = queue.next_ticket;
        queue.next_ticket += 1;
        queue
            .waiters
            .line(flow.group)
            .line(flow.name)
            .push_back(Waiter { ticket, wake });
        queue.advance();
        Place {
            turns: self,
            group: flow.group.into(),
            name: flow.name.into(),
            ticket,
            woken: Some(woken),
        }
    }

    /// Nobody waits for a turn or holds one.
    pub(crate) fn is_idle(&self) -> bool {
        let queue = self.lock();
        queue.turn.is_none() && queue.waiters.is_empty()
    }
}

/// A waiter's place; dropping it (with its permit taken, or giving up) passes the turn on.
#[derive(Debug)]
pub(crate) struct Place<'a> {
    turns: &'a Turns,
    group: Box<str>,
    name: Box<str>,
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
            let (name, ticket) = (&*self.name, self.ticket);
            queue.waiters.take_from(&self.group, |group| {
                group.take_from(name, |flow| flow.retain(|w| w.ticket != ticket));
            });
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
        let mut a: Vec<_> = (0..4).map(|_| Some(turns.join(Flow::alone("a")))).collect();
        let mut b: Vec<_> = (0..2).map(|_| Some(turns.join(Flow::alone("b")))).collect();
        let mut c = vec![Some(turns.join(Flow::alone("c")))];
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
    fn groups_take_turns_and_their_flows_take_turns_within_them() {
        let turns = Turns::default();
        let x = Flow {
            group: "t",
            name: "x",
        };
        let y = Flow {
            group: "t",
            name: "y",
        };
        let z = Flow {
            group: "u",
            name: "z",
        };
        let mut places: Vec<_> = [x, x, x, y, z, z, z]
            .into_iter()
            .map(|f| Some((f.name, turns.join(f))))
            .collect();
        let mut served = Vec::new();
        while let Some(i) = places
            .iter_mut()
            .position(|p| p.as_mut().is_some_and(|(_, place)| has_turn(place)))
        {
            let (name, _) = places[i].take().unwrap();
            served.push(name);
        }
        // x's first had the turn alone; then t and u in turn, x and y in turn within t.
        assert_eq!(served, ["x", "x", "z", "y", "z", "x", "z"]);
        assert!(turns.is_idle());
    }

    #[test]
    fn a_waiter_that_gives_up_passes_its_turn_or_leaves_its_queue() {
        let turns = Turns::default();
        let first = turns.join(Flow::alone("a"));
        let mut queued = turns.join(Flow::alone("b"));
        let gone = turns.join(Flow::alone("b"));
        let mut last = turns.join(Flow::alone("c"));
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
