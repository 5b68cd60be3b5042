//! Whose turn it is to queue for an [`AdaptiveSemaphore`](crate::AdaptiveSemaphore)'s next
//! permit: its waiters belong to flows (a batch job) in groups (a tenant); of the groups with
//! waiters, the one that had the fewest turns lately is served next, one waiter at a time,
//! within a group its flows in turn, and within a flow its waiters in arrival order.
//!
//! "Lately" is a count of turns that halves every [`USAGE_HALF_LIFE`]. Groups that keep
//! waiting side by side thus take turns, one each, as in a round; a group that arrives beside
//! one that has been served for a while gets every turn until its recent count catches up
//! (at most a half-life when both keep waiting), so a small batch arriving beside a large
//! one's backlog runs about as fast as alone rather than at half its speed. Over longer than
//! the half-life, every group waiting gets the same share.
//!
//! One waiter at a time, the one whose turn it is, queues at the FIFO semaphore below; the
//! others wait for their turn here. A flow that queued many waiters early then gets the permits
//! as they free up only in its turns, beside a flow that came later, rather than all of them
//! before it: first come first served over every waiter would serve the flows one after
//! another in quanta as large as each one's queue.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

/// How fast a group's count of recent turns fades: it halves in this time. Long enough for
/// a head start to carry a batch of a few thousand requests of a newly arrived group through,
/// short enough that a group served heavily a minute ago waits no longer for it.
pub const USAGE_HALF_LIFE: Duration = Duration::from_secs(10);

/// Once there are this many groups' counts, the faded ones are forgotten at the next turn.
const USAGE_KEPT: usize = 64;

/// Whom a waiter of an [`AdaptiveSemaphore`](crate::AdaptiveSemaphore) waits for
/// ([`acquire_in`](crate::AdaptiveSemaphore::acquire_in)): of the groups with waiters, the one
/// with the fewest permits lately first; within a group, its flows in turn; within a flow, its
/// waiters in arrival order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Flow<'a> {
    /// The group (a tenant): its flows' permits are counted together.
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
    /// Each group's recent turns, waiting or not (a group that just finished a burst is still
    /// behind one that never came).
    usage: HashMap<Box<str>, Usage>,
}

/// A count of turns that halves every [`USAGE_HALF_LIFE`].
#[derive(Debug, Clone, Copy)]
struct Usage {
    count: f64,
    at: Instant,
}

impl Usage {
    /// The count as of `now`.
    fn at(self, now: Instant) -> f64 {
        let age = now.saturating_duration_since(self.at).as_secs_f64();
        self.count * (-age / USAGE_HALF_LIFE.as_secs_f64()).exp2()
    }
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
        self.pop_at(0)
    }

    fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

impl<T: Line> Rounds<T> {
    /// The next waiter of the `i`th line in the round's order, taken out; the line goes to the
    /// back of the round, or out of it when that was its last waiter.
    fn pop_at(&mut self, i: usize) -> Option<Waiter> {
        let key = self.order.remove(i)?;
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
            let now = Instant::now();
            let Some((index, count)) = self.least_served(now) else {
                return;
            };
            // Counted before it is known whether the waiter is still there: one turn too many
            // for a group whose waiter gave up as its turn came, which is rare and harmless.
            self.served(index, count + 1.0, now);
            let Some(Waiter { ticket, wake }) = self.waiters.pop_at(index) else {
                return;
            };
            // A waiter whose receiver is gone is being dropped: its place finds itself neither
            // queued nor holding the turn, and the turn goes on to the next.
            if wake.send(()).is_ok() {
                self.turn = Some(ticket);
            }
        }
    }

    /// The place in the round's order of the group with waiters that had the fewest turns
    /// lately (of equals, the first: the one served longest ago), and its recent count.
    fn least_served(&self, now: Instant) -> Option<(usize, f64)> {
        let mut least: Option<(usize, f64)> = None;
        for (index, key) in self.waiters.order.iter().enumerate() {
            let count = self.usage.get(key).map_or(0.0, |u| u.at(now));
            if least.is_none_or(|(_, fewest)| count < fewest) {
                least = Some((index, count));
            }
        }
        least
    }

    /// Records that the `index`th group in the round's order has a turn, its recent count now
    /// `count`.
    fn served(&mut self, index: usize, count: f64, now: Instant) {
        let Some(key) = self.waiters.order.get(index) else {
            return;
        };
        let usage = Usage { count, at: now };
        if let Some(known) = self.usage.get_mut(key) {
            *known = usage;
            return;
        }
        if self.usage.len() >= USAGE_KEPT {
            // Forget the groups whose count has faded to nothing: they would come back as new.
            self.usage.retain(|_, u| u.at(now) >= 0.5);
        }
        self.usage.insert(key.clone(), usage);
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
        // a0 had the turn alone; b and c, with no turn yet, come before a's next.
        assert_eq!(served, ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]);
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
        assert_eq!(served, ["x", "z", "x", "z", "y", "z", "x"]);
        assert!(turns.is_idle());
    }

    /// Joins `flows` in order, then lets the one with the turn take its permit (drop its place)
    /// until none is left: the groups in the order they were served.
    fn served(turns: &Turns, flows: &[&str]) -> String {
        let mut places: Vec<_> = flows
            .iter()
            .map(|&f| Some((f, turns.join(Flow::alone(f)))))
            .collect();
        let mut served = String::new();
        while let Some(i) = places
            .iter_mut()
            .position(|p| p.as_mut().is_some_and(|(_, place)| has_turn(place)))
        {
            let (name, _) = places[i].take().unwrap();
            served.push_str(name);
        }
        assert!(places.iter().all(Option::is_none), "every waiter served");
        served
    }

    #[tokio::test(start_paused = true)]
    async fn a_group_that_arrives_beside_a_busy_one_gets_the_turns_until_it_catches_up() {
        let turns = Turns::default();
        // a was served 20 times just now.
        assert_eq!(served(&turns, &["a"; 20]), "a".repeat(20));
        // a's first waiter takes the free turn (21); b, with none lately, then has every turn
        // until its count reaches a's, and then they take turns (of equals, the one served
        // longest ago first).
        let mut flows = vec!["a"; 30];
        flows.extend(["b"; 30]);
        let order = served(&turns, &flows);
        assert_eq!(&order[..22], format!("a{}", "b".repeat(21)));
        assert_eq!(&order[22..40], "ab".repeat(9));

        // Counts fade: a half-life later a's 50 count 25 and b's 30 count 15, so b's head start
        // is 10 turns, not 20.
        tokio::time::advance(USAGE_HALF_LIFE).await;
        let mut flows = vec!["a"; 12];
        flows.extend(["b"; 12]);
        let order = served(&turns, &flows);
        assert_eq!(&order[..12], format!("a{}", "b".repeat(11)));
        assert_eq!(&order[12..14], "ab");

        // Ten minutes later nobody has a head start: a group new to the turns is as one not seen
        // for long.
        tokio::time::advance(60 * USAGE_HALF_LIFE).await;
        let order = served(&turns, &["a", "a", "c", "c"]);
        assert_eq!(order, "acac");
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
