//! Property tests: the controller's bounds and rules, and the semaphore against a plain model.

use batch_limiter::{AdaptivePermit, AdaptiveSemaphore, AimdConfig, AimdController, Change};
use proptest::prelude::*;

fn config() -> impl Strategy<Value = AimdConfig> {
    (1usize..64, 0usize..64, 0.01f64..0.99, 1usize..8).prop_map(|(min, extra, factor, inc)| {
        AimdConfig {
            min,
            max: min + extra,
            backoff_factor: factor,
            additive_increase: inc,
        }
    })
}

proptest! {
    #[test]
    fn limit_stays_within_bounds_and_follows_the_rules(
        cfg in config(),
        signals in proptest::collection::vec(any::<bool>(), 0..500),
    ) {
        let mut aimd = AimdController::new(cfg).unwrap();
        prop_assert_eq!(aimd.limit(), cfg.max);
        for overload in signals {
            let before = aimd.limit();
            let successes_before = aimd.successes();
            let change = if overload { aimd.on_overload() } else { aimd.on_success() };
            let after = aimd.limit();
            prop_assert!(cfg.min <= after && after <= cfg.max, "{} outside [{}, {}]", after, cfg.min, cfg.max);
            if overload {
                let expected = ((before as f64 * cfg.backoff_factor).floor() as usize).max(cfg.min);
                prop_assert_eq!(after, expected);
                prop_assert_eq!(aimd.successes(), 0);
            } else if successes_before + 1 >= before {
                prop_assert_eq!(after, (before + cfg.additive_increase).min(cfg.max));
                prop_assert_eq!(aimd.successes(), 0);
            } else {
                prop_assert_eq!(after, before);
                prop_assert_eq!(aimd.successes(), successes_before + 1);
            }
            match change {
                None => prop_assert_eq!(after, before),
                Some(Change::Increased { from, to }) => prop_assert!(from == before && to == after && to > from),
                Some(Change::Decreased { from, to }) => prop_assert!(from == before && to == after && to < from),
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Acquire,
    Release(usize),
    SetLimit(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Acquire),
        2 => (0usize..32).prop_map(Op::Release),
        1 => (0usize..12).prop_map(Op::SetLimit),
    ]
}

proptest! {
    /// With no async waiters, `try_acquire` succeeds exactly when holders < limit, whatever
    /// sequence of limit moves and releases came before.
    #[test]
    fn semaphore_matches_the_model(initial in 0usize..12, ops in proptest::collection::vec(op(), 0..300)) {
        let semaphore = AdaptiveSemaphore::new(initial);
        let mut limit = initial;
        let mut held: Vec<AdaptivePermit> = Vec::new();
        for op in ops {
            match op {
                Op::Acquire => {
                    let got = semaphore.try_acquire();
                    prop_assert_eq!(got.is_ok(), held.len() < limit, "holders {} limit {}", held.len(), limit);
                    if let Ok(permit) = got {
                        prop_assert!(permit.holders_at_acquire() <= permit.limit_at_acquire());
                        prop_assert_eq!(permit.limit_at_acquire(), limit);
                        held.push(permit);
                    }
                }
                Op::Release(i) => {
                    if !held.is_empty() {
                        held.swap_remove(i % held.len()).release();
                    }
                }
                Op::SetLimit(n) => {
                    semaphore.set_limit(n);
                    limit = n;
                }
            }
            prop_assert_eq!(semaphore.in_use(), held.len());
            prop_assert_eq!(semaphore.limit(), limit);
        }
    }
}
