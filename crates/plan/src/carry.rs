//! What a request body must not hold to reach the model unchanged through the llm-d-async
//! dispatcher.
//!
//! The dispatcher decodes every payload into Go values (numbers into `float64`, strings into
//! Go strings) and encodes it again before it sends it. So:
//!
//! - a number outside `float64`'s range (`1e400`) fails to decode, and the dispatcher drops the
//!   request without a result: the line would wait until the job's deadline;
//! - a non-zero number too small for `float64` (`1e-400`) reaches the model as 0;
//! - an integer beyond ±2^53 (a `seed`, an id in `metadata`) is rounded to the nearest
//!   `float64` (and from 10^21 on written as `1e+21`, a float);
//! - an escaped lone surrogate (`"\ud800"`) reaches it as U+FFFD.
//!
//! In async mode such a line is refused when the job is validated, naming the field, before
//! anything is enqueued. Sync mode sends the bytes as they are and accepts them.

/// The first thing in `line`'s `body` that the dispatcher would change or drop: the field's
/// path (`body.seed`, `body.messages[0].content`) and why. `line` is a line that
/// [`crate::check_line`] accepted (valid JSON).
pub fn dispatcher_change(line: &str) -> Option<(String, &'static str)> {
    let bytes = line.as_bytes();
    let mut path: Vec<Step<'_>> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'{' => path.push(Step::Key(None, true)),
            b'[' => path.push(Step::Index(0)),
            b'}' | b']' => {
                path.pop();
            }
            b',' => match path.last_mut() {
                Some(Step::Index(n)) => *n += 1,
                Some(Step::Key(_, expecting)) => *expecting = true,
                None => {}
            },
            b'"' => {
                let (end, escaped) = string_end(bytes, i);
                let raw = &line[i + 1..end];
                if let Some(Step::Key(key, expecting @ true)) = path.last_mut() {
                    *key = Some(raw);
                    *expecting = false;
                }
                // Only an escape can spell a surrogate.
                if escaped && in_body(&path) && has_lone_surrogate(raw.as_bytes()) {
                    return Some((
                        shown(&path),
                        "the dispatcher would change this text: an escaped lone surrogate (\\ud800-\\udfff without its pair) reaches the model as U+FFFD",
                    ));
                }
                i = end;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i + 1 < bytes.len()
                    && matches!(bytes[i + 1], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                {
                    i += 1;
                }
                if in_body(&path) {
                    if let Some(why) = number_change(&line[start..=i]) {
                        return Some((shown(&path), why));
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// One level of the path to a value: an object's current key (and whether the next string
/// is a key), or an array's current index.
enum Step<'a> {
    Key(Option<&'a str>, bool),
    Index(usize),
}

/// Inside the top-level object's `body`.
fn in_body(path: &[Step<'_>]) -> bool {
    matches!(path.first(), Some(Step::Key(Some(k), false)) if *k == "body")
}

fn shown(path: &[Step<'_>]) -> String {
    let mut out = String::new();
    for step in path {
        match step {
            Step::Key(Some(k), false) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Step::Key(..) => {}
            Step::Index(n) => out.push_str(&format!("[{n}]")),
        }
    }
    out
}

/// The index of the quote that closes the string opening at `open`, and whether the string
/// holds an escape. Jumps from one quote or backslash to the next (memchr): a body's bytes are
/// mostly text in strings, and every line of an async job is scanned when it is validated.
fn string_end(bytes: &[u8], open: usize) -> (usize, bool) {
    let mut i = open + 1;
    let mut escaped = false;
    while let Some(at) = bytes
        .get(i..)
        .and_then(|rest| memchr::memchr2(b'"', b'\\', rest))
    {
        if bytes[i + at] == b'"' {
            return (i + at, escaped);
        }
        escaped = true;
        i += at + 2;
    }
    (bytes.len(), escaped)
}

/// Whether the raw text of a JSON string (between its quotes) escapes a surrogate that has no
/// pair.
fn has_lone_surrogate(raw: &[u8]) -> bool {
    let unit = |at: usize| -> Option<u16> {
        let hex = raw.get(at..at + 4)?;
        u16::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()
    };
    let mut i = 0;
    while let Some(at) = raw.get(i..).and_then(|rest| memchr::memchr(b'\\', rest)) {
        i += at;
        if raw.get(i + 1) != Some(&b'u') {
            i += 2;
            continue;
        }
        let Some(u) = unit(i + 2) else {
            return false;
        };
        i += 6;
        match u {
            0xD800..=0xDBFF => {
                let low = (raw.get(i..i + 2) == Some(b"\\u"))
                    .then(|| unit(i + 2))
                    .flatten();
                match low {
                    Some(0xDC00..=0xDFFF) => i += 6,
                    _ => return true,
                }
            }
            0xDC00..=0xDFFF => return true,
            _ => {}
        }
    }
    false
}

/// The largest integer below which `float64` holds every integer.
const EXACT_INTEGERS: u128 = 1 << 53;

/// Why the dispatcher would change the JSON number `text`, if it would.
fn number_change(text: &str) -> Option<&'static str> {
    let digits = text.strip_prefix('-').unwrap_or(text);
    if digits.bytes().all(|b| b.is_ascii_digit()) {
        let beyond =
            digits.len() > 38 || digits.parse::<u128>().map_or(true, |n| n > EXACT_INTEGERS);
        return beyond.then_some(
            "the dispatcher would change this number: an integer beyond ±2^53 is rounded to a float64 (send it as a string, or use sync mode)",
        );
    }
    let value: f64 = text.parse().ok()?;
    if value.is_infinite() {
        return Some(
            "the dispatcher would drop this request: the number is outside float64's range",
        );
    }
    let mantissa = digits.split(['e', 'E']).next().unwrap_or("");
    if value == 0.0 && mantissa.bytes().any(|b| (b'1'..=b'9').contains(&b)) {
        return Some(
            "the dispatcher would change this number: it is too small for a float64 and reaches the model as 0",
        );
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn line(body: &str) -> String {
        format!(r#"{{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{body}}}"#)
    }

    #[test]
    fn names_each_change_and_its_field() {
        let cases = [
            (
                r#"{"model":"m","temperature":1e400}"#,
                "body.temperature",
                "outside",
            ),
            (r#"{"model":"m","x":-1E+400}"#, "body.x", "outside"),
            (r#"{"model":"m","x":1e-400}"#, "body.x", "too small"),
            (
                r#"{"model":"m","seed":9007199254740993}"#,
                "body.seed",
                "2^53",
            ),
            (
                r#"{"model":"m","metadata":{"id":-123456789012345678901234567890}}"#,
                "body.metadata.id",
                "2^53",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"a"},{"role":"user","content":"x\ud800y"}]}"#,
                "body.messages[1].content",
                "surrogate",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"\udc00"}]}"#,
                "body.messages[0].content",
                "surrogate",
            ),
            (
                r#"{"model":"m","tags":["ok","\ud83d"]}"#,
                "body.tags[1]",
                "surrogate",
            ),
        ];
        for (body, field, why) in cases {
            let (got, reason) = dispatcher_change(&line(body)).unwrap_or_else(|| panic!("{body}"));
            assert_eq!(got, field, "{body}");
            assert!(reason.contains(why), "{body}: {reason}");
        }
    }

    #[test]
    fn leaves_what_it_carries_alone() {
        for body in [
            r#"{"model":"m","seed":9007199254740992,"n":-9007199254740992}"#,
            r#"{"model":"m","temperature":0.7,"x":1e300,"y":0,"z":0.0,"w":-0e5,"v":5e-324}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"\ud83d\ude00 \\ud800 \u00e9 \" \\"}]}"#,
            r#"{"model":"m","messages":[],"max_tokens":128,"stop":null,"logprobs":true}"#,
        ] {
            assert_eq!(dispatcher_change(&line(body)), None, "{body}");
        }
    }

    #[test]
    fn looks_only_inside_the_body() {
        let l = r#"{"custom_id":"\ud800","method":"POST","url":"/v1/chat/completions","n":1e400,"body":{"model":"m"}}"#;
        assert_eq!(dispatcher_change(l), None);
    }

    proptest! {
        /// Held to Rust's own number parsing: an integer literal is changed exactly when it
        /// lies beyond ±2^53, a decimal one when it overflows or underflows to 0.
        #[test]
        fn numbers_agree_with_a_parse(
            negative in any::<bool>(),
            int in "[1-9][0-9]{0,24}",
            frac in proptest::option::of("[0-9]{1,20}"),
            exp in proptest::option::of(-420i32..420),
        ) {
            let sign = if negative { "-" } else { "" };
            let mut text = format!("{sign}{int}");
            if let Some(f) = &frac { text.push('.'); text.push_str(f); }
            if let Some(e) = exp { text.push_str(&format!("e{e}")); }
            let got = dispatcher_change(&line(&format!(r#"{{"model":"m","x":{text}}}"#)));
            let expected = if frac.is_none() && exp.is_none() {
                int.parse::<u128>().map_or(true, |n| n > EXACT_INTEGERS)
            } else {
                let v: f64 = text.parse().unwrap();
                v.is_infinite() || v == 0.0
            };
            prop_assert_eq!(got.is_some(), expected, "{}", text);
        }
    }
}
