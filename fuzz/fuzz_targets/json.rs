//! The JSON scanner of `batch_json` against serde_json, on any text: a document is
//! accepted exactly when serde accepts it, and a string's text is unescaped exactly as serde
//! reads it, whatever the blocks its escapes and stops fall in.
#![no_main]

use batch_json as json;
use libfuzzer_sys::fuzz_target;
use serde_json::value::RawValue;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let serde_accepts = serde_json::from_str::<&RawValue>(text).is_ok();
    assert_eq!(json::check(data).is_ok(), serde_accepts, "{text:?}");

    // The text as the inside of a string.
    let quoted = format!("\"{text}\"");
    let serde = serde_json::from_str::<String>(&quoted).ok();
    let mut out = Vec::new();
    let ours = json::unescape_into(text, &mut out).then(|| String::from_utf8(out).unwrap());
    assert_eq!(ours, serde, "{quoted:?}");
    let end = json::string_end(quoted.as_bytes(), 1);
    assert_eq!(
        end.is_some_and(|e| e.quote == quoted.len() - 1),
        serde.is_some(),
        "{quoted:?}"
    );
    let mut read = Vec::new();
    let read_end = json::read_string(quoted.as_bytes(), 1, &mut read);
    // A string may end at a quote before the last one; serde then refuses the rest.
    let whole = read_end.filter(|e| e.quote == quoted.len() - 1);
    assert_eq!(whole.is_some(), serde.is_some(), "{quoted:?}");
    assert_eq!(
        read_end.map(|e| e.quote),
        end.map(|e| e.quote),
        "{quoted:?}"
    );
    if let (Some(end), Some(value)) = (whole, &serde) {
        let text = if end.escaped {
            &read[..]
        } else {
            &quoted.as_bytes()[1..end.quote]
        };
        assert_eq!(text, value.as_bytes(), "{quoted:?}");
    }
});
