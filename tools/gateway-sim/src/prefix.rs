//! The prefix-cache model: per endpoint, an LRU of the last K prompt prefixes seen, as a model
//! server's KV cache keeps the shared start of recent prompts.

use std::collections::VecDeque;

use serde_json::{Map, Value};

/// The cache key of a chat request's prompt prefix: the model and the content of the first
/// system message, else of the first message. `None` when the body has no messages (plain
/// completions and embeddings are not modelled).
pub fn prefix_key(body: &Map<String, Value>) -> Option<u64> {
    let messages = body.get("messages")?.as_array()?;
    let first = messages
        .iter()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("system"))
        .or_else(|| messages.first())?;
    let content = match first.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => String::new(),
    };
    let model = body.get("model").and_then(Value::as_str).unwrap_or("");
    // Models do not share caches: the model is part of the key. NUL cannot occur in a name.
    let mut text = Vec::with_capacity(model.len() + 1 + content.len());
    text.extend_from_slice(model.as_bytes());
    text.push(0);
    text.extend_from_slice(content.as_bytes());
    Some(batch_wire::hash::fnv1a_64(&text))
}

/// A least-recently-used set of prefix keys. Linear in its size, which is small (a model
/// server holds a handful of distinct long prefixes).
#[derive(Debug, Default)]
pub struct Lru {
    /// Most recent last.
    keys: VecDeque<u64>,
}

impl Lru {
    /// Records a use of `key` with room for `capacity` keys; true on a hit.
    pub fn touch(&mut self, key: u64, capacity: usize) -> bool {
        let hit = match self.keys.iter().position(|k| *k == key) {
            Some(i) => {
                self.keys.remove(i);
                true
            }
            None => false,
        };
        self.keys.push_back(key);
        self.shrink(capacity);
        hit
    }

    /// Drops the least recent keys beyond `capacity`.
    pub fn shrink(&mut self, capacity: usize) {
        while self.keys.len() > capacity {
            self.keys.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(s: &str) -> Map<String, Value> {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn the_prefix_is_the_first_system_message_else_the_first_message() {
        let a = body(
            r#"{"model":"m","messages":[{"role":"user","content":"q1"},{"role":"system","content":"S"}]}"#,
        );
        let b = body(
            r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"q2"}]}"#,
        );
        assert_eq!(prefix_key(&a), prefix_key(&b));
        let c = body(r#"{"model":"m","messages":[{"role":"user","content":"q1"}]}"#);
        let d = body(r#"{"model":"m","messages":[{"role":"user","content":"q2"}]}"#);
        assert_ne!(prefix_key(&c), prefix_key(&d));
        let other_model = body(r#"{"model":"n","messages":[{"role":"system","content":"S"}]}"#);
        assert_ne!(prefix_key(&b), prefix_key(&other_model));
        assert_eq!(prefix_key(&body(r#"{"model":"m","prompt":"x"}"#)), None);
        assert_eq!(prefix_key(&body(r#"{"model":"m","messages":[]}"#)), None);
    }

    #[test]
    fn lru_keeps_the_last_k() {
        let mut lru = Lru::default();
        assert!(!lru.touch(1, 2));
        assert!(!lru.touch(2, 2));
        assert!(lru.touch(1, 2), "1 is still cached");
        assert!(!lru.touch(3, 2), "evicts 2, the least recent");
        assert!(!lru.touch(2, 2));
        assert!(!lru.touch(1, 0), "size 0 caches nothing");
        assert!(!lru.touch(1, 0));
    }
}
