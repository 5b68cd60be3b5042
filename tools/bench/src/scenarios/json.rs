//! The hand-written JSON passes against serde_json doing the same work on the same text, each
//! piece on its own: what each one buys, in MB/s of text on one core.
//!
//! The text has the shapes of the real thing: chat completions of lognormal length (median
//! about 1 KB, up to tens of KB) whose answers hold newlines, quotes, backslashes and non-ASCII
//! characters as a model writes them, inside the dispatcher's result messages; and input lines
//! of chat requests of the same spread.

use std::borrow::Cow;
use std::hint::black_box;
use std::time::{Duration, Instant};

use batch_producer::JobMessages;
use batch_wire::{json, Outcome, OutputLine, RawResult, ResponseBody, ResultMessage};
use dispatcher_sim::GatewayConfig;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::Ctx;
use crate::report::{Report, Row, Target, Unit};
use crate::stats::Summary;
use crate::BenchError;

const JSON: &str = "JSON";
/// Documents of each corpus.
const DOCUMENTS: usize = 2_000;
/// How long each piece runs for one figure.
const SPAN: Duration = Duration::from_millis(400);
const QUICK_SPAN: Duration = Duration::from_millis(50);

/// What serde reads of a completion to do what [`json::check`] does: the whole document
/// checked, its top-level `usage` located.
#[derive(Deserialize)]
struct UsageView<'a> {
    #[serde(borrow, default)]
    usage: Option<&'a RawValue>,
}

pub(crate) async fn run(cx: Ctx<'_>, report: &mut Report) -> Result<(), BenchError> {
    let Ctx { s, progress, .. } = cx;
    let span = if s.quick { QUICK_SPAN } else { SPAN };
    let runs = s.short_runs.max(1);
    let corpus = Corpus::new(0x15_0a);
    let pieces = pieces(&corpus);
    for piece in &pieces {
        let (mut ours, mut serde) = (Vec::new(), Vec::new());
        for run in 0..runs {
            // Alternated, so that a noisy moment lands on both sides.
            let a = mb_per_s(piece.bytes, span, &piece.ours);
            let b = mb_per_s(piece.bytes, span, &piece.serde);
            progress(&format!(
                "   {} run {run}: {a:.0} MB/s, serde_json {b:.0} MB/s ({:.2}×)",
                piece.name,
                a / b
            ));
            ours.push(a);
            serde.push(b);
        }
        let serde = Summary::new(serde).median();
        report.rows.push(
            Row::new(
                JSON,
                format!("{}: hand-written", piece.name),
                Unit::PerSecond("MB/s"),
                Summary::new(ours),
            )
            .limit("serde_json, same work", serde)
            .target(Target::RatioAtLeast(1.0)),
        );
    }
    report.note(JSON, format!(
        "Each figure is MB of text a second on one core, the median of {runs} runs of {:.1} s each, the hand-written pass and serde_json doing the same work alternated run by run over the same {DOCUMENTS} documents; the limit is serde_json's figure, and the target is to be faster than it (a piece that is not does not earn its code).",
        span.as_secs_f64()
    ));
    report.note(JSON, "The text: chat completions whose answer length is lognormal (median 1 KB, sigma 1, at most 64 KB), the answer written as a model writes (a newline every 40-120 characters, quotes, backslashes, accented letters and emoji); the result messages are the dispatcher's (`{\"id\",\"status_code\",\"payload\"}`, the completion as an escaped string); the input lines are chat requests of the same spread. Pieces: **result message** RawResult::parse against serde deserializing ResultMessage; **completion check** json::check (the document checked, its top-level usage found) against serde deserializing a struct with a borrowed `usage`; **payload string** json::read_string against serde reading the payload as a String; **input line** batch_plan::check_line against the same rules through serde's visitors (check_line_with_serde); **output line** batch_sink::render_into (the completion copied into the line and checked there, its usage read) against the sink's serde way before it (the body read as a RawValue, its usage read, the OutputLine serialised); **request member** JobMessages::member against JobMessages::member_with_serde (the input line read into an InputLine, the envelope built and serialised); **string written** json::write_str against serde_json::to_writer, on the strings an output or error line is written with (request ids, custom ids, now and then an error code and a message with quotes).");
    Ok(())
}

/// One piece: the bytes one pass over its corpus reads, and the two ways of doing it.
struct Piece<'a> {
    name: &'static str,
    bytes: usize,
    ours: Box<dyn Fn() + 'a>,
    serde: Box<dyn Fn() + 'a>,
}

fn pieces(c: &Corpus) -> Vec<Piece<'_>> {
    let total = |docs: &[String]| docs.iter().map(String::len).sum();
    vec![
        Piece {
            name: "result message",
            bytes: total(&c.messages),
            ours: Box::new(|| {
                for m in &c.messages {
                    black_box(RawResult::parse(m.as_str()).expect("a result"));
                }
            }),
            serde: Box::new(|| {
                for m in &c.messages {
                    black_box(ResultMessage::parse(m).expect("a result"));
                }
            }),
        },
        Piece {
            name: "completion check",
            bytes: total(&c.completions),
            ours: Box::new(|| {
                for d in &c.completions {
                    black_box(json::check(d.as_bytes()).expect("JSON"));
                }
            }),
            serde: Box::new(|| {
                for d in &c.completions {
                    let view: UsageView = serde_json::from_str(d).expect("JSON");
                    black_box(view.usage);
                }
            }),
        },
        Piece {
            name: "payload string",
            bytes: total(&c.quoted),
            ours: Box::new(|| {
                let mut out = Vec::new();
                for q in &c.quoted {
                    out.clear();
                    black_box(json::read_string(q.as_bytes(), 1, &mut out).expect("a string"));
                    black_box(&out);
                }
            }),
            serde: Box::new(|| {
                for q in &c.quoted {
                    black_box(serde_json::from_str::<Cow<str>>(q).expect("a string"));
                }
            }),
        },
        Piece {
            name: "input line",
            bytes: total(&c.lines),
            ours: Box::new(|| {
                for (i, l) in c.lines.iter().enumerate() {
                    black_box(batch_plan::check_line(l, i as u64 + 1).expect("valid"));
                }
            }),
            serde: Box::new(|| {
                for (i, l) in c.lines.iter().enumerate() {
                    black_box(batch_plan::check_line_with_serde(l, i as u64 + 1).expect("valid"));
                }
            }),
        },
        Piece {
            name: "output line",
            bytes: total(&c.completions),
            ours: Box::new(|| {
                let mut out = Vec::new();
                for (d, (id, custom_id)) in c.completions.iter().zip(&c.ids) {
                    out.clear();
                    let body = Outcome::Http {
                        status: 200,
                        body: d,
                    };
                    black_box(batch_sink::render_into(&mut out, id, custom_id, &body));
                    black_box(&out);
                }
            }),
            // As the sink wrote a line before it was written by hand: the body checked and its
            // usage read, then the line serialised around it.
            serde: Box::new(|| {
                for (d, (id, custom_id)) in c.completions.iter().zip(&c.ids) {
                    let body: &RawValue = serde_json::from_str(d).expect("JSON");
                    let view: UsageView = serde_json::from_str(d).expect("JSON");
                    black_box(view.usage);
                    let line = OutputLine {
                        id: id.into(),
                        custom_id: custom_id.into(),
                        response: Some(ResponseBody {
                            status_code: 200,
                            request_id: id.into(),
                            body,
                        }),
                        error: None,
                    };
                    black_box(line.to_json());
                }
            }),
        },
        Piece {
            name: "request member",
            bytes: total(&c.lines),
            ours: Box::new(|| {
                for (i, l) in c.lines.iter().enumerate() {
                    black_box(c.job.member(i as u64, l.as_bytes()).expect("a member"));
                }
            }),
            serde: Box::new(|| {
                for (i, l) in c.lines.iter().enumerate() {
                    let member = c.job.member_with_serde(i as u64, l.as_bytes());
                    black_box(member.expect("a member"));
                }
            }),
        },
        Piece {
            name: "string written",
            bytes: total(&c.fields),
            ours: Box::new(|| {
                let mut out = Vec::new();
                for a in &c.fields {
                    out.clear();
                    json::write_str(&mut out, a);
                    black_box(&out);
                }
            }),
            serde: Box::new(|| {
                let mut out = Vec::new();
                for a in &c.fields {
                    out.clear();
                    serde_json::to_writer(&mut out, a).expect("written");
                    black_box(&out);
                }
            }),
        },
    ]
}

/// MB/s of `f`, which reads `bytes` each call, over at least `span`.
fn mb_per_s(bytes: usize, span: Duration, f: &dyn Fn()) -> f64 {
    f();
    let started = Instant::now();
    let mut calls = 0u64;
    while started.elapsed() < span {
        f();
        calls += 1;
    }
    (bytes as f64 * calls as f64) / started.elapsed().as_secs_f64() / 1e6
}

/// The texts of every piece, drawn once from a seed.
struct Corpus {
    /// Chat completions carrying those answers.
    completions: Vec<String>,
    /// The completions as JSON strings (the payload of a result message, quotes included).
    quoted: Vec<String>,
    /// The dispatcher's result messages carrying them.
    messages: Vec<String>,
    /// Input lines asking for answers of the same spread.
    lines: Vec<String>,
    /// The strings an output or error line is written with: request ids, custom ids, and now
    /// and then an error code and message.
    fields: Vec<String>,
    /// The request id and custom id of each completion's output line.
    ids: Vec<(String, String)>,
    /// What the input lines' members share: a job's queues, deadline and headers.
    job: JobMessages,
}

impl Corpus {
    fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let answers: Vec<String> = (0..DOCUMENTS).map(|_| answer(&mut rng)).collect();
        let completions: Vec<String> = answers
            .iter()
            .enumerate()
            .map(|(i, a)| completion(i, a))
            .collect();
        let quoted = completions
            .iter()
            .map(|c| serde_json::to_string(c).expect("a string"))
            .collect();
        let messages = completions
            .iter()
            .enumerate()
            .map(|(i, c)| {
                ResultMessage::http(
                    batch_wire::request_id("batch_json_bench", i as u64),
                    200,
                    c.clone(),
                )
                .to_json()
            })
            .collect();
        let lines = answers
            .iter()
            .enumerate()
            .map(|(i, a)| request_line(i, a))
            .collect();
        let mut fields = Vec::new();
        for i in 0..DOCUMENTS {
            fields.push(format!("batch_req_{:032x}", rng.random::<u128>()));
            fields.push(format!("request-{i:05}-summarize"));
            if i % 10 == 0 {
                fields.push("rate_limit_exceeded".into());
                fields.push(format!(
                    "The gateway said \"slow down\" after {i} requests.\n"
                ));
            }
        }
        let ids = (0..DOCUMENTS)
            .map(|i| {
                let id = batch_wire::request_id("batch_json_bench", i as u64);
                (id, format!("req-{i}"))
            })
            .collect();
        let job = JobMessages {
            job_id: "batch_json_bench".into(),
            created: 1_767_225_600,
            deadline: 1_767_225_600 + 86_400,
            request_queue: "llm-d-async:requests:pool-a".into(),
            result_queue: "llm-d-async:results:pool-a:$batch".into(),
            headers: [(
                "x-gateway-inference-objective".to_owned(),
                "batch".to_owned(),
            )]
            .into(),
        };
        Self {
            completions,
            quoted,
            messages,
            lines,
            fields,
            ids,
            job,
        }
    }
}

const WORDS: [&str; 16] = [
    "the", "model", "answers", "batch", "request", "token", "with", "and", "of", "a", "to",
    "which", "latency", "queue", "result", "line",
];
const ODD: [&str; 8] = ["\"", "\\", "é", "ü", "—", "😀", "→", "\t"];

/// An answer of lognormal length, written with what a model writes besides words.
fn answer(rng: &mut StdRng) -> String {
    // The gateway simulator's own draw of answer lengths, in bytes here.
    let lengths = GatewayConfig {
        length_median: Some(1000),
        length_sigma: 1.0,
        ..GatewayConfig::default()
    };
    let len = (lengths.answer_tokens(0, rng) as usize).clamp(20, 65_536);
    let mut out = String::with_capacity(len + 16);
    let mut next_line = rng.random_range(40..120);
    while out.len() < len {
        if rng.random_ratio(1, 25) {
            out.push_str(ODD[rng.random_range(0..ODD.len())]);
        } else {
            out.push_str(WORDS[rng.random_range(0..WORDS.len())]);
        }
        if out.len() >= next_line {
            out.push('\n');
            next_line = out.len() + rng.random_range(40..120);
        } else {
            out.push(' ');
        }
    }
    out
}

fn completion(i: usize, answer: &str) -> String {
    serde_json::json!({
        "id": format!("chatcmpl-{i}"),
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": crate::inputs::MODEL,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": answer},
            "finish_reason": "stop"
        }],
        "usage": {"prompt_tokens": 512, "completion_tokens": answer.len() / 4, "total_tokens": 512 + answer.len() / 4}
    })
    .to_string()
}

fn request_line(i: usize, prompt: &str) -> String {
    serde_json::json!({
        "custom_id": format!("req-{i}"),
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": crate::inputs::MODEL,
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": prompt}
            ],
            "max_tokens": 256
        }
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both sides of every piece take every document of the corpus (a piece that failed on
    /// some would measure an early exit), and the corpus has the odd characters it claims.
    #[test]
    fn every_piece_reads_the_whole_corpus_both_ways() {
        let corpus = Corpus::new(7);
        for piece in pieces(&corpus) {
            (piece.ours)();
            (piece.serde)();
            assert!(piece.bytes > DOCUMENTS * 40, "{}", piece.name);
        }
        // As JSON text: escaped newlines, quotes and backslashes, and raw non-ASCII.
        let all: String = corpus.completions.concat();
        for odd in [r"\n", r#"\""#, r"\\", "😀"] {
            assert!(all.contains(odd), "{odd:?}");
        }
        let lens: Vec<usize> = corpus.completions.iter().map(String::len).collect();
        assert!(lens.iter().any(|&n| n < 600) && lens.iter().any(|&n| n > 5_000));
    }
}
