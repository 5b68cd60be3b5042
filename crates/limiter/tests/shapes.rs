//! The limiters against each gateway shape of the sync benchmark, in simulated time: a closed
//! loop of requests through the limit to a gateway that answers after its latency model, and
//! 429s past its limit. A request meeting a 429 gives its permit back and retries after 1 ms,
//! as the sync dispatcher does with `Retry-After: 0`.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use batch_limiter::{AimdConfig, Algorithm, Limiter, Sample};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A gateway's latency model and limit.
#[derive(Debug, Clone, Copy)]
struct Shape {
    fixed_ms: f64,
    per_token_ms: f64,
    /// Lognormal answer lengths (median, sigma); 16 tokens each when absent.
    lengths: Option<(f64, f64)>,
    /// A share of answers this many times longer.
    tail: Option<(f64, f64)>,
    capacity: usize,
    /// C goes to this between 30 % and 60 % of the run.
    low_capacity: Option<usize>,
    /// C drifts slowly down to half and back up, a cosine of period 20 s.
    drift: bool,
    /// Model-server mode: time per token × max(1, n / C), 429 only past this.
    queue_limit: Option<usize>,
    /// Latency that varies per request for reasons the reported usage does not show.
    noise: Noise,
}

/// Per-request variation of the latency that the answer's `completion_tokens` does not show
/// (prefill of long prompts, prefix-cache misses, slower pods): a factor on the latency.
#[derive(Debug, Clone, Copy)]
enum Noise {
    None,
    /// Lognormal of median 1 and this sigma.
    Lognormal(f64),
    /// Two kinds of request, half each, of these factors.
    TwoKinds(f64, f64),
    /// This share of requests this many times longer.
    Tail(f64, f64),
    /// Two pods behind one URL, C/2 slots each, this one's latency × the factor; the gateway
    /// routes to the pod with fewer in flight (the fast one on a tie).
    SlowPod(f64),
}

const HARD: Shape = Shape {
    fixed_ms: 20.0,
    per_token_ms: 0.0,
    lengths: None,
    tail: None,
    capacity: 64,
    low_capacity: None,
    drift: false,
    queue_limit: None,
    noise: Noise::None,
};

const LENGTHS: Shape = Shape {
    fixed_ms: 10.0,
    per_token_ms: 1.0,
    lengths: Some((40.0, 0.8)),
    ..HARD
};

/// What a run measured (its throughput until 95 % of the lines were answered).
#[derive(Debug)]
struct Outcome {
    /// Throughput over what C / mean served latency allows (time-weighted when C changes).
    share_of_ceiling: f64,
    /// 429 responses per request.
    share_429: f64,
    /// Mean time per output token over its unloaded value.
    token_stretch: f64,
    /// Throughput over C / mean unloaded latency (the knee's).
    share_of_knee: f64,
    limits: Vec<usize>,
}

#[derive(Debug, PartialEq)]
struct Event {
    at: f64,
    kind: Kind,
}

#[derive(Debug, PartialEq)]
enum Kind {
    /// An attempt's answer: sent at, in flight at send, epoch, tokens, refused.
    Answer {
        sent: f64,
        in_flight: usize,
        epoch: u64,
        tokens: u64,
        refused: bool,
        pod: usize,
    },
    /// A backed-off request is ready to queue for a permit again.
    Retry,
}

impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Event {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.at.total_cmp(&other.at)
    }
}

fn lognormal(rng: &mut StdRng, median: f64, sigma: f64) -> f64 {
    let (u1, u2): (f64, f64) = (rng.random(), rng.random());
    let normal = (-2.0 * (1.0 - u1).ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
    median * (sigma * normal).exp()
}

/// Runs `n` requests through a limiter of `algorithm` (min 5, max 128) against `shape`.
fn run(algorithm: Algorithm, shape: Shape, n: usize, seed: u64) -> Outcome {
    let mut limiter: Box<dyn Limiter> = algorithm
        .build(AimdConfig {
            min: 5,
            max: 128,
            ..AimdConfig::default()
        })
        .unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut events = BinaryHeap::new();
    let (mut now, mut started, mut done, mut ready_retries) = (0.0f64, 0usize, 0usize, 0usize);
    let (mut holders, mut gateway_in_flight, mut refusals) = (0usize, 0usize, 0usize);
    let mut pods = [0usize; 2];
    let (mut served_ms, mut unloaded_ms, mut tokens_ms, mut tokens_total) = (0.0, 0.0, 0.0, 0.0);
    let (mut capacity_time, mut t95) = (0.0, 0.0);
    let mut limits = Vec::new();
    // The run's length at full capacity, for the changing gateway's phases.
    let mean_tokens = shape
        .lengths
        .map_or(16.0, |(m, s): (f64, f64)| m * (s * s / 2.0).exp());
    let full =
        n as f64 * (shape.fixed_ms + shape.per_token_ms * mean_tokens) / shape.capacity as f64;
    let capacity_at = |t: f64| match shape.low_capacity {
        Some(low) if t >= 0.3 * full && t < 0.6 * full => low,
        _ if shape.drift => {
            let c = shape.capacity as f64;
            (c * (0.75 + 0.25 * (std::f64::consts::TAU * t / 20_000.0).cos())).round() as usize
        }
        _ => shape.capacity,
    };
    while done < n {
        // Send while permits are free and requests wait (fresh or back from a backoff).
        while holders < limiter.limit() && (ready_retries > 0 || started < n) {
            if ready_retries > 0 {
                ready_retries -= 1;
            } else {
                started += 1;
            }
            holders += 1;
            let c = capacity_at(now);
            let admit_limit = shape.queue_limit.unwrap_or(c);
            let in_flight = holders;
            let epoch = limiter.epoch();
            // Behind one URL, two pods of C/2 slots: the one with fewer in flight.
            let pod = usize::from(matches!(shape.noise, Noise::SlowPod(_)) && pods[1] < pods[0]);
            let full_now = match shape.noise {
                Noise::SlowPod(_) => pods[pod] >= admit_limit / 2,
                _ => gateway_in_flight >= admit_limit,
            };
            if full_now {
                refusals += 1;
                events.push(Reverse(Event {
                    at: now + 0.1,
                    kind: Kind::Answer {
                        sent: now,
                        in_flight,
                        epoch,
                        tokens: 0,
                        refused: true,
                        pod,
                    },
                }));
                continue;
            }
            gateway_in_flight += 1;
            pods[pod] += 1;
            let mut tokens = match shape.lengths {
                Some((median, sigma)) => lognormal(&mut rng, median, sigma),
                None => 16.0,
            };
            if let Some((share, factor)) = shape.tail {
                if rng.random::<f64>() < share {
                    tokens *= factor;
                }
            }
            let tokens = tokens.round().max(1.0);
            let stretch = match shape.queue_limit {
                Some(_) => (gateway_in_flight as f64 / c as f64).max(1.0),
                None => 1.0,
            };
            let factor = match shape.noise {
                Noise::None => 1.0,
                Noise::Lognormal(sigma) => lognormal(&mut rng, 1.0, sigma),
                Noise::TwoKinds(a, b) => {
                    if rng.random::<bool>() {
                        a
                    } else {
                        b
                    }
                }
                Noise::Tail(share, factor) => {
                    if rng.random::<f64>() < share {
                        factor
                    } else {
                        1.0
                    }
                }
                Noise::SlowPod(factor) => [1.0, factor][pod],
            };
            let unloaded = (shape.fixed_ms + shape.per_token_ms * tokens) * factor;
            let latency = (shape.fixed_ms + shape.per_token_ms * tokens * stretch) * factor;
            served_ms += latency;
            unloaded_ms += unloaded;
            tokens_ms += shape.per_token_ms * tokens * stretch;
            tokens_total += tokens;
            events.push(Reverse(Event {
                at: now + latency + 0.2,
                kind: Kind::Answer {
                    sent: now,
                    in_flight,
                    epoch,
                    tokens: tokens as u64,
                    refused: false,
                    pod,
                },
            }));
        }
        let Some(Reverse(event)) = events.pop() else {
            panic!(
                "nothing in flight and nothing sent: limit {}",
                limiter.limit()
            );
        };
        if t95 == 0.0 {
            capacity_time += capacity_at(now) as f64 * (event.at - now);
        }
        now = event.at;
        match event.kind {
            Kind::Retry => ready_retries += 1,
            Kind::Answer {
                sent,
                in_flight,
                epoch,
                tokens,
                refused,
                pod,
            } => {
                holders -= 1;
                let sample = Sample {
                    latency: std::time::Duration::from_secs_f64((now - sent) / 1000.0),
                    overloaded: refused,
                    in_flight,
                    in_flight_at_answer: holders + 1,
                    epoch,
                    tokens: (!refused).then_some(tokens),
                };
                limiter.on_result(sample);
                limits.push(limiter.limit());
                if refused {
                    events.push(Reverse(Event {
                        at: now + 1.0,
                        kind: Kind::Retry,
                    }));
                } else {
                    gateway_in_flight -= 1;
                    pods[pod] -= 1;
                    done += 1;
                    if done * 20 == n * 19 {
                        t95 = now;
                    }
                }
            }
        }
    }
    // Until 95 % of the lines are answered: the last answers of a job drain at a lower
    // concurrency whatever the limiter, for as long as its longest answer takes.
    let throughput = (n * 19 / 20) as f64 / t95;
    let served = n as f64;
    let mean_capacity = capacity_time / t95;
    Outcome {
        share_of_ceiling: throughput / (mean_capacity / (served_ms / served)),
        share_429: refusals as f64 / n as f64,
        token_stretch: if tokens_total > 0.0 && shape.per_token_ms > 0.0 {
            tokens_ms / (shape.per_token_ms * tokens_total)
        } else {
            1.0
        },
        share_of_knee: throughput / (shape.capacity as f64 / (unloaded_ms / served)),
        limits,
    }
}

/// The targets of the benchmark, over three seeds, for a job of the benchmark's size (where
/// the slow start and the changes of C weigh most) and a longer one.
fn meets_targets(algorithm: Algorithm, shape: Shape) {
    for (n, seed) in [6_140, 30_000]
        .into_iter()
        .flat_map(|n| (1..=3).map(move |s| (n, s)))
    {
        let o = run(algorithm, shape, n, seed);
        let tail = &o.limits[o.limits.len() / 2..];
        let what = format!(
            "{algorithm} {n} lines, seed {seed}: {:.3} of the ceiling, {:.3} 429 per request, limits {:?}..{:?}",
            o.share_of_ceiling,
            o.share_429,
            tail.iter().min(),
            tail.iter().max()
        );
        eprintln!("{what}");
        assert!(o.share_of_ceiling >= 0.9, "{what}");
        assert!(o.share_429 <= 0.05, "{what}");
    }
}

#[test]
fn a_hard_limit_at_a_fixed_latency() {
    meets_targets(Algorithm::Work, HARD);
}

#[test]
fn a_hard_limit_with_lognormal_answer_lengths() {
    meets_targets(Algorithm::Work, LENGTHS);
}

#[test]
fn a_hard_limit_with_a_heavy_tail_of_long_answers() {
    meets_targets(
        Algorithm::Work,
        Shape {
            tail: Some((0.01, 20.0)),
            ..LENGTHS
        },
    );
}

#[test]
fn a_hard_limit_going_64_16_64_with_lognormal_lengths() {
    meets_targets(
        Algorithm::Work,
        Shape {
            low_capacity: Some(16),
            ..LENGTHS
        },
    );
}

#[test]
fn a_model_server_is_held_near_its_knee() {
    let shape = Shape {
        queue_limit: Some(128),
        ..LENGTHS
    };
    for seed in 1..=3 {
        let o = run(Algorithm::Work, shape, 30_000, seed);
        let what = format!(
            "seed {seed}: {:.3} of the knee's throughput, time per token × {:.3}, 429 {:.3}",
            o.share_of_knee, o.token_stretch, o.share_429
        );
        eprintln!("{what}");
        assert!(o.share_of_knee >= 0.9, "{what}");
        assert!(o.token_stretch <= 1.25, "{what}");
    }
}

/// Answer lengths the plain gradient is not told about are a spread of the requests' own
/// costs like any other: it measures them over longer windows rather than take them for
/// queueing (it sat at 0.6-0.7 of the ceiling before the spread was measured).
#[test]
fn the_plain_gradient_holds_lengths_it_is_not_told_about() {
    let o = run(Algorithm::Gradient, LENGTHS, 30_000, 1);
    assert!(o.share_of_ceiling >= 0.9, "{o:?}");
}

/// The independent gateway of the noisy shapes: 16 at once, 429 above, 50 ms per answer
/// before the shape's variation, every answer reporting 16 output tokens whatever it took.
const SIXTEEN: Shape = Shape {
    fixed_ms: 50.0,
    capacity: 16,
    ..HARD
};

/// The targets on a shape whose latency varies for reasons the usage does not show, and never
/// below the reference AIMD on the same shape (by more than the noise of one run).
fn meets_targets_beside_aimd(shape: Shape) {
    meets_targets(Algorithm::Work, shape);
    for seed in 1..=3 {
        let work = run(Algorithm::Work, shape, 6_140, seed).share_of_ceiling;
        let aimd = run(Algorithm::Aimd, shape, 6_140, seed).share_of_ceiling;
        eprintln!("seed {seed}: work {work:.3}, aimd {aimd:.3} of the ceiling");
        assert!(
            work >= aimd - 0.02,
            "seed {seed}: work {work:.3} < aimd {aimd:.3}"
        );
    }
}

#[test]
fn sixteen_at_a_fixed_latency() {
    meets_targets_beside_aimd(SIXTEEN);
}

#[test]
fn sixteen_with_lognormal_latency_the_usage_does_not_show() {
    meets_targets_beside_aimd(Shape {
        noise: Noise::Lognormal(0.8),
        ..SIXTEEN
    });
}

#[test]
fn sixteen_with_two_kinds_of_request_20_and_400_ms() {
    meets_targets_beside_aimd(Shape {
        fixed_ms: 1.0,
        noise: Noise::TwoKinds(20.0, 400.0),
        ..SIXTEEN
    });
}

#[test]
fn sixteen_with_a_tenth_of_requests_ten_times_longer() {
    meets_targets_beside_aimd(Shape {
        noise: Noise::Tail(0.1, 10.0),
        ..SIXTEEN
    });
}

#[test]
fn a_fast_and_a_slow_pod_behind_one_url() {
    meets_targets_beside_aimd(Shape {
        noise: Noise::SlowPod(3.0),
        ..SIXTEEN
    });
}

#[test]
fn a_capacity_drifting_slowly_to_half_and_back() {
    meets_targets_beside_aimd(Shape {
        drift: true,
        capacity: 64,
        noise: Noise::Lognormal(0.5),
        ..SIXTEEN
    });
}
