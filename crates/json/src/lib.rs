#![doc = include_str!("../README.md")]

use std::borrow::Cow;
use std::ops::Range;

mod strings;

pub use strings::{read_string, string_end, unescape_into, StringEnd};
use strings::{scan_string, skip_plain, Surrogates};

/// What [`check`] found in a JSON document.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Document {
    /// Whether the document is an object.
    pub object: bool,
    /// Where the value of the object's `usage` member is, when it has exactly one.
    pub usage: Option<Range<usize>>,
    /// Whether the object has `usage` more than once.
    pub usage_repeated: bool,
}

/// The document is not JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotJson;

/// The kinds of the open containers, innermost last: one bit each, 1 for an object. Any depth
/// is JSON (serde_json reads a `RawValue` without a recursion limit).
struct Open {
    innermost: u128,
    depth: u32,
    outer: Vec<u128>,
}

impl Open {
    fn push(&mut self, object: bool) {
        if self.depth > 0 && self.depth & 127 == 0 {
            self.outer.push(self.innermost);
        }
        self.innermost = self.innermost << 1 | object as u128;
        self.depth += 1;
    }

    fn pop(&mut self) {
        self.innermost >>= 1;
        self.depth -= 1;
        if self.depth > 0 && self.depth & 127 == 0 {
            self.innermost = self.outer.pop().expect("a word per 128 levels");
        }
    }

    fn in_object(&self) -> bool {
        self.innermost & 1 == 1
    }
}

/// Checks that `text` is one JSON value with nothing around it but JSON whitespace, exactly as
/// serde_json does when it reads a `RawValue` (strings are checked as it ignores them: any
/// `\u` escape of four hex digits), and finds the top-level `usage` member. `text` must be
/// UTF-8 (it is not checked).
pub fn check(text: &[u8]) -> Result<Document, NotJson> {
    let mut doc = Document::default();
    let start = skip_ws(text, 0);
    doc.object = text.get(start) == Some(&b'{');
    let end = walk::<true>(text, start, &mut doc)?;
    match skip_ws(text, end) == text.len() {
        true => Ok(doc),
        false => Err(NotJson),
    }
}

/// The index just after the JSON value that starts at `s[i]`, checked as serde_json checks a
/// value it skips (`IgnoredAny`, `RawValue`: any `\u` escape of four hex digits, any depth).
/// `s` must be UTF-8 (it is not checked).
pub fn value_end(s: &[u8], i: usize) -> Result<usize, NotJson> {
    walk::<false>(s, i, &mut Document::default())
}

/// The index after the value at `i`; with `USAGE`, notes the top-level `usage` in `doc`.
#[inline(always)]
fn walk<const USAGE: bool>(s: &[u8], mut i: usize, doc: &mut Document) -> Result<usize, NotJson> {
    let mut open = Open {
        innermost: 0,
        depth: 0,
        outer: Vec::new(),
    };
    // Where the value of a top-level `usage` key starts, while it is being read.
    let mut usage_start: Option<usize> = None;
    'value: loop {
        // A value starts at i.
        match *s.get(i).ok_or(NotJson)? {
            bracket @ (b'{' | b'[') => {
                let object = bracket == b'{';
                open.push(object);
                i = skip_ws(s, i + 1);
                let close = if object { b'}' } else { b']' };
                if s.get(i) == Some(&close) {
                    i += 1;
                    open.pop();
                } else {
                    if object {
                        i = member_key::<USAGE>(s, i, open.depth, doc, &mut usage_start)?;
                    }
                    continue 'value;
                }
            }
            b'"' => i = scan_string(s, i + 1, Surrogates::Any).ok_or(NotJson)?.quote + 1,
            b't' => i = literal(s, i, b"true")?,
            b'f' => i = literal(s, i, b"false")?,
            b'n' => i = literal(s, i, b"null")?,
            b'-' | b'0'..=b'9' => i = number(s, i)?,
            _ => return Err(NotJson),
        }
        // A value ended at i: close containers, or go on to the next element or member.
        loop {
            if open.depth == 0 {
                return Ok(i);
            }
            if USAGE && open.depth == 1 {
                if let Some(start) = usage_start.take() {
                    doc.usage = Some(start..i);
                }
            }
            i = skip_ws(s, i);
            let object = open.in_object();
            match (s.get(i), object) {
                (Some(b','), _) => {
                    i = skip_ws(s, i + 1);
                    if object {
                        i = member_key::<USAGE>(s, i, open.depth, doc, &mut usage_start)?;
                    }
                    continue 'value;
                }
                (Some(b'}'), true) | (Some(b']'), false) => {
                    i += 1;
                    open.pop();
                }
                _ => return Err(NotJson),
            }
        }
    }
}

/// Reads `"key" :` at `i` and the whitespace after it; notes a top-level `usage`. Returns where
/// the member's value starts.
#[inline(always)]
fn member_key<const USAGE: bool>(
    s: &[u8],
    i: usize,
    depth: u32,
    doc: &mut Document,
    usage_start: &mut Option<usize>,
) -> Result<usize, NotJson> {
    if s.get(i) != Some(&b'"') {
        return Err(NotJson);
    }
    let end = scan_string(s, i + 1, Surrogates::Any).ok_or(NotJson)?;
    let key = &s[i + 1..end.quote];
    let j = skip_ws(s, end.quote + 1);
    if s.get(j) != Some(&b':') {
        return Err(NotJson);
    }
    let value = skip_ws(s, j + 1);
    if USAGE && depth == 1 && (key == b"usage" || end.escaped && is_usage(key)) {
        if doc.usage.is_some() || doc.usage_repeated {
            doc.usage = None;
            doc.usage_repeated = true;
        } else {
            *usage_start = Some(value);
        }
    }
    Ok(value)
}

/// Whether a key spelled with escapes names `usage`, as serde reads it (a key that is not text,
/// a lone surrogate, names no field).
#[cold]
fn is_usage(key: &[u8]) -> bool {
    let mut text = Vec::new();
    std::str::from_utf8(key).is_ok_and(|k| unescape_into(k, &mut text)) && text == b"usage"
}

/// The index of the first byte at or after `i` that is not JSON whitespace, or `s.len()`.
#[inline(always)]
pub fn skip_ws(s: &[u8], mut i: usize) -> usize {
    // Most JSON is written without whitespace: one comparison to leave.
    while let Some(&b) = s.get(i) {
        if b > b' ' || !matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
            break;
        }
        i += 1;
    }
    i
}

#[inline(always)]
fn literal(s: &[u8], i: usize, word: &[u8]) -> Result<usize, NotJson> {
    match s.get(i..i + word.len()) {
        Some(w) if w == word => Ok(i + word.len()),
        _ => Err(NotJson),
    }
}

/// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?` at `i`; the index after it.
fn number(s: &[u8], mut i: usize) -> Result<usize, NotJson> {
    let digits = |mut i: usize| {
        let start = i;
        while s.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        if i == start {
            Err(NotJson)
        } else {
            Ok(i)
        }
    };
    if s.get(i) == Some(&b'-') {
        i += 1;
    }
    i = match s.get(i) {
        Some(b'0') => i + 1,
        _ => digits(i)?,
    };
    if s.get(i) == Some(&b'.') {
        i = digits(i + 1)?;
    }
    if let Some(b'e' | b'E') = s.get(i) {
        i += 1;
        if let Some(b'+' | b'-') = s.get(i) {
            i += 1;
        }
        i = digits(i)?;
    }
    Ok(i)
}

/// Walks the object at `s[i]`: `member(key, value_start)` reads each member's value and returns
/// the index after it, or `None` to stop. The index after the object; `None` when it is not an
/// object, a key holds escapes (compare the key as text to read those), or `member` stopped.
///
/// With [`elements`], [`string`] and [`value_end`], a reader of a known document shape that
/// leaves anything unusual to serde: each says `None` rather than guess.
#[inline(always)]
pub fn members(
    s: &[u8],
    i: usize,
    mut member: impl FnMut(&[u8], usize) -> Option<usize>,
) -> Option<usize> {
    delimited(s, i, b'{', b'}', |i| {
        if s.get(i) != Some(&b'"') {
            return None;
        }
        let key = string_end(s, i + 1).filter(|k| !k.escaped)?;
        let colon = skip_ws(s, key.quote + 1);
        if s.get(colon) != Some(&b':') {
            return None;
        }
        member(&s[i + 1..key.quote], skip_ws(s, colon + 1))
    })
}

/// Walks the array at `s[i]`: `element(start)` reads each element and returns the index after
/// it, or `None` to stop. The index after the array; `None` when it is not an array or
/// `element` stopped.
#[inline(always)]
pub fn elements(s: &[u8], i: usize, element: impl FnMut(usize) -> Option<usize>) -> Option<usize> {
    delimited(s, i, b'[', b']', element)
}

/// Walks the items between `open` at `s[i]` and its `close`, separated by commas: `item(start)`
/// reads each and returns the index after it. The index after `close`; `None` when `s[i]` is
/// not `open` or `item` stopped.
#[inline(always)]
fn delimited(
    s: &[u8],
    i: usize,
    open: u8,
    close: u8,
    mut item: impl FnMut(usize) -> Option<usize>,
) -> Option<usize> {
    if s.get(i) != Some(&open) {
        return None;
    }
    let mut i = skip_ws(s, i + 1);
    if s.get(i) == Some(&close) {
        return Some(i + 1);
    }
    loop {
        i = skip_ws(s, item(i)?);
        match s.get(i)? {
            b',' => i = skip_ws(s, i + 1),
            &c if c == close => return Some(i + 1),
            _ => return None,
        }
    }
}

/// The string at `text[i]` (its opening quote) as serde_json reads it into a `Cow<str>`
/// (borrowed when it has no escapes), and the index after it; `None` when there is no valid
/// string there.
pub fn string(text: &str, i: usize) -> Option<(Cow<'_, str>, usize)> {
    let s = text.as_bytes();
    if s.get(i) != Some(&b'"') {
        return None;
    }
    let mut out = Vec::new();
    let end = read_string(s, i + 1, &mut out)?;
    let value = match end.escaped {
        // Both ends are ASCII quotes, so char boundaries.
        false => Cow::Borrowed(&text[i + 1..end.quote]),
        true => Cow::Owned(String::from_utf8(out).ok()?),
    };
    Some((value, end.quote + 1))
}

/// Appends `text` as a JSON string, byte for byte as serde_json writes it.
pub fn write_str(out: &mut Vec<u8>, text: &str) {
    let s = text.as_bytes();
    if s.is_empty() || skip_plain(s, 0) == s.len() {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s);
        out.push(b'"');
    } else {
        serde_json::to_writer(&mut *out, text).expect("writing to a Vec cannot fail");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::value::RawValue;

    fn serde_accepts(text: &str) -> bool {
        serde_json::from_str::<&RawValue>(text).is_ok()
    }

    #[test]
    fn checks_as_serde_does() {
        for text in [
            "{}",
            "[]",
            " {\"a\" : [1, -2.5e+3, true, false, null, \"x\"]}\n",
            "0",
            "-0",
            "01",
            "1.",
            ".5",
            "1e",
            "1E+",
            "-",
            "--1",
            "+1",
            "1.5e-7",
            "\"\\u00e9\"",
            "\"\\ud800\"",
            "\"\\uDC00\\ud800x\"",
            "\"\\uZZZZ\"",
            "\"\\x\"",
            "\"a\u{1}\"",
            "\"a\u{7f}é\"",
            "[1,]",
            "{\"a\":1,}",
            "{\"a\"}",
            "{\"a\":}",
            "{1:2}",
            "[1 2]",
            "{} {}",
            "tru",
            "truex",
            "nul",
            "[",
            "]",
            "{\"a\":[}]",
            "\u{a0}{}",
            "{}\u{a0}",
            "\"unterminated",
            "",
            " ",
            "\t[\r\n]\t",
            "\u{c}[]",
            "[\"a\\\"b\\\\\"]",
        ] {
            assert_eq!(
                check(text.as_bytes()).is_ok(),
                serde_accepts(text),
                "{text:?}"
            );
        }
    }

    #[test]
    fn any_nesting_is_json() {
        for depth in [1, 127, 128, 129, 255, 256, 257, 100_000] {
            for (open, close) in [("[", "]"), ("{\"a\":", "}"), ("[{\"a\":", "}]")] {
                let text = format!("{}1{}", open.repeat(depth), close.repeat(depth));
                assert!(serde_accepts(&text));
                assert!(check(text.as_bytes()).is_ok(), "depth {depth} of {open}");
                // Closed in the wrong order, it is not.
                let text = format!("{}1]}}{}", open.repeat(depth), close.repeat(depth));
                assert!(check(text.as_bytes()).is_err(), "depth {depth} of {open}");
            }
        }
    }

    #[test]
    fn finds_the_top_level_usage() {
        let text = r#"{"id":"x","usage":{"prompt_tokens":3} ,"choices":[{"usage":1}]}"#;
        let doc = check(text.as_bytes()).unwrap();
        assert!(doc.object);
        assert_eq!(&text[doc.usage.unwrap()], r#"{"prompt_tokens":3}"#);
        let doc = check(br#"{"usage":1,"usage":2}"#).unwrap();
        assert_eq!((doc.usage, doc.usage_repeated), (None, true));
        let doc = check(br#"{"usage":1,"usage":2,"usage":3}"#).unwrap();
        assert_eq!((doc.usage, doc.usage_repeated), (None, true));
        let doc = check(br#"{"us\u0061ge":null}"#).unwrap();
        assert_eq!(doc.usage, Some(14..18));
        let doc = check(br#"[{"usage":1}]"#).unwrap();
        assert_eq!((doc.object, doc.usage), (false, None));
        let doc = check(br#"{"a":{"usage":1}}"#).unwrap();
        assert_eq!(doc.usage, None);
        let doc = check(br#" {"usage" : 12 } "#).unwrap();
        assert_eq!(doc.usage, Some(12..14));
    }

    #[test]
    fn unescapes_as_serde_reads_strings() {
        for quoted in [
            r#""plain""#,
            r#""\"q\" \\ \/ \b\f\n\r\t""#,
            r#""\u00e9\u20ac\ud83d\ude00 \u0000""#,
            r#""\ud83d""#,
            r#""\ude00""#,
            r#""\ud83dx""#,
            r#""\ud83d\u0041""#,
            r#""\x""#,
            r#""\u12""#,
            "\"a\u{1}b\"",
            r#""a"b""#,
            r#""trailing\""#,
            r#""0123456789abcdef\"0123456789abcdef""#,
        ] {
            let serde = serde_json::from_str::<String>(quoted).ok();
            let inner = &quoted[1..quoted.len() - 1];
            let mut out = b"keep".to_vec();
            let ok = unescape_into(inner, &mut out);
            let ours = ok.then(|| String::from_utf8(out[4..].to_vec()).unwrap());
            assert_eq!(ours, serde, "{quoted}");
            if !ok {
                assert_eq!(out, b"keep");
            }
            let end = string_end(quoted.as_bytes(), 1);
            assert_eq!(
                end.is_some_and(|e| e.quote == quoted.len() - 1),
                serde.is_some(),
                "{quoted}"
            );
        }
    }

    /// A string cut anywhere before its closing quote is no string, escapes or not (the
    /// fuzz target found `read_string` taking the end of the text for the quote).
    #[test]
    fn a_string_cut_before_its_quote_is_not_read() {
        let quoted = r#""ab\"c\\\u00e9\ud83d\ude00 0123456789abcdef0123456789abcdef\n""#;
        for cut in 1..quoted.len() {
            let text = &quoted.as_bytes()[..cut];
            let mut out = b"keep".to_vec();
            assert_eq!(read_string(text, 1, &mut out), None, "{cut}");
            assert_eq!(out, b"keep");
            assert_eq!(string_end(text, 1), None, "{cut}");
        }
        let whole = read_string(quoted.as_bytes(), 1, &mut Vec::new()).unwrap();
        assert_eq!(whole.quote, quoted.len() - 1);
    }

    fn json_text() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_owned()),
            any::<bool>().prop_map(|b| b.to_string()),
            any::<i64>().prop_map(|n| n.to_string()),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| f.to_string()),
            any::<String>().prop_map(|s| serde_json::to_string(&s).unwrap()),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6)
                    .prop_map(|v| format!("[{}]", v.join(","))),
                prop::collection::vec((any::<String>(), inner), 0..6).prop_map(|v| {
                    let members: Vec<String> = v
                        .iter()
                        .map(|(k, v)| format!("{}: {v}", serde_json::to_string(k).unwrap()))
                        .collect();
                    format!("{{ {} }}", members.join(" ,"))
                }),
            ]
        })
    }

    proptest! {
        #[test]
        fn valid_documents_pass(text in json_text()) {
            prop_assert!(check(text.as_bytes()).is_ok(), "{}", text);
        }

        /// Any damage to a document is judged as serde judges it.
        #[test]
        fn damaged_documents_are_judged_as_serde_judges_them(
            text in json_text(),
            at in any::<usize>(),
            byte in prop::sample::select(vec![b'"', b'\\', b',', b':', b'[', b']', b'{', b'}', b'0', b'-', b'e', b'.', b' ', b'u', b'x', 1u8]),
            mode in 0..3u8,
        ) {
            let mut bytes = text.into_bytes();
            batch_testkit::damage(&mut bytes, at, byte, mode);
            // Only UTF-8 is ever checked.
            if let Ok(text) = String::from_utf8(bytes) {
                prop_assert_eq!(check(text.as_bytes()).is_ok(), serde_accepts(&text), "{}", text);
            }
        }

        /// A value followed by anything ends where serde's stream reader ends it, and is
        /// refused where serde refuses it.
        #[test]
        fn values_end_where_serde_ends_them(
            text in json_text(),
            tail in prop::sample::select(vec!["", ",", "]", "}1", " x", ":\"a\"", "\""]),
        ) {
            let both = format!("{text}{tail}");
            let mut stream = serde_json::Deserializer::from_str(&both).into_iter::<&RawValue>();
            let serde_end = stream.next().and_then(|v| v.ok()).map(|_| stream.byte_offset());
            prop_assert_eq!(value_end(both.as_bytes(), 0).ok(), serde_end, "{}", both);
        }

        #[test]
        fn any_text_round_trips(text in any::<String>()) {
            let mut quoted = Vec::new();
            write_str(&mut quoted, &text);
            prop_assert_eq!(&quoted, &serde_json::to_vec(&text).unwrap());
            let quoted = String::from_utf8(quoted).unwrap();
            let end = string_end(quoted.as_bytes(), 1).unwrap();
            prop_assert_eq!(end.quote, quoted.len() - 1);
            let mut out = Vec::new();
            prop_assert!(unescape_into(&quoted[1..end.quote], &mut out));
            prop_assert_eq!(out, text.into_bytes());
        }

        /// Reading a string stops at its closing quote whatever follows, with its text.
        #[test]
        fn strings_read_to_their_closing_quote(text in any::<String>(), tail in ".{0,40}") {
            let quoted = serde_json::to_string(&text).unwrap();
            let doc = format!("{quoted}{tail}");
            let mut out = b"keep".to_vec();
            let end = read_string(doc.as_bytes(), 1, &mut out).unwrap();
            prop_assert_eq!(end.quote, quoted.len() - 1);
            prop_assert_eq!(Some(end), string_end(doc.as_bytes(), 1));
            let read = match end.escaped {
                true => out[4..].to_vec(),
                false => {
                    prop_assert_eq!(&out, b"keep");
                    doc.as_bytes()[1..end.quote].to_vec()
                }
            };
            prop_assert_eq!(read, text.into_bytes());
        }

        /// Escapes at every offset of a block, and runs across blocks, read as serde reads them.
        #[test]
        fn escapes_anywhere_in_a_block(
            parts in prop::collection::vec((0usize..70, prop::sample::select(vec![r#"\""#, r"\\", r"\n", r"\u00e9", r"\ud83d\ude00", r"\ud83d", r"\x", "\u{1}", "\""])), 0..6),
            tail in 0usize..40,
        ) {
            let mut inner = String::new();
            for (run, escape) in &parts {
                inner.push_str(&"a".repeat(*run));
                inner.push_str(escape);
            }
            inner.push_str(&"b".repeat(tail));
            let doc = format!("\"{inner}\" ,");
            let serde = serde_json::from_str::<String>(&doc[..inner.len() + 2]).ok();
            let mut out = Vec::new();
            let read = read_string(doc.as_bytes(), 1, &mut out);
            match &serde {
                Some(text) => {
                    let end = read.unwrap();
                    prop_assert_eq!(end.quote, inner.len() + 1);
                    let got = if end.escaped { out.clone() } else { inner.clone().into_bytes() };
                    prop_assert_eq!(got, text.clone().into_bytes());
                }
                // Invalid text, or a raw quote that ends the string early: never a read that
                // reaches the last quote.
                None => prop_assert!(read.is_none_or(|e| e.quote < inner.len() + 1)),
            }
            let mut out = Vec::new();
            let ok = unescape_into(&inner, &mut out);
            prop_assert_eq!(ok.then(|| String::from_utf8(out).unwrap()), serde);
        }

        #[test]
        fn unescaping_agrees_with_serde(inner in r#"([a-z"\\/]|\\[\\"/bfnrtx]|\\u[0-9a-fA-FdD]{4}|\\ud8[0-9a-f]{2}\\udc[0-9a-f]{2}|[\u{0}-\u{20}]|é){0,24}"#) {
            let serde = serde_json::from_str::<String>(&format!("\"{inner}\"")).ok();
            let mut out = Vec::new();
            let ok = unescape_into(&inner, &mut out);
            prop_assert_eq!(ok.then(|| String::from_utf8(out).unwrap()), serde);
        }
    }
}
