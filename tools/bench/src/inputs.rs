//! Synthetic batch inputs and results of realistic sizes.

use std::io::{BufWriter, Write};
use std::path::Path;

use crate::BenchError;

/// The model every benchmark request names.
pub const MODEL: &str = "bench-model";

/// The inference pool the benchmark model is served by (async mode).
pub const POOL: &str = "bench";

const WORDS: [&str; 16] = [
    "batch",
    "inference",
    "gateway",
    "queue",
    "token",
    "latency",
    "model",
    "prompt",
    "result",
    "sorted",
    "dispatcher",
    "throughput",
    "request",
    "answer",
    "window",
    "summary",
];

/// Words drawn from a fixed list by a small LCG seeded with `seed`, until `len` bytes.
fn filler(seed: u64, len: usize) -> String {
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    let mut out = String::with_capacity(len + 16);
    while out.len() < len {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        out.push_str(WORDS[(state >> 60) as usize]);
        out.push(' ');
    }
    out.truncate(len);
    out
}

/// Input line `index`: a chat request of about `size` bytes (never less than the bare request).
pub fn request_line(index: usize, size: usize) -> String {
    let system = ["You are terse.", "Answer in French."][index % 2];
    let bare = serde_json::json!({
        "custom_id": format!("req-{index}"),
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("question {index}: ")}
            ],
            "max_tokens": 16
        }
    });
    let pad = size.saturating_sub(bare.to_string().len());
    let mut line = bare;
    line["body"]["messages"][1]["content"] =
        format!("question {index}: {}", filler(index as u64, pad)).into();
    line.to_string()
}

/// Writes an input file of `n` chat requests of about `size` bytes each; returns its size.
pub fn write_input(path: &Path, n: usize, size: usize) -> Result<u64, BenchError> {
    let io = |e| BenchError::io(path, e);
    let file = std::fs::File::create(path).map_err(io)?;
    let mut w = BufWriter::new(file);
    let mut bytes = 0u64;
    for i in 0..n {
        let line = request_line(i, size);
        bytes += line.len() as u64 + 1;
        w.write_all(line.as_bytes()).map_err(io)?;
        w.write_all(b"\n").map_err(io)?;
    }
    w.flush().map_err(io)?;
    Ok(bytes)
}

/// Writes `n` chat requests whose sizes vary as prompts do: lognormal, of median `median`
/// bytes and sigma `sigma` of the natural log (seeded, so every run reads the same file), at
/// most 32 times the median. Returns the file's size.
pub fn write_mixed_input(
    path: &Path,
    n: usize,
    median: usize,
    sigma: f64,
) -> Result<u64, BenchError> {
    use rand::SeedableRng;
    let io = |e| BenchError::io(path, e);
    let file = std::fs::File::create(path).map_err(io)?;
    let mut w = BufWriter::new(file);
    let mut rng = rand::rngs::StdRng::seed_from_u64(41);
    let mut bytes = 0u64;
    for i in 0..n {
        let z = gateway_sim::standard_normal(&mut rng);
        let size = (median as f64 * (sigma * z).exp()).min(32.0 * median as f64);
        let line = request_line(i, size as usize);
        bytes += line.len() as u64 + 1;
        w.write_all(line.as_bytes()).map_err(io)?;
        w.write_all(b"\n").map_err(io)?;
    }
    w.flush().map_err(io)?;
    Ok(bytes)
}

/// The system prompt of each line of a prefix-cache input: `n` lines share `prompts` prompts,
/// each prompt on `n / prompts` lines (±1), shuffled through the file by a fixed seed.
pub fn shuffled_prompts(n: usize, prompts: usize) -> Vec<usize> {
    let mut of_line: Vec<usize> = (0..n).map(|i| i % prompts.max(1)).collect();
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in (1..n).rev() {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        of_line.swap(i, ((state >> 33) % (i as u64 + 1)) as usize);
    }
    of_line
}

/// Writes `n` chat requests of about `size` bytes whose system prompts (about 300 bytes each)
/// are `prompts` different ones shuffled through the file, as [`shuffled_prompts`] assigns them.
pub fn write_prefix_input(
    path: &Path,
    n: usize,
    prompts: usize,
    size: usize,
) -> Result<u64, BenchError> {
    let io = |e| BenchError::io(path, e);
    let file = std::fs::File::create(path).map_err(io)?;
    let mut w = BufWriter::new(file);
    let mut bytes = 0u64;
    for (i, k) in shuffled_prompts(n, prompts).into_iter().enumerate() {
        let mut line: serde_json::Value = serde_json::from_str(&request_line(i, size)).unwrap();
        line["body"]["messages"][0]["content"] =
            format!("You are assistant {k}. {}", filler(k as u64 ^ 0xfeed, 280)).into();
        let line = line.to_string();
        bytes += line.len() as u64 + 1;
        w.write_all(line.as_bytes()).map_err(io)?;
        w.write_all(b"\n").map_err(io)?;
    }
    w.flush().map_err(io)?;
    Ok(bytes)
}

/// A chat completion of about `size` bytes, as a gateway answers.
pub fn completion_body(index: usize, size: usize) -> String {
    let mut body = serde_json::json!({
        "id": format!("chatcmpl-{index}"),
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": ""},
            "finish_reason": "stop"
        }],
        "usage": {"prompt_tokens": 512, "completion_tokens": 180, "total_tokens": 692}
    });
    let pad = size.saturating_sub(body.to_string().len());
    body["choices"][0]["message"]["content"] = filler(index as u64 ^ 0x5eed, pad).into();
    body.to_string()
}

/// The result list element of line `index` of `job_id`: a 200 carrying a completion of about
/// `size` bytes, as the dispatcher LPUSHes it.
pub fn result_element(job_id: &str, index: usize, size: usize) -> String {
    batch_wire::ResultMessage::http(
        batch_wire::request_id(job_id, index as u64),
        200,
        completion_body(index, size),
    )
    .to_json()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_are_valid_and_sized() {
        for (i, size) in [(0, 2048), (7, 2048), (12_345, 300), (3, 10)] {
            let line = request_line(i, size);
            let checked = batch_plan::check_line(&line, i as u64 + 1).expect("a valid line");
            assert_eq!(checked.custom_id, format!("req-{i}"));
            if size > 300 {
                assert!(line.len().abs_diff(size) <= 2, "{} vs {size}", line.len());
            }
        }
        assert_ne!(request_line(1, 2048), request_line(2, 2048));
    }

    #[test]
    fn prompts_are_shuffled_evenly() {
        let of_line = shuffled_prompts(2_000, 200);
        let mut count = vec![0; 200];
        for &k in &of_line {
            count[k] += 1;
        }
        assert!(count.iter().all(|&c| c == 10), "{count:?}");
        // Shuffled: neighbours rarely share a prompt.
        let same = of_line.windows(2).filter(|w| w[0] == w[1]).count();
        assert!(same < 50, "{same}");
        assert_ne!(of_line[..200], (0..200).collect::<Vec<_>>()[..]);
    }

    #[test]
    fn results_route_to_their_line_and_carry_json() {
        let raw = result_element("batch_x", 41, 1024);
        let r = batch_wire::ResultMessage::parse(&raw).unwrap();
        assert_eq!(
            batch_wire::parse_request_id(&r.id),
            Some(("batch_x".into(), 41))
        );
        let body: serde_json::Value = serde_json::from_str(&r.payload).unwrap();
        assert_eq!(body["object"], "chat.completion");
        assert!(r.payload.len().abs_diff(1024) <= 2);
    }
}
