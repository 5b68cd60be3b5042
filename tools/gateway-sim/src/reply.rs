//! Deterministic OpenAI-style reply bodies. Each names the digest of the exact request body so a
//! test can prove which request a reply answers.

use serde_json::{json, Map, Value};

/// The fixed `created` of every reply: a reply must depend on the request only.
const CREATED: i64 = 1_700_000_000;

/// The inference endpoints the gateway serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completions,
    /// `/v1/embeddings`
    Embeddings,
}

impl Endpoint {
    /// How many endpoints there are.
    pub const COUNT: usize = 3;

    /// A distinct index below [`Endpoint::COUNT`].
    pub fn index(self) -> usize {
        match self {
            Self::Chat => 0,
            Self::Completions => 1,
            Self::Embeddings => 2,
        }
    }

    /// The endpoint served at `path`, if any.
    pub fn from_path(path: &str) -> Option<Self> {
        match path {
            "/v1/chat/completions" => Some(Self::Chat),
            "/v1/completions" => Some(Self::Completions),
            "/v1/embeddings" => Some(Self::Embeddings),
            _ => None,
        }
    }
}

/// Output tokens requested: `max_tokens`, else `max_completion_tokens`.
pub fn requested_tokens(body: &Map<String, Value>) -> Option<u64> {
    ["max_tokens", "max_completion_tokens"]
        .iter()
        .find_map(|k| body.get(*k).and_then(Value::as_u64))
}

/// The request's prompt tokens as its answer's `usage.prompt_tokens` reports them.
pub fn prompt_tokens(endpoint: Endpoint, body: &Map<String, Value>) -> u64 {
    let field = match endpoint {
        Endpoint::Chat => "messages",
        Endpoint::Completions => "prompt",
        Endpoint::Embeddings => "input",
    };
    body.get(field).map(count_words).unwrap_or(0)
}

/// The reply body for a well-formed request.
pub fn success(
    endpoint: Endpoint,
    model: &str,
    body: &Map<String, Value>,
    digest: &str,
    tokens: u64,
) -> String {
    let content = content(digest);
    let reply = match endpoint {
        Endpoint::Chat => {
            let prompt = prompt_tokens(endpoint, body);
            json!({
                "id": format!("chatcmpl-{digest}"),
                "object": "chat.completion",
                "created": CREATED,
                "model": model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "logprobs": null,
                    "finish_reason": "stop",
                }],
                "usage": usage(prompt, tokens),
            })
        }
        Endpoint::Completions => {
            let prompt = prompt_tokens(endpoint, body);
            json!({
                "id": format!("cmpl-{digest}"),
                "object": "text_completion",
                "created": CREATED,
                "model": model,
                "choices": [{
                    "index": 0,
                    "text": content,
                    "logprobs": null,
                    "finish_reason": "stop",
                }],
                "usage": usage(prompt, tokens),
            })
        }
        Endpoint::Embeddings => {
            let inputs = match body.get("input") {
                Some(Value::Array(items)) if items.iter().all(|i| !i.is_number()) => items.len(),
                _ => 1,
            };
            let prompt = prompt_tokens(endpoint, body);
            let data: Vec<Value> = (0..inputs)
                .map(|index| {
                    json!({"object": "embedding", "index": index, "embedding": vector(digest, index)})
                })
                .collect();
            json!({
                "id": format!("embd-{digest}"),
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
            })
        }
    };
    reply.to_string()
}

/// Whether a chat request asks for a streamed answer (`"stream": true`), and if so whether it
/// wants the usage chunk at the end (`stream_options.include_usage`).
pub fn stream_asked(body: &Map<String, Value>) -> Option<bool> {
    if body.get("stream").and_then(Value::as_bool) != Some(true) {
        return None;
    }
    let usage = body
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool);
    Some(usage == Some(true))
}

/// Piece `i` of `n` of a streamed chat answer's content (one piece per token): the
/// non-streamed answer's `content` cut into `n` near-equal pieces, so the pieces joined still
/// name the digest (with more tokens than characters, some pieces are empty).
pub fn content_piece(content: &str, i: u64, n: u64) -> String {
    let len = content.chars().count() as u128;
    let n = u128::from(n.max(1));
    let at = |k: u128| usize::try_from(k * len / n).unwrap_or(usize::MAX);
    let (from, to) = (at(u128::from(i)), at(u128::from(i) + 1));
    content.chars().skip(from).take(to - from).collect()
}

/// The content of every answer to a request whose body has `digest`.
pub fn content(digest: &str) -> String {
    format!("digest:{digest}")
}

/// One `chat.completion.chunk` event of a streamed chat answer (vLLM's and OpenAI's
/// server-sent events): the first piece also names the role, the last the finish reason.
pub fn chunk_event(model: &str, digest: &str, piece: &str, first: bool, last: bool) -> String {
    let mut delta = Map::new();
    if first {
        delta.insert("role".into(), "assistant".into());
    }
    delta.insert("content".into(), piece.into());
    let chunk = json!({
        "id": format!("chatcmpl-{digest}"),
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": model,
        "choices": [{
            "index": 0,
            "delta": delta,
            "logprobs": null,
            "finish_reason": if last { Value::from("stop") } else { Value::Null },
        }],
    });
    format!("data: {chunk}\n\n")
}

/// The usage event a streamed answer ends with when `stream_options.include_usage` is set: no
/// choices, the whole answer's usage.
pub fn usage_event(model: &str, digest: &str, prompt: u64, completion: u64) -> String {
    let chunk = json!({
        "id": format!("chatcmpl-{digest}"),
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": model,
        "choices": [],
        "usage": usage(prompt, completion),
    });
    format!("data: {chunk}\n\n")
}

/// The event that ends every streamed answer.
pub const DONE_EVENT: &str = "data: [DONE]\n\n";

/// An OpenAI error body.
pub fn error(message: &str, kind: &str, param: Option<&str>, code: Option<&str>) -> String {
    json!({"error": {"message": message, "type": kind, "param": param, "code": code}}).to_string()
}

fn usage(prompt: u64, completion: u64) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt.saturating_add(completion),
    })
}

/// A crude token count: words in every string, one per number (token-id prompts).
fn count_words(v: &Value) -> u64 {
    match v {
        Value::String(s) => s.split_whitespace().count() as u64,
        Value::Number(_) => 1,
        Value::Array(items) => items.iter().map(count_words).sum(),
        Value::Object(map) => map
            .iter()
            .filter(|(k, _)| matches!(k.as_str(), "content" | "text"))
            .map(|(_, v)| count_words(v))
            .sum(),
        _ => 0,
    }
}

/// Eight components derived from the digest, so equal inputs embed equally.
fn vector(digest: &str, index: usize) -> Vec<f64> {
    let seed = batch_wire::hash::fnv1a_64(format!("{digest}:{index}").as_bytes());
    (0..8)
        .map(|i| {
            let byte = (seed >> (i * 8)) & 0xff;
            (byte as f64 / 127.5) - 1.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(s: &str) -> Map<String, Value> {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn chat_reply_is_well_formed_and_names_the_digest() {
        let body = obj(
            r#"{"model":"m","messages":[{"role":"user","content":"two words"},
            {"role":"user","content":[{"type":"text","text":"three more words"}]}]}"#,
        );
        let reply: Value =
            serde_json::from_str(&success(Endpoint::Chat, "m", &body, "abc", 5)).unwrap();
        assert_eq!(reply["id"], "chatcmpl-abc");
        assert_eq!(reply["object"], "chat.completion");
        assert_eq!(reply["model"], "m");
        assert_eq!(reply["choices"][0]["message"]["content"], "digest:abc");
        assert_eq!(reply["choices"][0]["finish_reason"], "stop");
        assert_eq!(reply["usage"]["prompt_tokens"], 5);
        assert_eq!(reply["usage"]["completion_tokens"], 5);
        assert_eq!(reply["usage"]["total_tokens"], 10);
    }

    #[test]
    fn completion_and_embedding_replies() {
        let body = obj(r#"{"model":"m","prompt":"a b c"}"#);
        let reply: Value =
            serde_json::from_str(&success(Endpoint::Completions, "m", &body, "d1", 16)).unwrap();
        assert_eq!(reply["object"], "text_completion");
        assert_eq!(reply["choices"][0]["text"], "digest:d1");
        assert_eq!(reply["usage"]["prompt_tokens"], 3);

        let body = obj(r#"{"model":"e","input":["x y","z"]}"#);
        let text = success(Endpoint::Embeddings, "e", &body, "d2", 16);
        assert_eq!(text, success(Endpoint::Embeddings, "e", &body, "d2", 16));
        let reply: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(reply["object"], "list");
        assert_eq!(reply["data"].as_array().unwrap().len(), 2);
        assert_eq!(reply["data"][1]["embedding"].as_array().unwrap().len(), 8);
        assert_ne!(reply["data"][0]["embedding"], reply["data"][1]["embedding"]);
        assert_eq!(reply["usage"]["prompt_tokens"], 3);
    }

    #[test]
    fn streamed_pieces_join_into_the_content() {
        for n in [1, 5, 24, 71, 200] {
            let joined: String = (0..n).map(|i| content_piece("digest:abc", i, n)).collect();
            assert_eq!(joined, "digest:abc", "{n} pieces");
        }
        assert_eq!(content_piece("abcd", 1, 2), "cd");
        let event = chunk_event("m", "d", "x", true, false);
        let v: Value = serde_json::from_str(event.strip_prefix("data: ").unwrap()).unwrap();
        assert!(event.ends_with("\n\n"));
        assert_eq!(
            v["choices"][0]["delta"],
            json!({"role": "assistant", "content": "x"})
        );
        assert_eq!(stream_asked(&obj(r#"{"stream":true}"#)), Some(false));
        let with_usage = r#"{"stream":true,"stream_options":{"include_usage":true}}"#;
        assert_eq!(stream_asked(&obj(with_usage)), Some(true));
        assert_eq!(stream_asked(&obj(r#"{"stream":false}"#)), None);
    }

    #[test]
    fn tokens_come_from_max_tokens_or_max_completion_tokens() {
        assert_eq!(requested_tokens(&obj(r#"{"max_tokens":7}"#)), Some(7));
        assert_eq!(
            requested_tokens(&obj(r#"{"max_completion_tokens":9}"#)),
            Some(9)
        );
        assert_eq!(requested_tokens(&obj(r#"{"max_tokens":"7"}"#)), None);
    }
}
