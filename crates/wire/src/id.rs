//! Request ids that carry their job and line.
//!
//! The dispatcher echoes only `id`, so the id alone must route a result: `batch_req_` followed by
//! the percent-escaped job id, `_`, and the decimal line index. Escaping keeps the id safe in
//! HTTP headers and Redis keys; the index is last and all digits, so splitting on the final `_`
//! is unambiguous whatever the job id holds.

use std::borrow::Cow;
use std::fmt::Write;

/// Every request id starts with this, as OpenAI's do.
pub const REQUEST_ID_PREFIX: &str = "batch_req_";

fn is_plain(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')
}

/// The dispatcher-level id of line `index` (0-based) of job `job_id`.
pub fn request_id(job_id: &str, index: u64) -> String {
    let mut id = String::with_capacity(REQUEST_ID_PREFIX.len() + job_id.len() + 8);
    id.push_str(REQUEST_ID_PREFIX);
    for &b in job_id.as_bytes() {
        if is_plain(b) {
            id.push(b as char);
        } else {
            write!(id, "%{b:02X}").expect("writing to a String");
        }
    }
    write!(id, "_{index}").expect("writing to a String");
    id
}

/// What every request id of `job_id` starts with: `batch_req_<escaped job id>_`.
pub fn request_id_prefix(job_id: &str) -> String {
    let mut id = request_id(job_id, 0);
    id.pop();
    id
}

/// The (job id, line index) of an id made by [`request_id`]; `None` for anything else.
///
/// Only the exact bytes [`request_id`] produces are accepted, so two different ids never parse
/// to the same pair.
pub fn parse_request_id(id: &str) -> Option<(String, u64)> {
    split_request_id(id).map(|(job, index)| (job.into_owned(), index))
}

/// [`parse_request_id`], borrowing the job id from `id` when it needed no escapes (as almost
/// every job id does).
pub fn split_request_id(id: &str) -> Option<(Cow<'_, str>, u64)> {
    let rest = id.strip_prefix(REQUEST_ID_PREFIX)?;
    let (escaped, index) = rest.rsplit_once('_')?;
    if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if index.len() > 1 && index.starts_with('0') {
        return None;
    }
    let index: u64 = index.parse().ok()?;
    if escaped.bytes().all(is_plain) {
        return Some((Cow::Borrowed(escaped), index));
    }
    let mut bytes = Vec::with_capacity(escaped.len());
    let mut it = escaped.bytes();
    while let Some(b) = it.next() {
        match b {
            b'%' => {
                let hi = hex_upper(it.next()?)?;
                let lo = hex_upper(it.next()?)?;
                let decoded = hi << 4 | lo;
                if is_plain(decoded) {
                    return None;
                }
                bytes.push(decoded);
            }
            b if is_plain(b) => bytes.push(b),
            _ => return None,
        }
    }
    Some((Cow::Owned(String::from_utf8(bytes).ok()?), index))
}

fn hex_upper(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn typical_ids_read_well() {
        assert_eq!(request_id("batch_abc123", 42), "batch_req_batch_abc123_42");
        assert_eq!(request_id("job 1/ü", 0), "batch_req_job%201%2F%C3%BC_0");
        assert_eq!(request_id("", 7), "batch_req__7");
        assert_eq!(parse_request_id("batch_req__7"), Some((String::new(), 7)));
    }

    #[test]
    fn refuses_what_it_did_not_build() {
        for bad in [
            "",
            "batch_req_",
            "batch_req_job",
            "batch_req_job_",
            "batch_req_job_x1",
            "batch_req_job_01",
            "batch_req_job%41_1",
            "batch_req_job%2f_1",
            "batch_req_job%2_1",
            "batch_req_a b_1",
            "other_job_1",
            "batch_req_job_99999999999999999999999",
        ] {
            assert_eq!(parse_request_id(bad), None, "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn parse_inverts_build(job in any::<String>(), index in any::<u64>()) {
            let id = request_id(&job, index);
            prop_assert_eq!(parse_request_id(&id), Some((job, index)));
        }

        #[test]
        fn ids_are_header_and_key_safe(job in any::<String>(), index in any::<u64>()) {
            let id = request_id(&job, index);
            prop_assert!(id.bytes().all(|b| b.is_ascii_graphic()), "{}", id);
            prop_assert!(!id.contains(':'));
        }

        #[test]
        fn different_pairs_never_collide(
            a in any::<String>(), i in any::<u64>(),
            b in any::<String>(), j in any::<u64>(),
        ) {
            prop_assume!((&a, i) != (&b, j));
            prop_assert_ne!(request_id(&a, i), request_id(&b, j));
        }

        #[test]
        fn near_collisions_never_collide(prefix in "[a-z_%]{0,6}", i in 0u64..1000, j in 0u64..1000) {
            // Job ids that end in `_<digits>` are the only way one pair could mimic another.
            let a = (format!("{prefix}_{i}"), j);
            let b = (prefix.clone(), i);
            prop_assert_ne!(request_id(&a.0, a.1), request_id(&b.0, b.1));
        }

        #[test]
        fn every_id_of_a_job_starts_with_its_prefix(job in any::<String>(), index in any::<u64>()) {
            let id = request_id(&job, index);
            prop_assert!(id.starts_with(&request_id_prefix(&job)));
            prop_assert_eq!(&id[request_id_prefix(&job).len()..], index.to_string());
        }

        #[test]
        fn parse_never_panics(s in any::<String>()) {
            if let Some((job, index)) = parse_request_id(&s) {
                prop_assert_eq!(request_id(&job, index), s);
            }
        }

        #[test]
        fn a_plain_job_id_is_borrowed(job in "[a-zA-Z0-9_.-]{0,20}", index in any::<u64>()) {
            let id = request_id(&job, index);
            prop_assert!(matches!(split_request_id(&id), Some((Cow::Borrowed(j), i)) if j == job && i == index));
        }
    }
}
