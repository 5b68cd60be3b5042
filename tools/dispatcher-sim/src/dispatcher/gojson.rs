//! JSON as Go's `encoding/json` writes it, observed on the real dispatcher (v0.9.0 and main of
//! August 2026): it decodes each member's `payload` into `map[string]any` and encodes it again
//! before the POST and whenever it re-adds a member. So object keys come out sorted by their
//! bytes, every number goes through float64 (`1.0` becomes `1`, an integer above 2^53 changes,
//! `1e400` cannot be decoded at all and the member is dropped), the output is compact, and
//! `<`, `>`, `&`, U+2028 and U+2029 are escaped.

use serde_json::Value;

/// The payload's bytes after Go's decode and encode; `Err` when Go could not decode it (the
/// real dispatcher then drops the member without a result).
pub fn reencode(raw: &str) -> Result<String, String> {
    let value: Value = serde_json::from_str(raw).map_err(|e| e.to_string())?;
    let mut out = String::with_capacity(raw.len());
    write_value(&value, &mut out)?;
    Ok(out)
}

/// Escapes what Go's encoder escapes and serde_json does not, in JSON text serde_json wrote.
/// Those characters only ever stand inside strings, so replacing them everywhere is exact.
pub fn html_escape(json: &str) -> String {
    if !json.contains(['<', '>', '&', '\u{2028}', '\u{2029}']) {
        return json.to_owned();
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        match c {
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c => out.push(c),
        }
    }
    out
}

fn write_value(value: &Value, out: &mut String) -> Result<(), String> {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            let f = n
                .as_f64()
                .filter(|f| f.is_finite())
                .ok_or_else(|| format!("number {n} is out of float64 range"))?;
            write_float(f, out);
        }
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(item, out)?;
            }
            out.push(']');
        }
        Value::Object(map) => {
            // Go sorts map keys by their bytes, whatever order they came in.
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(key, out);
                out.push(':');
                write_value(&map[key], out)?;
            }
            out.push('}');
        }
    }
    Ok(())
}

/// Go's float64 form: the shortest digits that read back the same, plain between 1e-6 and
/// 1e21, else with an exponent written `e+21` / `e-7`.
fn write_float(f: f64, out: &mut String) {
    let abs = f.abs();
    if abs == 0.0 || (1e-6..1e21).contains(&abs) {
        // Rust's Display is the shortest round-trip form without an exponent, as Go's 'f', -1.
        out.push_str(&format!("{f}"));
        return;
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    out.push_str(mantissa);
    if exp < 0 {
        out.push_str(&format!("e-{}", -exp));
    } else {
        out.push_str(&format!("e+{exp:02}"));
    }
}

fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_sorted_numbers_as_float64_compact() {
        assert_eq!(
            reencode(r#"{"model": "m", "max_tokens": 4.0, "a": [1, 2.50, -0.0], "seed": 9007199254740993}"#)
                .unwrap(),
            r#"{"a":[1,2.5,-0],"max_tokens":4,"model":"m","seed":9007199254740992}"#
        );
    }

    #[test]
    fn exponents_as_go_writes_them() {
        assert_eq!(
            reencode("[1e21, 1.5e-7, 1e-6, 123456789e15, 1e100]").unwrap(),
            "[1e+21,1.5e-7,0.000001,1.23456789e+23,1e+100]"
        );
    }

    #[test]
    fn strings_escaped_as_go_escapes_them() {
        assert_eq!(
            reencode(r#"{"c":"<a href=\"x\">&</a>\u2028\u0001\b\f\n\u00e9"}"#).unwrap(),
            "{\"c\":\"\\u003ca href=\\\"x\\\"\\u003e\\u0026\\u003c/a\\u003e\\u2028\\u0001\\b\\f\\né\"}"
        );
        assert_eq!(
            html_escape(r#"{"a":"<&>"}"#),
            r#"{"a":"\u003c\u0026\u003e"}"#
        );
    }

    /// The very bytes the real v0.9.0 and main POSTed for this payload (gateway digest
    /// 827ba2daf4f3c620, 81 bytes).
    #[test]
    fn the_body_observed_at_the_gateway_behind_the_real_dispatcher() {
        let sent = reencode(
            r#"{"model":"m","max_tokens":2.0,"seed":9007199254740993,"prompt":"a<b & c"}"#,
        )
        .unwrap();
        assert_eq!(
            sent,
            r#"{"max_tokens":2,"model":"m","prompt":"a\u003cb \u0026 c","seed":9007199254740992}"#
        );
        assert_eq!(sent.len(), 81);
    }

    #[test]
    fn a_number_out_of_float64_range_cannot_be_decoded() {
        assert!(reencode(r#"{"x": 1e400}"#).is_err());
    }
}
