//! The rules a line of a batch input file must meet, in one place: the hand reading
//! (`scan.rs`) and serde's (`validate.rs`) both ask these, so the two cannot drift apart.
//! `validate_reference.rs`, the validator as it was before both, keeps its own copy on purpose:
//! it is the oracle the tests hold them to.

use batch_wire::ALLOWED_URLS;

/// The only method a line may name.
pub(crate) const METHOD: &str = "POST";

/// Whether a `custom_id` or a `model` names something: any text but blank.
pub(crate) fn named(value: &str) -> bool {
    !value.trim().is_empty()
}

/// Whether a line may name `method`.
pub(crate) fn method_allowed(method: &str) -> bool {
    method == METHOD
}

/// Whether a line may name `url`: one of [`ALLOWED_URLS`].
pub(crate) fn url_allowed(url: &str) -> bool {
    ALLOWED_URLS.contains(&url)
}

/// Whether a `body.stream` value (its JSON text) asks for streaming, which a batch refuses.
pub(crate) fn streams(stream: &[u8]) -> bool {
    stream == b"true"
}

/// The prefix hash of a system prompt's text; `None` when it has none.
pub(crate) fn prompt_hash(text: &str) -> Option<u32> {
    (!text.is_empty()).then(|| batch_wire::hash::fnv1a_32(text.as_bytes()))
}
