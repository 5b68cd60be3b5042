//! A latency-gradient limiter in the manner of TCP Vegas and Netflix's Gradient2, with a
//! 429 cut to the concurrency the gateway refused (not a fraction of the limit).
//!
//! Pure state like the reference controller: the caller measures latencies.

use std::collections::VecDeque;
use std::time::Duration;

use crate::limiter::{Algorithm, Limiter, Sample};
use crate::work::WorkModel;
use crate::{AimdError, Change};

/// The most round trips one slow-start window counts for (a growth of at most eight times).
const SLOW_START_ROUNDS: f64 = 3.0;

/// Parameters of a [`GradientLimiter`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradientConfig {
    /// The floor of the limit; at least 1.
    pub min: usize,
    /// The ceiling.
    pub max: usize,
    /// The starting limit, in `[min, max]`. Until the first decrease the limit doubles each
    /// unqueued round trip (slow start), so a low start finds the gateway's latency floor before
    /// it fills the gateway.
    pub initial: usize,
    /// The first increase after a decrease; later increases double it, up to a quarter of
    /// the limit. At least 1.
    pub initial_step: usize,
    /// A window whose mean latency is at most `floor × tolerance` counts as unqueued; above
    /// 1, so that scheduling noise is not taken for queueing.
    pub tolerance: f64,
    /// Weight of the estimate `in_flight × floor / latency` when latency cuts the limit, in
    /// (0, 1]; 1 jumps straight to it, which also shows the gateway unqueued again, so the
    /// floor stays fresh.
    pub smoothing: f64,
    /// The latency floor is the least window mean over this many windows; at least 1. Older
    /// windows are forgotten, so a gateway that became slower is followed.
    pub floor_windows: usize,
    /// A window is `max(limit, min_window)` successes (in slow start, `limit`: one round
    /// trip, so the limit doubles per round trip as TCP's does; with `per_work`, where a few
    /// answers say little, the window stays this long and the limit grows once per round trip
    /// it spanned); at least 1.
    pub min_window: usize,
    /// Windows without an overload before the limit may pass the concurrency that was last
    /// refused.
    pub hold_windows: usize,
    /// After this many windows none of which came near the floor (within a quarter of the
    /// tolerance above it), the limit drops for one window to 0.9 × what the gateway serves
    /// at the floor, to see the floor again before it is forgotten, then goes back (BBR's
    /// ProbeRTT, which also waits until its minimum is stale). At least 1; below
    /// `floor_windows` to be useful.
    pub probe_windows: usize,
    /// Measure each window per unit of work rather than per answer: its latencies over its
    /// answers' output tokens plus the fixed cost of an answer counted in tokens (learnt from
    /// the answers, see [`Algorithm::Work`]). Answers of varied length then do not look like
    /// queueing. Without lengths it is the plain mean latency.
    pub per_work: bool,
    /// Consecutive windows above the tolerance before the limit shrinks on latency (at least
    /// one). The windows between neither grow nor shrink it: one window slowed by a
    /// scheduling hiccup of the machine is not queueing, several in a row are.
    pub confirm_windows: usize,
}

impl Default for GradientConfig {
    fn default() -> Self {
        Self {
            min: 1,
            max: 1000,
            initial: 1,
            initial_step: 1,
            tolerance: 1.3,
            smoothing: 1.0,
            floor_windows: 100,
            min_window: 16,
            hold_windows: 3,
            probe_windows: 40,
            per_work: false,
            confirm_windows: 1,
        }
    }
}

impl GradientConfig {
    /// Checks the constraints the rules rely on.
    pub fn validate(&self) -> Result<(), AimdError> {
        crate::check_bounds(self.min, self.max)?;
        if !(self.min..=self.max).contains(&self.initial) {
            return Err(AimdError::invalid(format!(
                "initial ({}) must be within min ({}) and max ({})",
                self.initial, self.min, self.max
            )));
        }
        if self.initial_step == 0 {
            return Err(AimdError::invalid("initial_step must be at least 1"));
        }
        if !(self.tolerance > 1.0 && self.tolerance.is_finite()) {
            return Err(AimdError::invalid(format!(
                "tolerance must be above 1, got {}",
                self.tolerance
            )));
        }
        if !(self.smoothing > 0.0 && self.smoothing <= 1.0) {
            return Err(AimdError::invalid(format!(
                "smoothing must be in (0, 1], got {}",
                self.smoothing
            )));
        }
        if self.floor_windows == 0
            || self.min_window == 0
            || self.probe_windows == 0
            || self.confirm_windows == 0
        {
            return Err(AimdError::invalid(
                "floor_windows, min_window, probe_windows and confirm_windows must be at least 1",
            ));
        }
        Ok(())
    }
}

/// A window's cost is a mean of answers whose latencies vary with what each request asks
/// (prompt length, cache hits, the pod it lands on), not only with the load. The floor, the
/// least of many such means, would sit a couple of standard errors below their true value,
/// and an ordinary window would look queued. So each window keeps the spread of its answers:
/// - the floor is taken from each window's mean plus [`FLOOR_ERRORS`] standard errors (about
///   what the least of `floor_windows` unqueued means falls below their true value);
/// - a window counts as queued only when its mean minus [`QUEUE_ERRORS`] standard errors
///   passes the tolerance (and, as before, `confirm_windows` in a row);
/// - a window lasts long enough for its standard error to be at most half the tolerance's
///   margin ([`answers_needed`]), up to [`MAX_WINDOW`] answers: noisy answers are
///   measured over more of them, answers that all cost the same over `min_window`.
///
/// Answers that all cost the same have no spread, and then all of this is the plain mean.
const FLOOR_ERRORS: f64 = 2.5;
/// See [`FLOOR_ERRORS`].
const QUEUE_ERRORS: f64 = 1.0;
/// The longest window, in answers, however noisy they are.
const MAX_WINDOW: usize = 1024;
/// How fast the spread seen is followed, per window.
const SPREAD_WEIGHT: f64 = 0.2;

/// Successes gathered toward the next decision.
#[derive(Debug, Clone, Default)]
struct Window {
    count: usize,
    sums: Sums,
    spread: SpreadSums,
    max_in_flight: usize,
}

impl Window {
    fn add(&mut self, latency: f64, tokens: f64, in_flight: usize, cost: f64) {
        self.count += 1;
        self.sums.add(latency, tokens);
        self.spread.add(cost, in_flight as f64);
        self.max_in_flight = self.max_in_flight.max(in_flight);
    }
}

/// Each answer's own cost (its latency over its work, as the work was known when it came)
/// against the requests in flight when it was sent: what of its spread the concurrency
/// explains is queueing, the rest is the requests' own.
#[derive(Debug, Clone, Copy, Default)]
struct SpreadSums {
    n: f64,
    cost: f64,
    cost_sq: f64,
    in_flight: f64,
    in_flight_sq: f64,
    cost_in_flight: f64,
}

impl SpreadSums {
    fn add(&mut self, cost: f64, in_flight: f64) {
        self.n += 1.0;
        self.cost += cost;
        self.cost_sq += cost * cost;
        self.in_flight += in_flight;
        self.in_flight_sq += in_flight * in_flight;
        self.cost_in_flight += cost * in_flight;
    }

    /// The spread of one answer's cost that the in-flight count does not explain, over the
    /// mean cost (a coefficient of variation).
    fn own_spread(&self) -> f64 {
        let n = self.n;
        if n < 3.0 {
            return 0.0;
        }
        let mean = self.cost / n;
        if mean <= 0.0 {
            return 0.0;
        }
        let var_cost = (self.cost_sq / n - mean * mean).max(0.0);
        let mean_f = self.in_flight / n;
        let var_f = self.in_flight_sq / n - mean_f * mean_f;
        let cov = self.cost_in_flight / n - mean * mean_f;
        // Only a concurrency that makes answers slower is queueing.
        let explained = if var_f > 1e-9 && cov > 0.0 {
            cov * cov / var_f
        } else {
            0.0
        };
        ((var_cost - explained).max(0.0) * n / (n - 2.0)).sqrt() / mean
    }
}

/// What a closed window keeps for the floor: its sums, so that its cost per unit of work can
/// be measured again as the fixed cost in tokens is learnt better.
#[derive(Debug, Clone, Copy, Default)]
struct Sums {
    count: f64,
    latency: f64,
    tokens: f64,
}

impl Sums {
    fn add(&mut self, latency: f64, tokens: f64) {
        self.count += 1.0;
        self.latency += latency;
        self.tokens += tokens;
    }

    fn merge(&mut self, other: &Sums) {
        self.count += other.count;
        self.latency += other.latency;
        self.tokens += other.tokens;
    }
}

/// A window's cost and its standard error.
#[derive(Debug, Clone, Copy)]
struct Cost {
    mean: f64,
    error: f64,
}

impl Cost {
    /// What must pass the tolerance for the window to count as queued.
    fn low(self) -> f64 {
        (self.mean - QUEUE_ERRORS * self.error).max(0.0)
    }

    /// What a window offers as the floor.
    fn high(self) -> f64 {
        self.mean + FLOOR_ERRORS * self.error
    }
}

/// What a closed window says of the gateway, read against the floor.
#[derive(Debug, Clone, Copy)]
struct Reading {
    /// The latency floor (per answer, or per unit of work), this window included.
    floor: f64,
    /// The low end of the window's cost (see [`Cost::low`]): the part of it that the spread
    /// of the requests' own costs cannot explain.
    mean: f64,
    /// The requests in flight when the window's answers were sent, on average.
    mean_in_flight: f64,
    /// Within a quarter of the tolerance above the floor.
    near_floor: bool,
    /// Above the tolerance: the gateway is queueing.
    queued: bool,
}

impl Reading {
    /// What the gateway serves at the floor latency: `mean in_flight × floor / mean`
    /// (Gradient2's estimate).
    fn serves(&self) -> f64 {
        self.mean_in_flight * self.floor / self.mean
    }
}

/// Answers a window needs for its standard error to be at most half of `tolerance`'s margin,
/// given the spread of one answer's cost.
fn answers_needed(spread: f64, tolerance: f64) -> usize {
    let n = (2.0 * spread / (tolerance - 1.0)).powi(2).ceil();
    if n.is_finite() {
        (n as usize).min(MAX_WINDOW)
    } else {
        MAX_WINDOW
    }
}

/// A concurrency limit that fills the gateway without queueing in it.
///
/// It starts at `initial` and doubles per round trip until the first decrease (slow start):
/// per window, or up to eight times over a window of `min_window` answers that spanned up
/// to three round trips at a low limit.
/// Then the rules, applied per window of `max(limit, min_window)` successful answers (about
/// one round trip; longer when the requests' own costs are spread, see **Noise**):
/// - **Floor**: the least window mean over the last `floor_windows` windows, the gateway's
///   unqueued latency (TCP Vegas's base RTT). A mean, not the quickest answer: inference
///   latency varies with each request's length, and against the quickest one a typical
///   answer would look queued.
/// - **Grow** while the window's mean latency stays within `floor × tolerance` and the limit is
///   in use (its busiest moment had at least half the limit in flight): by a step that starts
///   at `initial_step` and doubles each window, capped at a quarter of the limit. Below the
///   concurrency last refused the growth stops one short of it, and passing it waits
///   `hold_windows` calm windows (TCP CUBIC's plateau). A quarter past it with the latency
///   still near the floor, that refusal is stale (the gateway grew): slow start again, which
///   ends at the next overload or queued window, or at the highest limit a calm window has
///   used in full, past which it grows as past a refusal (TCP's `ssthresh`). Once the
///   latency is halfway to the tolerance it does not pass `tolerance` times what the window
///   says the gateway serves at the floor.
/// - **Shrink on latency**: when the mean latency is above the tolerance the gateway is
///   queueing; the limit moves toward `mean in_flight × floor / mean latency` (what it serves
///   at the floor latency; Gradient2's rule) by `smoothing`. The step restarts.
/// - **Probe**: after `probe_windows` windows none of which came within a quarter of the
///   tolerance of the floor, the limit drops for one window to 0.9 × that estimate, answers
///   sent above it are left out, and then it goes back. So the floor is seen again before
///   it is forgotten; else, against a gateway kept just within the tolerance, it would
///   creep up with the queue. A gateway answering at its floor anyway is not probed: a
///   probe costs a tenth of the limit for a round trip or two.
///
/// ```
/// use std::time::Duration;
/// use batch_limiter::{GradientConfig, GradientLimiter};
///
/// let mut l = GradientLimiter::new(GradientConfig { max: 128, initial: 100, ..GradientConfig::default() }).unwrap();
/// // 65 were in flight when the gateway refused one: it holds 64.
/// l.on_overload(65, l.epoch());
/// assert_eq!(l.limit(), 64);
/// // 64 answers at 20 ms close a window and set the latency floor.
/// for _ in 0..64 {
///     l.on_success(Duration::from_millis(20), 64);
/// }
/// assert_eq!(l.floor(), Some(Duration::from_millis(20)));
/// ```
/// - **Cut on overload** (429/5xx), once per episode like the reference: to one less than the
///   requests in flight when the refused one was sent, the concurrency the gateway just
///   refused (at least one less than the limit), never below `min`. Each later refusal of
///   the same burst lowers it below the count it was sent with, if lower.
/// - **Noise**: latency that varies per request for reasons no answer reports (prompt
///   lengths, cache misses, pods of different speeds) is not queueing. Each window measures
///   the spread of its answers' costs that the in-flight count does not explain; every mean
///   above is then read with its standard error (2.5 of them on the floor, one on a queued
///   window), and a window lasts
///   until that error is small against the tolerance.
#[derive(Debug, Clone)]
pub struct GradientLimiter {
    config: GradientConfig,
    limit: usize,
    step: usize,
    epoch: u64,
    /// The in-flight count of the last refused request; `usize::MAX` before any.
    refused_at: usize,
    calm_windows: usize,
    /// Consecutive windows above the tolerance.
    queued_windows: usize,
    /// Windows since one whose mean came near the floor.
    windows_off_floor: usize,
    /// While probing, the limit to go back to.
    probe: Option<usize>,
    slow_start: bool,
    /// The highest limit a calm window has used in full: where a restarted slow start stops
    /// doubling, as TCP's does at `ssthresh`, rather than overshooting past a gateway that
    /// has only grown back to what it was.
    proven: usize,
    /// While a restarted slow start runs, the limit it stops at.
    slow_start_cap: Option<usize>,
    window: Window,
    floors: VecDeque<Sums>,
    /// With `per_work`, the fit of latency against length.
    work: Option<WorkModel>,
    /// The spread of one answer's own cost (see [`SpreadSums::own_spread`]), followed across
    /// windows.
    spread: f64,
}

impl GradientLimiter {
    /// A limiter starting at `config.initial`, after checking `config`.
    pub fn new(config: GradientConfig) -> Result<Self, AimdError> {
        config.validate()?;
        Ok(Self {
            config,
            limit: config.initial,
            step: config.initial_step,
            epoch: 0,
            refused_at: usize::MAX,
            calm_windows: 0,
            queued_windows: 0,
            windows_off_floor: 0,
            probe: None,
            slow_start: true,
            proven: 0,
            slow_start_cap: None,
            window: Window::default(),
            floors: VecDeque::new(),
            work: config.per_work.then(WorkModel::default),
            spread: 0.0,
        })
    }

    /// The limit in force.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The parameters.
    pub fn config(&self) -> &GradientConfig {
        &self.config
    }

    /// The latency floor, once a window has closed: with `per_work`, of an answer of the
    /// mean length seen.
    pub fn floor(&self) -> Option<Duration> {
        let per_answer = self
            .work
            .as_ref()
            .map_or(1.0, |w| w.mean_tokens() + w.fixed_tokens());
        self.floor_secs()
            .map(|f| Duration::from_secs_f64(f * per_answer))
    }

    /// Overload cuts so far (see [`Limiter::epoch`]).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The least cost a remembered window may have (the high end of each, see [`Cost`]).
    /// Consecutive windows are pooled until they hold as many answers as a window now needs
    /// ([`answers_needed`]): windows closed before the spread was known may be too short
    /// for their error to be trusted.
    fn floor_secs(&self) -> Option<f64> {
        let k = self.fixed_tokens();
        let needed = answers_needed(self.spread, self.config.tolerance) as f64;
        let mut floor: Option<f64> = None;
        let mut pooled = Sums::default();
        for (i, w) in self.floors.iter().enumerate() {
            pooled.merge(w);
            if pooled.count >= needed || i + 1 == self.floors.len() {
                let high = self.cost(&pooled, k).high();
                floor = Some(floor.map_or(high, |f| f.min(high)));
                pooled = Sums::default();
            }
        }
        floor
    }

    /// The fixed cost of an answer in tokens, with `per_work`.
    fn fixed_tokens(&self) -> Option<f64> {
        self.work.as_ref().map(WorkModel::fixed_tokens)
    }

    /// A window's latency per answer, or with `per_work` (`k` known) per unit of work: one
    /// output token, or the fixed cost of an answer, `k` tokens; with its standard error from
    /// the spread followed across windows (a window's own spread says little when rare long
    /// answers may or may not fall in it).
    fn cost(&self, w: &Sums, k: Option<f64>) -> Cost {
        let work = match k {
            Some(k) => w.tokens + k * w.count,
            None => w.count,
        };
        let mean = w.latency / work;
        Cost {
            mean,
            error: self.spread * mean / w.count.max(1.0).sqrt(),
        }
    }

    /// A 429/5xx met by a request sent at `epoch` with `in_flight` requests out.
    pub fn on_overload(&mut self, in_flight: usize, epoch: u64) -> Option<Change> {
        self.on_refusal(in_flight, in_flight, epoch)
    }

    /// A 429/5xx met by a request sent at `epoch` with `sent_with` requests out, which saw
    /// at most `met` out until its answer (requests sent after it may have reached the
    /// gateway first). The first of an episode cuts below the larger of the two; each later
    /// refusal of the episode just cut for lowers the limit below its own `met`, without a
    /// new episode: an overshoot's refusals come back one after another, each counting those
    /// of the burst still out and the admitted ones, so the last says best where the gateway
    /// ends. Not below its `sent_with`: a burst sent at once over new connections reaches the
    /// gateway in any order (one sent with 8 out came after 16 others were admitted).
    pub fn on_refusal(&mut self, sent_with: usize, met: usize, epoch: u64) -> Option<Change> {
        if epoch.saturating_add(1) == self.epoch {
            let met = if met == 0 { sent_with } else { met };
            if met >= self.refused_at {
                return None;
            }
            self.refused_at = met.max(1);
            let to = self.limit.min(met.saturating_sub(1)).max(self.config.min);
            return self.set(to);
        }
        let met = met.max(sent_with);
        if epoch != self.epoch {
            return None;
        }
        let in_flight = met;
        self.epoch += 1;
        self.slow_start = false;
        self.slow_start_cap = None;
        self.step = self.config.initial_step;
        self.calm_windows = 0;
        self.queued_windows = 0;
        self.refused_at = in_flight.max(1);
        self.probe = None;
        // Latencies gathered across the cut describe neither limit.
        self.window = Window::default();
        let from = self.limit;
        let to = from
            .saturating_sub(1)
            .min(in_flight.saturating_sub(1))
            .max(self.config.min);
        self.set(to)
    }

    /// A successful answer that took `latency`, sent with `in_flight` requests out.
    pub fn on_success(&mut self, latency: Duration, in_flight: usize) -> Option<Change> {
        self.on_answer(latency, None, in_flight)
    }

    /// A successful answer of `tokens` output tokens (its `usage.completion_tokens`, when
    /// known) that took `latency`, sent with `in_flight` requests out.
    ///
    /// The answer joins the current window; when the window closes, it is read against the
    /// floor, and the limit follows what it says: back from a probe, shrink on queueing,
    /// probe for a stale floor, or grow.
    pub fn on_answer(
        &mut self,
        latency: Duration,
        tokens: Option<u64>,
        in_flight: usize,
    ) -> Option<Change> {
        if self.probe.is_some() && in_flight > self.limit {
            // Sent before the probe's cut: it queued behind the old limit.
            return None;
        }
        let window = self.note_answer(latency, tokens, in_flight)?;
        let reading = self.read_window(&window);
        if reading.queued
            && self.queued_windows < self.config.confirm_windows
            && self.probe.is_none()
        {
            // Not confirmed yet: one window slowed by a scheduling hiccup is not queueing.
            return None;
        }
        if let Some(before) = self.probe.take() {
            if !reading.queued {
                // The floor was seen again: back to where the probe started.
                return self.set(before);
            }
        }
        if !reading.queued && window.max_in_flight >= self.limit {
            self.proven = self.proven.max(self.limit);
        }
        if reading.queued {
            return self.shrink(&reading);
        }
        if let Some(change) = self.start_probe(&reading) {
            return Some(change);
        }
        self.grow(&window, &reading)
    }

    /// Adds an answer to the current window (and, with `per_work`, to the fit of latency
    /// against length); the window, once it holds enough answers to close.
    fn note_answer(
        &mut self,
        latency: Duration,
        tokens: Option<u64>,
        in_flight: usize,
    ) -> Option<Window> {
        let latency = latency.as_secs_f64();
        let tokens = match (&mut self.work, tokens) {
            (Some(work), Some(t)) => {
                work.add(t as f64, latency);
                t as f64
            }
            // An answer without usage counts as one of the mean length.
            (Some(work), None) => work.mean_tokens(),
            (None, _) => 0.0,
        };
        let work = self.fixed_tokens().map_or(1.0, |k| tokens + k);
        self.window.add(latency, tokens, in_flight, latency / work);
        if self.window.count < self.window_size() {
            return None;
        }
        Some(std::mem::take(&mut self.window))
    }

    /// Remembers a closed window for the floor and the spread, reads its cost against the
    /// floor, and counts it among the calm, off-floor and queued windows.
    fn read_window(&mut self, window: &Window) -> Reading {
        if self.floors.len() == self.config.floor_windows {
            self.floors.pop_front();
        }
        self.floors.push_back(window.sums);
        // From here on, "mean" is the low end of the window's cost (per answer, or per unit
        // of work): the part of it that the spread of the requests' own costs cannot explain.
        let k = self.fixed_tokens();
        // Followed as a variance, so that the windows a rare long answer fell in weigh as
        // much as it does.
        let spread = window.spread.own_spread();
        self.spread = if self.floors.len() == 1 {
            spread
        } else {
            (self.spread.powi(2) * (1.0 - SPREAD_WEIGHT) + spread.powi(2) * SPREAD_WEIGHT).sqrt()
        };
        let cost = self.cost(&window.sums, k);
        let floor = self.floor_secs().unwrap_or(cost.mean);
        let mean = cost.low().max(f64::MIN_POSITIVE);
        let mean_in_flight = window.spread.in_flight / window.count as f64;
        self.calm_windows += 1;
        let near_floor = mean <= floor * (1.0 + (self.config.tolerance - 1.0) / 4.0);
        self.windows_off_floor = if near_floor {
            0
        } else {
            self.windows_off_floor + 1
        };
        let queued = mean > floor * self.config.tolerance;
        self.queued_windows = if queued { self.queued_windows + 1 } else { 0 };
        Reading {
            floor,
            mean,
            mean_in_flight,
            near_floor,
            queued,
        }
    }

    /// A queued window: the limit moves toward what the gateway serves at the floor latency,
    /// by `smoothing`, and slow start and the step end.
    fn shrink(&mut self, reading: &Reading) -> Option<Change> {
        self.slow_start = false;
        self.slow_start_cap = None;
        self.step = self.config.initial_step;
        let s = self.config.smoothing;
        let target = (self.limit as f64 * (1.0 - s) + reading.serves() * s).round();
        let to = (target.max(0.0) as usize).max(self.config.min);
        if to < self.limit {
            self.set(to)
        } else {
            None
        }
    }

    /// After `probe_windows` windows off the floor (outside slow start), drops the limit for
    /// one window to 0.9 × what the gateway serves at the floor, to see the floor again.
    fn start_probe(&mut self, reading: &Reading) -> Option<Change> {
        if self.windows_off_floor < self.config.probe_windows || self.slow_start {
            return None;
        }
        self.windows_off_floor = 0;
        let to = ((reading.serves() * 0.9).floor() as usize).max(self.config.min);
        if to >= self.limit {
            return None;
        }
        self.probe = Some(self.limit);
        self.set(to)
    }

    /// A calm window that used the limit: grows it by slow start or by the step, held below
    /// the concurrency last refused until `hold_windows` calm windows have passed.
    fn grow(&mut self, window: &Window, reading: &Reading) -> Option<Change> {
        if window.max_in_flight * 2 < self.limit {
            // Not limited by the limit: growing it would test nothing.
            return None;
        }
        if !self.slow_start
            && reading.near_floor
            && self.refused_at != usize::MAX
            && self.limit >= self.refused_at.saturating_add(self.refused_at / 4)
        {
            // The refusal is stale: the gateway grew. Slow start again, up to what a calm
            // window has used in full.
            self.slow_start = true;
            self.slow_start_cap = (self.proven > self.limit).then_some(self.proven);
        }
        let passing = self.limit.saturating_add(1) >= self.refused_at;
        if passing && self.calm_windows <= self.config.hold_windows {
            return None;
        }
        if passing && self.limit < self.refused_at {
            // The first step past the refused concurrency is the smallest.
            self.step = self.config.initial_step;
        }
        let mut to = if self.slow_start {
            self.slow_start_step(window.count)
        } else {
            self.limit.saturating_add(self.step)
        };
        if !passing {
            to = to.min(self.refused_at - 1);
        }
        if !self.slow_start && reading.mean > reading.floor * (1.0 + self.config.tolerance) / 2.0 {
            // Latency is already rising within the tolerance: grow at most to what that
            // queueing says the gateway serves, times the tolerance.
            let cap = (reading.serves() * self.config.tolerance).floor() as usize;
            to = to.min(cap.max(self.limit));
        }
        to = to.min(self.config.max);
        self.step = self
            .step
            .saturating_mul(2)
            .min((to / 4).max(self.config.initial_step));
        self.set(to)
    }

    /// The limit slow start grows to after a window of `answers`; it ends at its cap.
    fn slow_start_step(&mut self, answers: usize) -> usize {
        // Doubling per round trip, as TCP's slow start: a window longer than the limit
        // spans several.
        let rounds = answers as f64 / self.limit.max(1) as f64;
        let factor = 2f64.powf(rounds.clamp(1.0, SLOW_START_ROUNDS));
        let grown = (self.limit as f64 * factor).floor() as usize;
        match self.slow_start_cap {
            Some(cap) if grown >= cap => {
                // Back where the gateway served before: past it only step by step, after
                // calm windows, as past a refusal.
                self.slow_start = false;
                self.slow_start_cap = None;
                self.refused_at = cap.saturating_add(1);
                self.calm_windows = 0;
                self.step = self.config.initial_step;
                cap
            }
            _ => grown,
        }
    }

    /// Successes that close the current window.
    fn window_size(&self) -> usize {
        // Per unit of work a window of a few answers says little: one short answer of a
        // misjudged fixed cost would set the floor. So no shorter windows in slow start.
        let size = if self.slow_start && !self.config.per_work {
            self.limit
        } else {
            self.limit.max(self.config.min_window)
        };
        size.max(answers_needed(self.spread, self.config.tolerance))
    }

    fn set(&mut self, to: usize) -> Option<Change> {
        let from = self.limit;
        self.limit = to;
        match to.cmp(&from) {
            std::cmp::Ordering::Greater => Some(Change::Increased { from, to }),
            std::cmp::Ordering::Less => Some(Change::Decreased { from, to }),
            std::cmp::Ordering::Equal => None,
        }
    }
}

impl Limiter for GradientLimiter {
    fn limit(&self) -> usize {
        self.limit
    }

    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn on_result(&mut self, sample: Sample) -> Option<Change> {
        if sample.overloaded {
            self.on_refusal(sample.in_flight, sample.in_flight_at_answer, sample.epoch)
        } else {
            self.on_answer(sample.latency, sample.tokens, sample.in_flight)
        }
    }

    fn algorithm(&self) -> Algorithm {
        if self.config.per_work {
            Algorithm::Work
        } else {
            Algorithm::Gradient
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const L: Duration = Duration::from_millis(20);

    /// A limiter starting at `max`.
    fn limiter(min: usize, max: usize) -> GradientLimiter {
        GradientLimiter::new(GradientConfig {
            min,
            max,
            initial: max,
            ..GradientConfig::default()
        })
        .unwrap()
    }

    /// One window at the current limit, every request taking `latency`.
    fn window(l: &mut GradientLimiter, latency: Duration) {
        let n = l.window_size();
        let in_flight = l.limit();
        for _ in 0..n {
            l.on_success(latency, in_flight);
        }
    }

    fn close(a: Option<Duration>, b: Duration) -> bool {
        a.is_some_and(|a| a.abs_diff(b) < Duration::from_micros(1))
    }

    #[test]
    fn an_overload_cuts_to_the_refused_concurrency_once_per_episode() {
        let mut l = limiter(2, 128);
        let sent = l.epoch();
        assert_eq!(
            l.on_overload(65, sent),
            Some(Change::Decreased { from: 128, to: 64 })
        );
        for k in 66..128 {
            assert_eq!(l.on_overload(k, sent), None, "same episode");
        }
        assert_eq!(l.limit(), 64);
        // A later episode at a higher count still cuts by one at least.
        assert_eq!(
            l.on_overload(100, l.epoch()),
            Some(Change::Decreased { from: 64, to: 63 })
        );
        // And never below the floor.
        assert_eq!(
            l.on_overload(1, l.epoch()),
            Some(Change::Decreased { from: 63, to: 2 })
        );
        assert_eq!(l.on_overload(1, l.epoch()), None);
        assert_eq!(l.limit(), 2);
    }

    #[test]
    fn slow_start_doubles_until_the_first_decrease() {
        let mut l = GradientLimiter::new(GradientConfig {
            min: 2,
            max: 1000,
            initial: 2,
            ..GradientConfig::default()
        })
        .unwrap();
        let mut trace = vec![l.limit()];
        for _ in 0..5 {
            window(&mut l, L);
            trace.push(l.limit());
        }
        assert_eq!(trace, vec![2, 4, 8, 16, 32, 64]);
        l.on_overload(60, l.epoch());
        window(&mut l, L);
        window(&mut l, L);
        assert_eq!(l.limit(), 59, "held below the refused 60, no more doubling");
    }

    #[test]
    fn growth_doubles_its_step_and_stops_short_of_the_refused_concurrency() {
        let mut l = limiter(1, 1000);
        l.on_overload(41, l.epoch()); // 40, refused at 41
        window(&mut l, L); // the floor: 20 ms
                           // 40 in flight take 80 ms: the gateway serves 10 at the floor latency.
        for _ in 0..40 {
            l.on_success(4 * L, 40);
        }
        let mut trace = vec![l.limit()];
        for _ in 0..6 {
            window(&mut l, L);
            trace.push(l.limit());
        }
        // +1, +2, +4, +8 (capped at a quarter), held at 40 below 41, then past it.
        assert_eq!(trace, vec![10, 11, 13, 16, 20, 25, 31]);
    }

    #[test]
    fn a_quarter_past_a_stale_refusal_it_doubles_again() {
        // The gateway went from 16 back to 64: calm past the refused 17, then doubling.
        let mut l = limiter(1, 1000);
        l.on_overload(17, l.epoch());
        let mut trace = vec![l.limit()];
        for _ in 0..8 {
            window(&mut l, L);
            trace.push(l.limit());
        }
        assert_eq!(trace, vec![16, 16, 16, 16, 17, 19, 23, 46, 92]);
        // Against the hard 64 it overshot to, one cut and it holds there.
        let settled = hard_limit_loop(&mut l, 64, 100);
        assert_eq!(settled[0].0, 64);
        assert!(
            settled.iter().all(|&(x, _)| (57..=65).contains(&x)),
            "{settled:?}"
        );
        let refused: usize = settled[1..].iter().map(|t| t.1).sum();
        assert!(refused < 50, "{refused} refusals after the cut");
    }

    #[test]
    fn a_restarted_slow_start_stops_where_the_gateway_served_before() {
        // 64 used in full, then the gateway went to 16 and back: doubling from 23 stops at 64.
        let mut l = limiter(1, 1000);
        l.on_overload(65, l.epoch());
        window(&mut l, L);
        l.on_overload(17, l.epoch());
        let mut trace = vec![l.limit()];
        for _ in 0..12 {
            window(&mut l, L);
            trace.push(l.limit());
        }
        assert_eq!(
            trace,
            vec![16, 16, 16, 16, 17, 19, 23, 46, 64, 64, 64, 64, 65]
        );
        // A limit never used in full proves nothing: a quiet window at 64 leaves it unproven.
        let mut l = limiter(1, 1000);
        l.on_overload(65, l.epoch());
        for _ in 0..l.window_size() {
            l.on_success(L, 10);
        }
        l.on_overload(17, l.epoch());
        for _ in 0..8 {
            window(&mut l, L);
        }
        assert_eq!(l.limit(), 92);
    }

    #[test]
    fn passing_the_refused_concurrency_waits_for_calm_windows() {
        let mut l = limiter(1, 1000);
        l.on_overload(11, l.epoch()); // 10
        let mut trace = vec![l.limit()];
        for _ in 0..6 {
            window(&mut l, L);
            trace.push(l.limit());
        }
        // Past it by a quarter (13 of 11), the old refusal is stale: slow start, doubling per
        // round trip (a window of 16 answers at 13 is about 1.2 of them).
        assert_eq!(trace, vec![10, 10, 10, 10, 11, 13, 30]);
    }

    #[test]
    fn a_slow_start_window_of_several_round_trips_grows_as_many_times() {
        // Per unit of work a window is at least 16 answers: at 5 that is three round trips
        // and more, so the limit grows eight times (the most), then twice per window of 40.
        let mut l = GradientLimiter::new(GradientConfig {
            min: 5,
            max: 1000,
            initial: 5,
            per_work: true,
            ..GradientConfig::default()
        })
        .unwrap();
        let mut trace = vec![l.limit()];
        for _ in 0..2 {
            window(&mut l, L);
            trace.push(l.limit());
        }
        assert_eq!(trace, vec![5, 40, 80]);
    }

    #[test]
    fn queueing_latency_moves_the_limit_to_what_the_floor_latency_serves() {
        let mut l = limiter(1, 100);
        window(&mut l, L); // floor 20 ms at 100 in flight
        assert!(close(l.floor(), L));
        // 100 in flight now take 40 ms: the gateway serves 50 at the floor latency.
        for _ in 0..100 {
            l.on_success(2 * L, 100);
        }
        assert_eq!(l.limit(), 50);

        let mut smooth = GradientLimiter::new(GradientConfig {
            max: 100,
            initial: 100,
            smoothing: 0.5,
            ..GradientConfig::default()
        })
        .unwrap();
        window(&mut smooth, L);
        for _ in 0..100 {
            smooth.on_success(2 * L, 100);
        }
        assert_eq!(smooth.limit(), 75, "halfway from 100 to 50");
    }

    #[test]
    fn with_confirm_windows_one_slow_window_is_not_queueing() {
        let mut l = GradientLimiter::new(GradientConfig {
            max: 100,
            initial: 100,
            confirm_windows: 2,
            ..GradientConfig::default()
        })
        .unwrap();
        window(&mut l, L);
        window(&mut l, 2 * L);
        assert_eq!(l.limit(), 100, "one window at twice the floor: a hiccup");
        window(&mut l, L);
        window(&mut l, 2 * L);
        assert_eq!(l.limit(), 100, "the run restarted");
        for _ in 0..100 {
            l.on_success(2 * L, 100);
        }
        assert_eq!(l.limit(), 50, "two in a row: queueing");
    }

    /// At 100 out of slow start (refused at 101, at max), probing after 3 windows off the floor.
    fn probing() -> GradientLimiter {
        let mut l = GradientLimiter::new(GradientConfig {
            max: 100,
            initial: 100,
            probe_windows: 3,
            ..GradientConfig::default()
        })
        .unwrap();
        l.on_overload(101, 0);
        l
    }

    #[test]
    fn a_probe_drops_for_one_window_ignores_older_answers_and_goes_back() {
        let mut l = probing();
        window(&mut l, L);
        // Within the tolerance but off the floor: the third such window probes.
        let off = L.mul_f64(1.2);
        window(&mut l, off);
        window(&mut l, off);
        assert_eq!(l.limit(), 100);
        window(&mut l, off);
        assert_eq!(l.limit(), 75, "0.9 × the 100 × 20 / 24 served at the floor");
        // Answers sent with 100 in flight predate the probe and are left out.
        for _ in 0..200 {
            assert_eq!(l.on_success(3 * L, 100), None);
        }
        window(&mut l, L);
        assert_eq!(l.limit(), 100, "the floor was seen again: back");
    }

    #[test]
    fn a_gateway_answering_at_its_floor_is_not_probed() {
        let mut l = probing();
        for k in 0..50 {
            // Noise within a quarter of the tolerance is still the floor.
            window(&mut l, L.mul_f64(1.0 + (k % 3) as f64 * 0.03));
            assert_eq!(l.limit(), 100, "window {k}");
        }
    }

    #[test]
    fn latency_within_the_tolerance_is_not_queueing() {
        let mut l = limiter(1, 100);
        l.on_overload(51, 0);
        window(&mut l, L);
        let before = l.limit();
        window(&mut l, L.mul_f64(1.25));
        assert!(l.limit() >= before);
    }

    #[test]
    fn an_unused_limit_does_not_grow() {
        let mut l = limiter(1, 100);
        l.on_overload(21, 0); // 20
        for _ in 0..100 {
            l.on_success(L, 5);
        }
        assert_eq!(l.limit(), 20);
    }

    #[test]
    fn stale_overloads_are_ignored() {
        let mut l = limiter(1, 100);
        l.on_overload(51, 0);
        assert_eq!(l.limit(), 50);
        l.on_overload(41, l.epoch());
        assert_eq!(l.limit(), 40);
        // Of an older episode than the last: ignored, whatever it refused.
        assert_eq!(l.on_overload(10, 0), None);
        assert_eq!(l.limit(), 40);
    }

    #[test]
    fn an_overshoot_is_cut_to_what_its_burst_left_the_gateway_holding() {
        // Slow start doubled to 40 past a gateway of 16: 24 of the burst are refused, and
        // their answers come back one after another, each counting those still out.
        let mut l = limiter(1, 64);
        l.set(40);
        let sent = l.epoch();
        assert_eq!(
            l.on_refusal(39, 40, sent),
            Some(Change::Decreased { from: 40, to: 39 })
        );
        // Sent in any order: a refusal sent with 8 out came after 16 were admitted. Each
        // counts what is still out when it comes; the limit follows, and not below 16.
        let sent_with = (17..39).chain([8]);
        for (met, sent_with) in (17..40).rev().zip(sent_with) {
            l.on_refusal(sent_with, met, sent);
            assert!(l.limit() >= 16, "{}", l.limit());
        }
        assert_eq!(l.limit(), 16, "40 out, 24 refused");
        assert_eq!(
            l.on_refusal(30, 30, sent),
            None,
            "past the burst's refusals"
        );
        assert_eq!(l.limit(), 16);
        assert_eq!(l.epoch(), sent + 1, "one episode");
        // At a hard limit, a probe's refusals come one after another, each sent with the
        // same count: the limit stays one below it.
        let mut l = limiter(1, 64);
        l.set(65);
        let sent = l.epoch();
        for _ in 0..5 {
            l.on_refusal(65, 66, sent);
        }
        assert_eq!(l.limit(), 64);
    }

    #[test]
    fn a_spread_that_does_not_grow_with_concurrency_is_not_queueing() {
        // Two kinds of request, 20 ms and 400 ms, at the same concurrency: the windows' means
        // vary by a third around 210 ms, and a plain minimum would take most for queueing.
        let mut l = limiter(1, 64);
        l.on_overload(17, 0);
        let mut state = 1u64;
        for _ in 0..20_000 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let ms = if state >> 63 == 0 { 20 } else { 400 };
            l.on_success(Duration::from_millis(ms), l.limit());
        }
        assert!(l.limit() >= 16, "{}", l.limit());
        assert!((0.8..1.0).contains(&l.spread), "{}", l.spread);
        assert!(
            l.window_size() >= 32,
            "measured over longer windows: {}",
            l.window_size()
        );
        // A spread the concurrency explains is queueing's, not the requests' own: it does
        // not widen what counts as noise, nor lengthen the windows.
        let mut l = limiter(1, 64);
        l.on_overload(33, 0);
        for i in 0..2_000u64 {
            let in_flight = 16 + (i % 17) as usize;
            l.on_success(Duration::from_millis(20 * in_flight as u64 / 16), in_flight);
        }
        assert!(l.spread < 0.05, "{}", l.spread);
        assert_eq!(l.window_size(), l.limit().max(16));
    }

    #[test]
    fn the_floor_forgets_old_windows() {
        let mut l = GradientLimiter::new(GradientConfig {
            max: 10,
            initial: 10,
            floor_windows: 3,
            ..GradientConfig::default()
        })
        .unwrap();
        window(&mut l, L);
        for _ in 0..3 {
            window(&mut l, 2 * L);
        }
        assert!(close(l.floor(), 2 * L), "{:?}", l.floor());
    }

    #[test]
    fn invalid_configs_are_refused() {
        let ok = GradientConfig::default();
        for bad in [
            GradientConfig { min: 0, ..ok },
            GradientConfig {
                min: 2,
                max: 1,
                ..ok
            },
            GradientConfig { initial: 0, ..ok },
            GradientConfig {
                initial: 1001,
                ..ok
            },
            GradientConfig {
                initial_step: 0,
                ..ok
            },
            GradientConfig {
                tolerance: 1.0,
                ..ok
            },
            GradientConfig {
                tolerance: f64::NAN,
                ..ok
            },
            GradientConfig {
                smoothing: 0.0,
                ..ok
            },
            GradientConfig {
                floor_windows: 0,
                ..ok
            },
        ] {
            assert!(GradientLimiter::new(bad).is_err(), "{bad:?}");
        }
    }

    /// A closed loop against a hard limit `c`: each round the limit is full and requests
    /// above `c` are refused at once. Returns each round's limit and refusals.
    fn hard_limit_loop(l: &mut GradientLimiter, c: usize, rounds: usize) -> Vec<(usize, usize)> {
        let mut trace = Vec::new();
        for _ in 0..rounds {
            let limit = l.limit();
            let epoch = l.epoch();
            let mut refused = 0;
            for k in 1..=limit {
                if k > c {
                    refused += 1;
                    l.on_overload(k, epoch);
                } else {
                    l.on_success(L, limit.min(c));
                }
            }
            trace.push((l.limit(), refused));
        }
        trace
    }

    #[test]
    fn against_a_hard_limit_it_settles_at_the_limit() {
        let mut l = limiter(1, 128);
        let trace = hard_limit_loop(&mut l, 64, 400);
        let tail = &trace[100..];
        // At 64 or probing one above, but for the one-window floor probes at 0.9 × 64.
        assert!(
            tail.iter().all(|&(x, _)| (57..=65).contains(&x)),
            "{tail:?}"
        );
        let probes = tail.iter().filter(|t| t.0 < 64).count();
        assert!(probes * 20 <= tail.len(), "{probes} probes in {tail:?}");
        let refused: usize = tail.iter().map(|t| t.1).sum();
        assert!(refused * 100 < tail.len() * 64, "{refused} refusals");
    }

    proptest! {
        #[test]
        fn the_limit_stays_within_min_and_max(
            min in 1usize..10,
            extra in 0usize..100,
            events in prop::collection::vec((any::<bool>(), 1u64..100, 0usize..200, 0u64..3), 0..400),
        ) {
            let max = min + extra;
            let mut l = GradientLimiter::new(GradientConfig {
                min,
                max,
                initial: min,
                ..GradientConfig::default()
            })
            .unwrap();
            for (overloaded, ms, in_flight, back) in events {
                let epoch = l.epoch().saturating_sub(back);
                let fresh = epoch == l.epoch();
                let before = l.limit();
                let change = l.on_result(Sample {
                    in_flight_at_answer: 0,
                    latency: Duration::from_millis(ms),
                    overloaded,
                    in_flight,
                    epoch,
                    tokens: None,
                });
                prop_assert!((min..=max).contains(&l.limit()));
                if let Some(c) = change {
                    prop_assert_eq!(c.new_limit(), l.limit());
                }
                if overloaded {
                    prop_assert!(l.limit() <= before, "an overload never raises");
                    if fresh && before > min {
                        prop_assert!(l.limit() < before, "a fresh overload always cuts");
                        prop_assert!(l.limit() <= in_flight.saturating_sub(1).max(min));
                    }
                }
            }
        }

        #[test]
        fn steady_floor_latency_never_lowers_the_limit(
            max in 1usize..200,
            cut in 1usize..200,
            ms in 1u64..100,
            rounds in 1usize..50,
        ) {
            let mut l = GradientLimiter::new(GradientConfig {
                max,
                initial: max,
                probe_windows: 1000,
                ..GradientConfig::default()
            })
            .unwrap();
            l.on_overload(cut, 0);
            let mut last = l.limit();
            for _ in 0..rounds {
                window(&mut l, Duration::from_millis(ms));
                prop_assert!(l.limit() >= last);
                last = l.limit();
            }
        }

        #[test]
        fn a_queueing_gateway_is_filled_but_not_queued_in(c in 4usize..200) {
            // Latency L × max(1, in_flight / c), never a refusal; starting low, the limit
            // ends between c and c × tolerance (plus one step of growth).
            let mut l = GradientLimiter::new(GradientConfig {
                max: 8 * c,
                ..GradientConfig::default()
            })
            .unwrap();
            let queued = |k: usize| L.mul_f64((k as f64 / c as f64).max(1.0));
            for _ in 0..300 {
                let k = l.limit();
                window(&mut l, queued(k));
            }
            let mut seen = Vec::new();
            for _ in 0..100 {
                let k = l.limit();
                window(&mut l, queued(k));
                seen.push(l.limit());
            }
            let hi = (c as f64 * 1.3).ceil() as usize + (c / 4).max(1) + 1;
            let probe_low = (c as f64 * 0.9) as usize - 1;
            prop_assert!(seen.iter().all(|&x| x >= probe_low && x <= hi), "c {}: {:?}", c, seen);
            let below = seen.iter().filter(|&&x| x < c).count();
            prop_assert!(below * 10 <= seen.len(), "c {}: {:?}", c, seen);
        }

        #[test]
        fn against_a_hard_limit_refusals_stay_rare(c in 4usize..200) {
            let mut l = limiter(1, 4 * c);
            let trace = hard_limit_loop(&mut l, c, 400);
            let tail = &trace[200..];
            let probe_low = (c as f64 * 0.9) as usize - 1;
            prop_assert!(tail.iter().all(|&(x, _)| x >= probe_low && x <= c + 1), "c {}: {:?}", c, tail);
            let below = tail.iter().filter(|t| t.0 < c).count();
            prop_assert!(below * 10 <= tail.len(), "c {}: {:?}", c, tail);
            let refused: usize = tail.iter().map(|t| t.1).sum();
            prop_assert!(refused * 3 <= tail.len(), "c {}: {} refusals in {} rounds", c, refused, tail.len());
        }
    }
}
