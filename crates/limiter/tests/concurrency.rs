//! Many tasks acquiring while the limit moves under them.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use batch_limiter::{AdaptiveSemaphore, Flow};
use rand::Rng;

const MAX: usize = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn holders_never_exceed_the_limit_in_force_while_it_moves() {
    let semaphore = AdaptiveSemaphore::new(MAX);
    let outside = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let acquisitions = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));

    let mover = tokio::spawn({
        let (semaphore, stop) = (semaphore.clone(), stop.clone());
        async move {
            let mut moves = 0usize;
            while !stop.load(Ordering::SeqCst) {
                let limit = rand::rng().random_range(1..=MAX);
                semaphore.set_limit(limit);
                moves += 1;
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
            moves
        }
    });

    let mut workers = Vec::new();
    for _ in 0..64 {
        let (semaphore, outside, peak, acquisitions) = (
            semaphore.clone(),
            outside.clone(),
            peak.clone(),
            acquisitions.clone(),
        );
        workers.push(tokio::spawn(async move {
            for _ in 0..100 {
                let permit = semaphore.acquire().await.unwrap();
                assert!(
                    permit.holders_at_acquire() <= permit.limit_at_acquire(),
                    "{} holders admitted under limit {}",
                    permit.holders_at_acquire(),
                    permit.limit_at_acquire()
                );
                // Counted by the test itself, so it never exceeds the true number of holders.
                let now = outside.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                acquisitions.fetch_add(1, Ordering::SeqCst);
                tokio::task::yield_now().await;
                outside.fetch_sub(1, Ordering::SeqCst);
                drop(permit);
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    let moves = mover.await.unwrap();

    assert_eq!(acquisitions.load(Ordering::SeqCst), 64 * 100);
    assert!(moves > 1, "the limit moved during the run");
    assert!(peak.load(Ordering::SeqCst) <= MAX);
    assert_eq!(semaphore.in_use(), 0);
    assert_eq!(semaphore.waiting(), 0);

    // Nothing leaked and no debt is left: exactly `limit` permits are free at rest.
    semaphore.set_limit(7);
    let held: Vec<_> = (0..7).map(|_| semaphore.try_acquire().unwrap()).collect();
    assert!(semaphore.try_acquire().is_err());
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fixed_limit_is_reached_and_never_passed() {
    const LIMIT: usize = 5;
    let semaphore = AdaptiveSemaphore::new(LIMIT);
    let outside = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..32 {
        let (semaphore, outside, peak) = (semaphore.clone(), outside.clone(), peak.clone());
        workers.push(tokio::spawn(async move {
            for _ in 0..20 {
                let permit = semaphore.acquire().await.unwrap();
                let now = outside.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_micros(500)).await;
                outside.fetch_sub(1, Ordering::SeqCst);
                drop(permit);
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    assert_eq!(peak.load(Ordering::SeqCst), LIMIT, "reached, never passed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lowering_under_load_drains_to_the_new_limit_then_holds_it() {
    let semaphore = AdaptiveSemaphore::new(12);
    let held: Vec<_> = (0..12).map(|_| semaphore.try_acquire().unwrap()).collect();
    let outside = Arc::new(AtomicUsize::new(12));
    let peak_after = Arc::new(AtomicUsize::new(0));
    let mut waiters = Vec::new();
    for _ in 0..20 {
        let (semaphore, outside, peak_after) =
            (semaphore.clone(), outside.clone(), peak_after.clone());
        waiters.push(tokio::spawn(async move {
            let permit = semaphore.acquire().await.unwrap();
            let now = outside.fetch_add(1, Ordering::SeqCst) + 1;
            peak_after.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(1)).await;
            outside.fetch_sub(1, Ordering::SeqCst);
            drop(permit);
        }));
    }
    while semaphore.waiting() < 20 {
        tokio::task::yield_now().await;
    }
    semaphore.set_limit(3);
    for permit in held {
        outside.fetch_sub(1, Ordering::SeqCst);
        drop(permit);
    }
    for waiter in waiters {
        waiter.await.unwrap();
    }
    assert!(
        peak_after.load(Ordering::SeqCst) <= 3,
        "newcomers saw at most the new limit"
    );
}

/// Two flows, one with twelve times the other's waiters, while the limit moves and some
/// waiters give up: each permit goes to the flows in turn, so the small flow gets about as
/// many as the large one (first come first served would give it about a thirteenth), and
/// nothing leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_small_flow_gets_its_turns_beside_a_large_one() {
    let semaphore = AdaptiveSemaphore::new(4);
    let granted = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
    let stop = Arc::new(AtomicBool::new(false));
    let mover = tokio::spawn({
        let (semaphore, stop) = (semaphore.clone(), stop.clone());
        async move {
            while !stop.load(Ordering::SeqCst) {
                semaphore.set_limit(rand::rng().random_range(1..=6));
                tokio::time::sleep(Duration::from_micros(300)).await;
            }
        }
    });
    let mut workers = Vec::new();
    for (flow, count) in [("large", 48), ("small", 4)] {
        for _ in 0..count {
            let (semaphore, granted, stop) = (semaphore.clone(), granted.clone(), stop.clone());
            let index = usize::from(flow == "small");
            workers.push(tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    // One acquire in eight gives up after a moment.
                    let give_up = rand::rng().random_range(0..8) == 0;
                    let permit = if give_up {
                        let wait = Duration::from_micros(rand::rng().random_range(10..500));
                        match tokio::time::timeout(wait, semaphore.acquire_in(Flow::alone(flow)))
                            .await
                        {
                            Ok(permit) => permit.unwrap(),
                            Err(_) => continue,
                        }
                    } else {
                        semaphore.acquire_in(Flow::alone(flow)).await.unwrap()
                    };
                    granted[index].fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_micros(100)).await;
                    drop(permit);
                }
            }));
        }
    }
    while granted[1].load(Ordering::SeqCst) < 400 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (large, small) = (
        granted[0].load(Ordering::SeqCst),
        granted[1].load(Ordering::SeqCst),
    );
    stop.store(true, Ordering::SeqCst);
    // Raised, so every waiter gets in and sees the stop.
    mover.await.unwrap();
    semaphore.set_limit(64);
    for worker in workers {
        worker.await.unwrap();
    }
    // The small flow's four waiters are sometimes all holding (none queued), when the large
    // flow's take the turns alone; a thirteenth would be about 12 × small.
    assert!(large < 3 * small, "large {large}, small {small}");
    assert_eq!((semaphore.in_use(), semaphore.waiting()), (0, 0));
    semaphore.set_limit(5);
    let held: Vec<_> = (0..5).map(|_| semaphore.try_acquire().unwrap()).collect();
    assert!(semaphore.try_acquire().is_err());
    drop(held);
}
