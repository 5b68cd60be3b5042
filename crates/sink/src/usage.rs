//! A 2xx response's `usage`, read one way wherever it is read (as a line is written, and from
//! the lines a resumed job kept): chat and completions name its tokens
//! `prompt_tokens`/`completion_tokens`, the Responses API `input_tokens`/`output_tokens` (either,
//! not both); `total_tokens` defaults to their sum. The usual shape is read by hand, anything
//! else by serde, and both read alike (a proptest below says so).

use batch_wire::{json, Usage};
use serde::Deserialize;

/// A response's `usage` as the gateway names its members.
#[derive(Deserialize)]
struct UsageFields {
    #[serde(default, alias = "input_tokens")]
    prompt_tokens: u64,
    #[serde(default, alias = "output_tokens")]
    completion_tokens: u64,
    #[serde(default)]
    total_tokens: Option<u64>,
    #[serde(default, alias = "input_tokens_details")]
    prompt_tokens_details: Option<Details>,
    #[serde(default, alias = "output_tokens_details")]
    completion_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: u64,
    #[serde(default)]
    reasoning_tokens: u64,
}

impl From<UsageFields> for Usage {
    fn from(u: UsageFields) -> Self {
        let mut usage = Usage {
            input_tokens: u.prompt_tokens,
            output_tokens: u.completion_tokens,
            total_tokens: u
                .total_tokens
                .unwrap_or(u.prompt_tokens.saturating_add(u.completion_tokens)),
            ..Usage::default()
        };
        usage.input_tokens_details.cached_tokens =
            u.prompt_tokens_details.map_or(0, |d| d.cached_tokens);
        usage.output_tokens_details.reasoning_tokens = u
            .completion_tokens_details
            .map_or(0, |d| d.reasoning_tokens);
        usage
    }
}

#[derive(Deserialize)]
struct UsageOnly {
    #[serde(default)]
    usage: Option<UsageFields>,
}

/// The `usage` of a JSON document as serde reads it.
pub(crate) fn read(json: &[u8]) -> Option<Usage> {
    serde_json::from_slice::<UsageOnly>(json)
        .ok()?
        .usage
        .map(Usage::from)
}

/// The token counts of a 2xx response's JSON body (see the module's doc); `doc` is what
/// [`json::check`] found in it.
pub(crate) fn usage(body: &[u8], doc: &json::Document) -> Option<Usage> {
    if !doc.object {
        // serde reads an array into a struct's fields: keep what it made of them.
        return read(body);
    }
    let at = doc.usage.clone().filter(|_| !doc.usage_repeated)?;
    let value = &body[at];
    plain_usage(value).unwrap_or_else(|| {
        serde_json::from_slice::<Option<UsageFields>>(value)
            .ok()?
            .map(Usage::from)
    })
}

/// The usual `usage`, read by hand: `null`, or an object whose members are integers (or
/// `null` under keys it does not count) under plain keys. `None` for anything else, which
/// serde reads. `value` is JSON.
fn plain_usage(value: &[u8]) -> Option<Option<Usage>> {
    if value == b"null" {
        return Some(None);
    }
    let (mut prompt, mut completion, mut total) = (None, None, None);
    let (mut prompt_details, mut completion_details) = (false, false);
    let mut i = ws(value, 1);
    if value.first() != Some(&b'{') {
        return None;
    }
    if value.get(i) == Some(&b'}') {
        return Some(Some(Usage::default()));
    }
    loop {
        // A key without escapes: JSON, so it ends at the next quote.
        let key_start = i + 1;
        let key_end = key_start + value[key_start..].iter().position(|&b| b == b'"')?;
        let key = &value[key_start..key_end];
        if key.contains(&b'\\') {
            return None;
        }
        i = ws(value, key_end + 1) + 1;
        i = ws(value, i);
        let number = plain_count(value, &mut i)?;
        let slot = match key {
            b"prompt_tokens" | b"input_tokens" => Some(&mut prompt),
            b"completion_tokens" | b"output_tokens" => Some(&mut completion),
            b"total_tokens" => Some(&mut total),
            b"prompt_tokens_details"
            | b"input_tokens_details"
            | b"completion_tokens_details"
            | b"output_tokens_details" => {
                // Only `null` gets here (an object is serde's); once, as serde allows it.
                let seen = match key[0] {
                    b'p' | b'i' => &mut prompt_details,
                    _ => &mut completion_details,
                };
                if number.is_some() || std::mem::replace(seen, true) {
                    return None;
                }
                None
            }
            _ => None,
        };
        if let Some(slot) = slot {
            // A repeated field, or a count that is `null`: serde's to judge.
            if slot.is_some() {
                return None;
            }
            *slot = Some(number?);
        }
        match next_member(value, i) {
            Some(next) => i = next,
            None => break,
        }
    }
    let (prompt, completion) = (prompt.unwrap_or(0), completion.unwrap_or(0));
    Some(Some(Usage {
        input_tokens: prompt,
        output_tokens: completion,
        total_tokens: total.unwrap_or(prompt.saturating_add(completion)),
        ..Usage::default()
    }))
}

/// The plain integer or `null` at `i`, `i` then past it; `None` for anything else (a float, a
/// string, twenty digits or more), which serde judges.
fn plain_count(value: &[u8], i: &mut usize) -> Option<Option<u64>> {
    let digits = value[*i..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    let number = match digits {
        0 if value[*i..].starts_with(b"null") => {
            *i += 4;
            None
        }
        1..=19 => {
            let n = std::str::from_utf8(&value[*i..*i + digits])
                .ok()?
                .parse()
                .ok()?;
            *i += digits;
            Some(n)
        }
        _ => return None,
    };
    // A fraction or exponent: a float, which serde judges.
    if let Some(b'.' | b'e' | b'E') = value.get(*i) {
        return None;
    }
    Some(number)
}

/// Where the next member's key starts after a member ending at `i`; `None` at the end.
fn next_member(value: &[u8], i: usize) -> Option<usize> {
    let i = ws(value, i);
    match value.get(i) {
        Some(b',') => Some(ws(value, i + 1)),
        _ => None,
    }
}

fn ws(s: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\t' | b'\n' | b'\r') = s.get(i) {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn usage_value() -> impl Strategy<Value = String> {
        let key = prop::sample::select(vec![
            "prompt_tokens",
            "completion_tokens",
            "total_tokens",
            "input_tokens",
            "output_tokens",
            "prompt_tokens_details",
            "output_tokens_details",
            "input_tokens_details",
            "x",
            "prompt\\u005ftokens",
        ]);
        let value = prop::sample::select(vec![
            "0",
            "7",
            "512",
            "null",
            "-1",
            "1.5",
            "2e3",
            "\"s\"",
            "{}",
            "[1]",
            "true",
            "18446744073709551615",
            "18446744073709551616",
            "1234567890123456789",
            "{\"cached_tokens\":2}",
            "{\"reasoning_tokens\":3,\"x\":null}",
        ]);
        let space = prop::sample::select(vec!["", " ", "\n\t"]);
        prop_oneof![
            Just("null".to_owned()),
            Just("[3, 4]".to_owned()),
            prop::collection::vec((key, value, space), 0..5).prop_map(|members| {
                let members: Vec<String> = members
                    .iter()
                    .map(|(k, v, s)| format!("{s}\"{k}\"{s}:{s}{v}{s}"))
                    .collect();
                format!("{{{}}}", members.join(","))
            }),
        ]
    }

    #[test]
    fn the_usual_usage_is_read_by_hand() {
        let usual = br#"{"prompt_tokens":512, "completion_tokens":180,"total_tokens":692}"#;
        let read = Some(Usage {
            input_tokens: 512,
            output_tokens: 180,
            total_tokens: 692,
            ..Usage::default()
        });
        assert_eq!(plain_usage(usual), Some(read));
        assert_eq!(plain_usage(b"null"), Some(None));
        assert_eq!(
            plain_usage(br#"{"prompt_tokens":1,"prompt_tokens":2}"#),
            None
        );
        assert_eq!(plain_usage(br#"{"details":{}}"#), None);
    }

    proptest! {
        /// `usage` read by hand is what serde reads.
        #[test]
        fn usage_is_read_as_serde_reads_it(value in usage_value()) {
            let body = format!("{{\"usage\":{value}}}");
            let doc = json::check(body.as_bytes()).unwrap();
            let serde = read(body.as_bytes());
            prop_assert_eq!(usage(body.as_bytes(), &doc), serde, "{}", body);
        }
    }
}
