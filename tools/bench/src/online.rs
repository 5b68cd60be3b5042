//! An open-loop online load generator: streamed chat requests sent at Poisson arrival times
//! (steady, or in waves of bursts and quiet periods) whatever the answers do, each timed as a
//! user sees it: time to the first token, the gaps between tokens, time per output token and
//! the whole answer. The `yield` scenario runs it beside a batch; `bench online` runs it by hand
//! against a real stack.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use gateway_sim::http::error_chain;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{json, Value};

use crate::BenchError;

/// How the requests arrive: Poisson arrivals at a rate that may change over time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Shape {
    /// This many requests per second on average, all along.
    Steady {
        /// Requests per second.
        rate: f64,
    },
    /// `burst` requests per second for `wave`, then `quiet` for as long, and again.
    Waves {
        /// Requests per second in a burst.
        burst: f64,
        /// Requests per second between bursts.
        quiet: f64,
        /// How long each burst and each quiet period lasts.
        #[serde(serialize_with = "seconds")]
        wave: Duration,
    },
}

/// Which part of a [`Shape`] a request was sent in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The whole of a steady run.
    Steady,
    /// A burst of a run in waves.
    Burst,
    /// A quiet period of a run in waves.
    Quiet,
}

impl Phase {
    /// How the report names it.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Steady => "steady",
            Phase::Burst => "bursts",
            Phase::Quiet => "quiet periods",
        }
    }
}

impl Shape {
    /// The phase at `t` into the run.
    pub fn phase(self, t: Duration) -> Phase {
        match self {
            Shape::Steady { .. } => Phase::Steady,
            Shape::Waves { wave, .. } => {
                let n = (t.as_secs_f64() / wave.as_secs_f64().max(1e-9)) as u64;
                if n.is_multiple_of(2) {
                    Phase::Burst
                } else {
                    Phase::Quiet
                }
            }
        }
    }

    /// Requests per second at `t` into the run.
    pub fn rate(self, t: Duration) -> f64 {
        match self {
            Shape::Steady { rate } => rate,
            Shape::Waves { burst, quiet, .. } => match self.phase(t) {
                Phase::Quiet => quiet,
                _ => burst,
            },
        }
    }

    /// The phases of a run of `duration`, each with the seconds it lasted.
    pub fn phases(self, duration: Duration) -> Vec<(Phase, f64)> {
        let Shape::Waves { wave, .. } = self else {
            return vec![(Phase::Steady, duration.as_secs_f64())];
        };
        let (mut burst, mut quiet, mut at) = (0.0, 0.0, Duration::ZERO);
        while at < duration {
            let span = wave.min(duration - at).as_secs_f64();
            match self.phase(at) {
                Phase::Quiet => quiet += span,
                _ => burst += span,
            }
            at += wave.max(Duration::from_millis(1));
        }
        vec![(Phase::Burst, burst), (Phase::Quiet, quiet)]
    }
}

/// A run of online traffic to make.
#[derive(Debug, Clone)]
pub struct OnlineLoad {
    /// The server, `http://host:port`; requests go to `/v1/chat/completions`.
    pub base_url: String,
    /// The request body ([`chat_body`] makes one), sent as is.
    pub body: Bytes,
    /// How the requests arrive.
    pub shape: Shape,
    /// How long requests are sent for; the run then waits for every answer.
    pub duration: Duration,
    /// Seeds the arrival times, so runs can be repeated.
    pub seed: u64,
    /// A request unanswered this long counts as an error.
    pub timeout: Duration,
    /// Each request's `max_tokens` drawn from these instead of `body`'s; `None`: `body` as is.
    pub lengths: Option<Lengths>,
}

/// Answer lengths that vary as LLM answers' do: each request's `max_tokens` drawn from a
/// lognormal of this median and sigma (of ln tokens), at least 1. With `ignore_eos` the server
/// answers exactly that many, so a real server's answers have the spread the `yield` scenario
/// gives its simulated server's (median 200, σ 0.7), and runs can be compared with it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Lengths {
    /// The median, in tokens.
    pub median: f64,
    /// The standard deviation of ln(tokens).
    pub sigma: f64,
}

impl Lengths {
    /// One length, drawn with `rng`.
    pub fn draw(self, rng: &mut impl Rng) -> u64 {
        let z = gateway_sim::standard_normal(rng);
        ((self.median * (self.sigma * z).exp()).round() as u64).max(1)
    }
}

/// `body` (a JSON object) with its `max_tokens` set to `tokens`.
fn with_max_tokens(body: &Value, tokens: u64) -> Bytes {
    let mut body = body.clone();
    body["max_tokens"] = tokens.into();
    Bytes::from(body.to_string())
}

/// A streamed chat request's body for `model`: a short user message, `max_tokens`, with the
/// usage event asked for (so the answer's tokens are counted as the server counts them).
/// `ignore_eos` (vLLM's, and llm-d-inference-sim's) makes every answer exactly `max_tokens`
/// long, so that runs compare answers of one length.
pub fn chat_body(model: &str, max_tokens: u64, ignore_eos: bool) -> Bytes {
    let mut body = json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say something about the weather today."}],
        "max_tokens": max_tokens,
    });
    if ignore_eos {
        body["ignore_eos"] = Value::Bool(true);
    }
    stream_body(body)
}

/// `body` (a chat request's JSON object) asking for a streamed answer with its usage.
pub fn stream_body(mut body: Value) -> Bytes {
    body["stream"] = Value::Bool(true);
    body["stream_options"] = json!({"include_usage": true});
    Bytes::from(body.to_string())
}

/// One request as the client saw it; times in seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// When it was sent, since the run started.
    pub sent: f64,
    /// Why it failed (`HTTP 429`, `timeout`, `no [DONE]`, …); `None` when it was answered with
    /// 200 and read to its end (`[DONE]` when streamed).
    pub failure: Option<String>,
    /// Send to the first event carrying a token; `None` if none came.
    pub ttft: Option<f64>,
    /// The gaps between one token's event and the next.
    pub gaps: Vec<f64>,
    /// Send to the end of the answer.
    pub e2e: f64,
    /// Output tokens: the usage's `completion_tokens`, else the token events counted.
    pub tokens: u64,
}

impl Answer {
    /// Whether it was answered whole.
    pub fn ok(&self) -> bool {
        self.failure.is_none()
    }

    /// Time per output token: `(e2e − TTFT) / (tokens − 1)`, for answers of two tokens or more.
    pub fn tpot(&self) -> Option<f64> {
        let ttft = self.ttft?;
        (self.tokens > 1).then(|| (self.e2e - ttft) / (self.tokens - 1) as f64)
    }
}

/// What a run of online traffic met.
#[derive(Debug, Clone)]
pub struct OnlineRun {
    /// Its shape.
    pub shape: Shape,
    /// How long requests were sent for.
    pub duration: Duration,
    /// Every request, in send order.
    pub answers: Vec<Answer>,
}

/// p50, p95 and p99 of some times, in seconds (NaN without any).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Quantiles {
    /// The median.
    pub p50: f64,
    /// The 95th percentile.
    pub p95: f64,
    /// The 99th percentile.
    pub p99: f64,
}

impl Quantiles {
    /// Of `values` (in any order).
    pub fn of(mut values: Vec<f64>) -> Self {
        values.sort_by(f64::total_cmp);
        Self {
            p50: quantile(&values, 0.5),
            p95: quantile(&values, 0.95),
            p99: quantile(&values, 0.99),
        }
    }
}

/// The `q` quantile of `sorted` (the value below which a share `q` lies); NaN when empty.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]
}

/// The online figures of one phase (the whole of a steady run; the bursts, or the quiet
/// periods, of a run in waves); times in seconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PhaseFigures {
    /// Which phase.
    pub phase: Phase,
    /// How long it lasted, in seconds (all its periods together).
    pub seconds: f64,
    /// Requests sent in it.
    pub sent: usize,
    /// Of those, answered whole with 200.
    pub answered: usize,
    /// Of those, failed (a status other than 200, a broken or unfinished answer, a timeout).
    pub errors: usize,
    /// The failures by why (`HTTP 429`, `timeout`, …).
    pub failures: BTreeMap<String, usize>,
    /// Answers per second: `answered / seconds`.
    pub throughput: f64,
    /// Time to the first token.
    pub ttft: Quantiles,
    /// Inter-token latency: every gap between two tokens' events, all answers pooled.
    pub itl: Quantiles,
    /// Time per output token, per answer.
    pub tpot: Quantiles,
    /// End-to-end latency.
    pub e2e: Quantiles,
}

impl OnlineRun {
    /// The figures of each phase, in the order of [`Shape::phases`].
    pub fn figures(&self) -> Vec<PhaseFigures> {
        self.shape
            .phases(self.duration)
            .into_iter()
            .map(|(phase, seconds)| {
                let sent: Vec<&Answer> = self
                    .answers
                    .iter()
                    .filter(|a| self.shape.phase(Duration::from_secs_f64(a.sent)) == phase)
                    .collect();
                let ok: Vec<&Answer> = sent.iter().copied().filter(|a| a.ok()).collect();
                let mut failures = BTreeMap::new();
                for why in sent.iter().filter_map(|a| a.failure.as_ref()) {
                    *failures.entry(why.clone()).or_insert(0) += 1;
                }
                PhaseFigures {
                    phase,
                    seconds,
                    sent: sent.len(),
                    answered: ok.len(),
                    errors: sent.len() - ok.len(),
                    failures,
                    throughput: ok.len() as f64 / seconds.max(1e-9),
                    ttft: Quantiles::of(ok.iter().filter_map(|a| a.ttft).collect()),
                    itl: Quantiles::of(ok.iter().flat_map(|a| a.gaps.iter().copied()).collect()),
                    tpot: Quantiles::of(ok.iter().filter_map(|a| a.tpot()).collect()),
                    e2e: Quantiles::of(ok.iter().map(|a| a.e2e).collect()),
                }
            })
            .collect()
    }

    /// The figures of the whole run, every phase together.
    pub fn overall(&self) -> PhaseFigures {
        let whole = OnlineRun {
            shape: Shape::Steady { rate: 0.0 },
            ..self.clone()
        };
        whole.figures().remove(0)
    }

    /// The answers' latency over time: for each `step` of send times, the p95 of the
    /// end-to-end latency and of the time to first token of the answers sent in it (NaN when
    /// none was), at the step's middle.
    pub fn over_time(&self, step: Duration) -> Vec<LatencySample> {
        let step = step.as_secs_f64().max(1e-3);
        let buckets = (self.duration.as_secs_f64() / step).ceil() as usize;
        (0..buckets)
            .map(|i| {
                let (from, to) = (i as f64 * step, (i + 1) as f64 * step);
                let ok = || {
                    self.answers
                        .iter()
                        .filter(move |a| a.ok() && a.sent >= from && a.sent < to)
                };
                LatencySample {
                    t: from + step / 2.0,
                    e2e_p95: Quantiles::of(ok().map(|a| a.e2e).collect()).p95,
                    ttft_p95: Quantiles::of(ok().filter_map(|a| a.ttft).collect()).p95,
                }
            })
            .collect()
    }
}

impl PhaseFigures {
    /// The failures by why, most first: `HTTP 429 ×3, timeout ×1`; empty without any.
    pub fn failures_text(&self) -> String {
        let mut by_count: Vec<(&String, &usize)> = self.failures.iter().collect();
        by_count.sort_by(|a, b| b.1.cmp(a.1));
        let parts: Vec<String> = by_count
            .iter()
            .map(|(why, n)| format!("{why} ×{n}"))
            .collect();
        parts.join(", ")
    }
}

/// The online latency of the requests sent in one step of time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencySample {
    /// The step's middle, in seconds since the run started.
    pub t: f64,
    /// p95 of their end-to-end latency, in seconds.
    pub e2e_p95: f64,
    /// p95 of their time to first token, in seconds.
    pub ttft_p95: f64,
}

/// Sends the traffic of `load` and waits for every answer.
pub async fn run(load: &OnlineLoad) -> Result<OnlineRun, BenchError> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(connector);
    let url: hyper::Uri = format!(
        "{}/v1/chat/completions",
        load.base_url.trim_end_matches('/')
    )
    .parse()
    .map_err(|e| BenchError::Check(format!("the URL {}: {e}", load.base_url)))?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(load.seed);
    // The lengths from a generator of their own, so that a seed sends at the same times with
    // lengths drawn or not.
    let mut lengths_rng = rand::rngs::StdRng::seed_from_u64(load.seed ^ 0x1e45_7e45);
    let template: Option<Value> = match load.lengths {
        Some(_) => Some(
            serde_json::from_slice(&load.body)
                .map_err(|e| BenchError::Check(format!("the request body: {e}")))?,
        ),
        None => None,
    };
    let mut calls = tokio::task::JoinSet::new();
    let started = Instant::now();
    let mut at = Duration::ZERO;
    while at < load.duration {
        tokio::time::sleep_until((started + at).into()).await;
        let body = match (load.lengths, &template) {
            (Some(lengths), Some(template)) => {
                with_max_tokens(template, lengths.draw(&mut lengths_rng))
            }
            _ => load.body.clone(),
        };
        let (client, url, timeout) = (client.clone(), url.clone(), load.timeout);
        let sent = started.elapsed().as_secs_f64();
        calls.spawn(async move {
            let since = Instant::now();
            let failed = |why: String| Answer {
                sent,
                failure: Some(why),
                ttft: None,
                gaps: Vec::new(),
                e2e: since.elapsed().as_secs_f64(),
                tokens: 0,
            };
            match tokio::time::timeout(timeout, exchange(&client, url, body, since)).await {
                Ok(Ok(answer)) => Answer { sent, ..answer },
                Ok(Err(why)) => failed(why),
                Err(_) => failed("timeout".into()),
            }
        });
        let rate = load.shape.rate(at).max(1e-3);
        at += Duration::from_secs_f64(-(1.0 - rng.random::<f64>()).ln() / rate);
    }
    let mut answers = Vec::new();
    while let Some(call) = calls.join_next().await {
        answers.push(call.map_err(|e| BenchError::Check(format!("an online request: {e}")))?);
    }
    answers.sort_by(|a, b| a.sent.total_cmp(&b.sent));
    Ok(OnlineRun {
        shape: load.shape,
        duration: load.duration,
        answers,
    })
}

/// One request, read as it streams; why it failed when it did before its answer's end.
async fn exchange(
    client: &Client<HttpConnector, Full<Bytes>>,
    url: hyper::Uri,
    body: Bytes,
    since: Instant,
) -> Result<Answer, String> {
    let req = Request::post(url)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| error_chain(&e))?;
    let status = resp.status();
    let mut body = resp.into_body();
    let mut events = Events::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("reading the answer: {}", error_chain(&e)))?;
        if let Ok(data) = frame.into_data() {
            events.push(&data, since.elapsed().as_secs_f64());
        }
    }
    Ok(events.answer(status, since.elapsed().as_secs_f64()))
}

/// A streamed answer's server-sent events as they come.
#[derive(Debug, Default)]
struct Events {
    /// Bytes of an event not yet complete (or the whole body of an answer not streamed).
    pending: Vec<u8>,
    /// When each event carrying a token came.
    tokens: Vec<f64>,
    /// The usage's `completion_tokens`, when an event carried it.
    usage: Option<u64>,
    done: bool,
    streamed: bool,
}

impl Events {
    fn push(&mut self, data: &[u8], at: f64) {
        // Events end with a blank line, `\n\n` or `\r\n\r\n` (JSON holds no raw CR).
        self.pending.extend(data.iter().filter(|&&b| b != b'\r'));
        while let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            self.event(&event, at);
        }
    }

    fn event(&mut self, event: &[u8], at: f64) {
        for line in String::from_utf8_lossy(event).lines() {
            let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                continue;
            };
            self.streamed = true;
            if data == "[DONE]" {
                self.done = true;
                continue;
            }
            let Ok(chunk) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if chunk["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                self.tokens.push(at);
            }
            if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
                self.usage = Some(n);
            }
        }
    }

    /// The answer, ended at `e2e` with `status`. An answer not streamed (a server that
    /// ignores `stream`) counts with its usage and no token times.
    fn answer(self, status: StatusCode, e2e: f64) -> Answer {
        let whole = (!self.streamed)
            .then(|| serde_json::from_slice::<Value>(&self.pending).ok())
            .flatten();
        let usage = whole
            .as_ref()
            .and_then(|v| v["usage"]["completion_tokens"].as_u64());
        let failure = if status != StatusCode::OK {
            Some(format!("HTTP {}", status.as_u16()))
        } else if self.streamed && !self.done {
            Some("stream ended without [DONE]".into())
        } else if !self.streamed && whole.is_none() {
            Some("answer neither streamed nor JSON".into())
        } else {
            None
        };
        Answer {
            sent: 0.0,
            failure,
            ttft: self.tokens.first().copied(),
            gaps: self.tokens.windows(2).map(|w| w[1] - w[0]).collect(),
            e2e,
            tokens: self.usage.or(usage).unwrap_or(self.tokens.len() as u64),
        }
    }
}

fn seconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// The columns of [`table`].
const COLUMNS: [&str; 8] = [
    "answers/s",
    "errors",
    "TTFT p50 / p95 / p99 (ms)",
    "ITL p50 / p95 / p99 (ms)",
    "TPOT p50 / p95 / p99 (ms)",
    "e2e p50 / p95 / p99 (ms)",
    "sent",
    "seconds",
];

/// The cells of one line of [`table`].
fn cells(f: &PhaseFigures) -> [String; 8] {
    let q = |q: &Quantiles| format!("{} / {} / {}", ms(q.p50), ms(q.p95), ms(q.p99));
    [
        format!("{:.1}", f.throughput),
        f.errors.to_string(),
        q(&f.ttft),
        q(&f.itl),
        q(&f.tpot),
        q(&f.e2e),
        f.sent.to_string(),
        format!("{:.1}", f.seconds),
    ]
}

/// Seconds as milliseconds, `–` for NaN.
fn ms(seconds: f64) -> String {
    if seconds.is_nan() {
        "–".into()
    } else if seconds < 0.01 {
        format!("{:.1}", seconds * 1e3)
    } else {
        format!("{:.0}", seconds * 1e3)
    }
}

/// A table of online figures, one line per `(what, phase figures)`, times in milliseconds:
/// Markdown with `markdown`, else aligned plain text for a terminal.
pub fn table(lines: &[(String, PhaseFigures)], markdown: bool) -> String {
    let head: Vec<String> = ["run", "phase"]
        .into_iter()
        .chain(COLUMNS)
        .map(String::from)
        .collect();
    let body: Vec<Vec<String>> = lines
        .iter()
        .map(|(what, f)| {
            [what.clone(), f.phase.name().to_owned()]
                .into_iter()
                .chain(cells(f))
                .collect()
        })
        .collect();
    let mut out = String::new();
    if markdown {
        let row = |cells: &[String]| format!("| {} |\n", cells.join(" | ").replace('\n', " "));
        out.push_str(&row(&head));
        out.push_str(&format!("|{}\n", "---|".repeat(head.len())));
        for line in &body {
            out.push_str(&row(line));
        }
        return out;
    }
    let mut widths: Vec<usize> = head.iter().map(|h| h.chars().count()).collect();
    for line in &body {
        for (w, c) in widths.iter_mut().zip(line) {
            *w = (*w).max(c.chars().count());
        }
    }
    for line in std::iter::once(&head).chain(&body) {
        let padded: Vec<String> = line
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c}{}", " ".repeat(w - c.chars().count())))
            .collect();
        out.push_str(padded.join("  ").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waves_alternate_bursts_and_quiet_periods() {
        let shape = Shape::Waves {
            burst: 30.0,
            quiet: 3.0,
            wave: Duration::from_secs(5),
        };
        assert_eq!(shape.rate(Duration::from_secs(1)), 30.0);
        assert_eq!(shape.rate(Duration::from_secs(6)), 3.0);
        assert_eq!(shape.phase(Duration::from_secs(11)), Phase::Burst);
        assert_eq!(
            shape.phases(Duration::from_secs(12)),
            vec![(Phase::Burst, 7.0), (Phase::Quiet, 5.0)]
        );
    }

    #[test]
    fn events_give_token_times_and_the_usage() {
        let mut events = Events::default();
        let chunk = |c: &str| {
            format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{c}\"}}}}]}}\n\n")
        };
        events.push(chunk("a").as_bytes(), 0.1);
        // An event split across two reads counts when it is whole.
        let second = chunk("b");
        events.push(&second.as_bytes()[..10], 0.12);
        events.push(&second.as_bytes()[10..], 0.15);
        events.push(chunk("c").as_bytes(), 0.2);
        let usage =
            "data: {\"choices\":[],\"usage\":{\"completion_tokens\":3}}\n\ndata: [DONE]\n\n";
        events.push(usage.as_bytes(), 0.21);
        let answer = events.answer(StatusCode::OK, 0.25);
        assert!(answer.ok(), "{answer:?}");
        assert_eq!(answer.ttft, Some(0.1));
        assert_eq!(answer.tokens, 3);
        assert_eq!(answer.gaps.len(), 2);
        assert!((answer.gaps[0] - 0.05).abs() < 1e-9);
        assert!((answer.tpot().unwrap() - 0.075).abs() < 1e-9);

        let mut unfinished = Events::default();
        unfinished.push(chunk("a").as_bytes(), 0.1);
        let unfinished = unfinished.answer(StatusCode::OK, 0.2);
        assert_eq!(
            unfinished.failure.as_deref(),
            Some("stream ended without [DONE]")
        );
        let mut refused = Events::default();
        refused.push(br#"{"error":{"message":"full"}}"#, 0.1);
        let refused = refused.answer(StatusCode::TOO_MANY_REQUESTS, 0.1);
        assert_eq!(refused.failure.as_deref(), Some("HTTP 429"));
        // Events ended by CRLF pairs count alike.
        let mut crlf = Events::default();
        crlf.push(chunk("a").replace('\n', "\r\n").as_bytes(), 0.1);
        crlf.push(b"data: [DONE]\r\n\r\n", 0.2);
        let crlf = crlf.answer(StatusCode::OK, 0.2);
        assert!(crlf.ok() && crlf.ttft == Some(0.1), "{crlf:?}");
    }

    #[test]
    fn lengths_spread_around_their_median() {
        let lengths = Lengths {
            median: 200.0,
            sigma: 0.7,
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut drawn: Vec<f64> = (0..4000).map(|_| lengths.draw(&mut rng) as f64).collect();
        drawn.sort_by(f64::total_cmp);
        let median = quantile(&drawn, 0.5);
        assert!((185.0..215.0).contains(&median), "{median}");
        // e^(1.645 × 0.7) ≈ 3.16 times the median at p95.
        let p95 = quantile(&drawn, 0.95);
        assert!((560.0..720.0).contains(&p95), "{p95}");
        let body = with_max_tokens(&json!({"model": "m", "max_tokens": 24}), 7);
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["max_tokens"], 7);
    }

    #[test]
    fn figures_are_per_phase() {
        let answer = |sent: f64, e2e: f64| Answer {
            sent,
            failure: None,
            ttft: Some(e2e / 2.0),
            gaps: vec![0.01],
            e2e,
            tokens: 2,
        };
        let run = OnlineRun {
            shape: Shape::Waves {
                burst: 10.0,
                quiet: 1.0,
                wave: Duration::from_secs(1),
            },
            duration: Duration::from_secs(2),
            answers: vec![answer(0.1, 1.0), answer(0.5, 2.0), answer(1.5, 0.2)],
        };
        let f = run.figures();
        assert_eq!((f[0].phase, f[0].answered), (Phase::Burst, 2));
        assert_eq!((f[1].phase, f[1].answered), (Phase::Quiet, 1));
        assert_eq!(f[0].e2e.p50, 2.0);
        assert_eq!(f[1].tpot.p99, 0.1);
        assert_eq!(run.overall().answered, 3);
        let text = table(&[("alone".into(), f[1].clone())], false);
        assert!(
            text.contains("quiet periods") && text.contains("100 / 100 / 100"),
            "{text}"
        );
        let md = table(&[("alone".into(), f[0].clone())], true);
        assert!(md.starts_with("| run | phase |"), "{md}");
    }
}
