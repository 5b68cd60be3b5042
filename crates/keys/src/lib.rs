#![doc = include_str!("../README.md")]

use std::fmt;

/// The prefix used by the real dispatcher's Helm chart and the seed design.
pub const DEFAULT_PREFIX: &str = "llm-d-async";

/// The seed's reserved tenant id for batch results; our default consumer id.
pub const DEFAULT_CONSUMER_ID: &str = "$batch";

/// Why a name part cannot be used in a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// The part is empty.
    #[error("{what} is empty")]
    Empty {
        /// Which part: "pool name", "prefix" or "consumer id".
        what: &'static str,
    },
    /// The part holds a character that would make the key ambiguous or unreadable.
    #[error("{what} {value:?} contains {found:?}; use letters, digits, '-', '_', '.', '$' or '/'")]
    BadCharacter {
        /// Which part: "pool name", "prefix" or "consumer id".
        what: &'static str,
        /// The rejected value.
        value: String,
        /// The first offending character.
        found: char,
    },
}

/// Checks that `value` can be one `:`-separated part of a key.
///
/// Colons separate the parts, so a colon inside one would let two different pools share a key;
/// whitespace and control characters are refused because operators copy these names by hand.
pub fn validate_part(what: &'static str, value: &str) -> Result<(), NameError> {
    if value.is_empty() {
        return Err(NameError::Empty { what });
    }
    if let Some(found) = value
        .chars()
        .find(|c| matches!(c, ':' | '{' | '}') || c.is_whitespace() || c.is_control())
    {
        return Err(NameError::BadCharacter {
            what,
            value: value.to_owned(),
            found,
        });
    }
    Ok(())
}

/// How one processor replica names its queues: the key prefix and its own result-list id.
#[derive(Clone, PartialEq, Eq)]
pub struct QueueNames {
    prefix: String,
    consumer_id: String,
}

impl Default for QueueNames {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
            consumer_id: DEFAULT_CONSUMER_ID.to_owned(),
        }
    }
}

impl fmt::Debug for QueueNames {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "QueueNames({}:*:*:{})", self.prefix, self.consumer_id)
    }
}

impl QueueNames {
    /// Naming with a custom prefix and consumer id, both validated.
    pub fn new(
        prefix: impl Into<String>,
        consumer_id: impl Into<String>,
    ) -> Result<Self, NameError> {
        let (prefix, consumer_id) = (prefix.into(), consumer_id.into());
        validate_part("prefix", &prefix)?;
        validate_part("consumer id", &consumer_id)?;
        Ok(Self {
            prefix,
            consumer_id,
        })
    }

    /// The key prefix, `llm-d-async` by default.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// This replica's result-list id, `$batch` by default.
    pub fn consumer_id(&self) -> &str {
        &self.consumer_id
    }

    /// The dispatcher's request sorted set for `pool`: `{prefix}:requests:{pool}`.
    pub fn request_queue_name(&self, pool: &str) -> Result<String, NameError> {
        validate_part("pool name", pool)?;
        Ok(format!("{}:requests:{pool}", self.prefix))
    }

    /// This replica's result list for `pool`: `{prefix}:results:{pool}:{consumer_id}`.
    pub fn result_queue_name(&self, pool: &str) -> Result<String, NameError> {
        validate_part("pool name", pool)?;
        Ok(format!(
            "{}:results:{pool}:{}",
            self.prefix, self.consumer_id
        ))
    }

    /// Where every running job of `pool` names the result list its requests ask for
    /// (`{prefix}:result-routes:{pool}`, a hash: job id → `<deadline> <list>`).
    ///
    /// Not a dispatcher key. A dispatcher whose queue entry sets its own `result_queue_name`
    /// sends every result of the pool to that one list, whatever each request asked for; its
    /// reader finds here the list whose reader runs the job and hands the result on.
    pub fn result_routes_name(&self, pool: &str) -> Result<String, NameError> {
        validate_part("pool name", pool)?;
        Ok(format!("{}:result-routes:{pool}", self.prefix))
    }

    /// The seed's result list for `pool` under this prefix, `{prefix}:results:{pool}:$batch`:
    /// the one a dispatcher's queue entry names when it names one.
    pub fn seed_result_queue_name(&self, pool: &str) -> Result<String, NameError> {
        validate_part("pool name", pool)?;
        Ok(format!(
            "{}:results:{pool}:{DEFAULT_CONSUMER_ID}",
            self.prefix
        ))
    }

    /// The `n`th (1-based) of the result-list ids a process may take by itself: this consumer
    /// id for 1, `<consumer_id>-<n>` after.
    pub fn numbered(&self, n: usize) -> Self {
        let consumer_id = match n {
            0 | 1 => self.consumer_id.clone(),
            n => format!("{}-{n}", self.consumer_id),
        };
        Self {
            prefix: self.prefix.clone(),
            consumer_id,
        }
    }

    /// The list where results popped from `pool`'s result list wait until they are written.
    ///
    /// Not a dispatcher key: it belongs to the list's reader alone, which is what makes a crash
    /// between popping and writing recoverable.
    pub fn inflight_queue_name(&self, pool: &str) -> Result<String, NameError> {
        Ok(ListKeys::new(&self.result_queue_name(pool)?).inflight)
    }
}

/// The processor's own keys that go with one result list.
///
/// Each is named `{<list>}:...`, so in a Redis Cluster it lands in the list's own hash slot and one
/// script may touch the list and all of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListKeys {
    /// The list results are taken from.
    pub list: String,
    /// Where taken results wait until they are written.
    pub inflight: String,
    /// Who reads the list: one reader at a time.
    pub lease: String,
    /// The last acknowledgement applied, so a resent one is applied once.
    pub acked: String,
    /// Jobs whose requests name the list (job id → deadline): their results are kept, never
    /// dropped, by whichever process reads the list.
    pub jobs: String,
    /// Set by the reader of another list that handed results on to this one: that list's name.
    /// Its reader learns from it where the dispatcher really sends its requests' results.
    pub handed_from: String,
    /// The base list, whose slot every key shares.
    base: String,
}

impl ListKeys {
    /// The keys of the dispatcher's result list `list`.
    pub fn new(list: &str) -> Self {
        Self {
            list: list.to_owned(),
            inflight: format!("{{{list}}}:inflight"),
            lease: format!("{{{list}}}:lease"),
            acked: format!("{{{list}}}:acked"),
            jobs: format!("{{{list}}}:jobs"),
            handed_from: format!("{{{list}}}:handed-from"),
            base: list.to_owned(),
        }
    }

    /// The keys of the list where results of `job` wait that arrived on `list` while no process
    /// running the job read it.
    pub fn parked(list: &str, job: &str) -> Self {
        let parked = format!("{{{list}}}:parked:{job}");
        Self {
            inflight: format!("{parked}:inflight"),
            lease: format!("{parked}:lease"),
            acked: format!("{parked}:acked"),
            jobs: format!("{{{list}}}:jobs"),
            handed_from: format!("{parked}:handed-from"),
            list: parked,
            base: list.to_owned(),
        }
    }

    /// The parked list of `job` beside this one's base list.
    pub fn parked_list(&self, job: &str) -> String {
        format!("{{{}}}:parked:{job}", self.base)
    }

    /// The dispatcher's result list these keys go with.
    pub fn base(&self) -> &str {
        &self.base
    }
}

/// `{prefix}:requests:{pool}` with the default prefix.
pub fn request_queue_name(pool: &str) -> Result<String, NameError> {
    QueueNames::default().request_queue_name(pool)
}

/// `{prefix}:results:{pool}:$batch` with the default prefix and consumer id.
pub fn result_queue_name(pool: &str) -> Result<String, NameError> {
    QueueNames::default().result_queue_name(pool)
}

/// The hash where a v0.10 dispatcher keeps the requests of `request_queue` it has in hand
/// (`{<queue>}:claimed`, field `<id>\0<token>`).
pub fn claimed_key(request_queue: &str) -> String {
    format!("{{{request_queue}}}:claimed")
}

/// The dispatcher's cancel marker key for a request id (`request-cancel:<id>`).
pub fn cancel_marker_key(request_id: &str) -> String {
    format!("request-cancel:{request_id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_names() {
        assert_eq!(
            request_queue_name("optimized-baseline").unwrap(),
            "llm-d-async:requests:optimized-baseline"
        );
        assert_eq!(
            result_queue_name("optimized-baseline").unwrap(),
            "llm-d-async:results:optimized-baseline:$batch"
        );
    }

    #[test]
    fn both_names_come_from_one_pool() {
        let names = QueueNames::new("prod", "replica-7").unwrap();
        assert_eq!(names.request_queue_name("p").unwrap(), "prod:requests:p");
        assert_eq!(
            names.result_queue_name("p").unwrap(),
            "prod:results:p:replica-7"
        );
        assert_eq!(
            names.inflight_queue_name("p").unwrap(),
            "{prod:results:p:replica-7}:inflight"
        );
    }

    #[test]
    fn ambiguous_pool_names_are_errors() {
        for bad in [
            "",
            "a:b",
            "a b",
            " pool",
            "pool\n",
            "tab\there",
            "{a}",
            "a}",
        ] {
            assert!(request_queue_name(bad).is_err(), "{bad:?} accepted");
            assert!(result_queue_name(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(
            request_queue_name("").unwrap_err(),
            NameError::Empty { what: "pool name" }
        );
        let err = request_queue_name("a:b").unwrap_err().to_string();
        assert!(err.contains("\"a:b\"") && err.contains("':'"), "{err}");
    }

    #[test]
    fn bad_prefix_or_consumer_id_is_refused() {
        assert!(QueueNames::new("", "x").is_err());
        assert!(QueueNames::new("a:b", "x").is_err());
        assert!(QueueNames::new("p", "").is_err());
        assert!(QueueNames::new("p", "with space").is_err());
    }

    #[test]
    fn list_keys_share_the_lists_slot() {
        let keys = ListKeys::new("llm-d-async:results:p:$batch");
        for k in [
            &keys.inflight,
            &keys.lease,
            &keys.acked,
            &keys.jobs,
            &keys.handed_from,
        ] {
            assert!(k.starts_with("{llm-d-async:results:p:$batch}:"), "{k}");
        }
        let parked = ListKeys::parked("llm-d-async:results:p:$batch", "batch_1");
        assert_eq!(parked.list, "{llm-d-async:results:p:$batch}:parked:batch_1");
        assert_eq!(parked.list, keys.parked_list("batch_1"));
        assert_eq!(parked.jobs, keys.jobs);
        assert!(parked
            .inflight
            .starts_with("{llm-d-async:results:p:$batch}:"));
    }

    #[test]
    fn result_routes_are_per_pool_and_not_a_result_list() {
        let names = QueueNames::new("prod", "replica-7").unwrap();
        assert_eq!(
            names.result_routes_name("p").unwrap(),
            "prod:result-routes:p"
        );
        assert!(names.result_routes_name("a:b").is_err());
        // No consumer id makes a result list of the same name.
        assert!(!names
            .result_routes_name("p")
            .unwrap()
            .starts_with("prod:results:"));
    }

    #[test]
    fn numbered_lists_and_the_seed_list() {
        let names = QueueNames::new("prod", "r").unwrap();
        assert_eq!(names.numbered(1), names);
        assert_eq!(
            names.numbered(3).result_queue_name("p").unwrap(),
            "prod:results:p:r-3"
        );
        assert_eq!(
            names.numbered(3).seed_result_queue_name("p").unwrap(),
            "prod:results:p:$batch"
        );
    }

    #[test]
    fn claimed_key_matches_the_v0_10_dispatcher() {
        assert_eq!(
            claimed_key("llm-d-async:requests:pool-a"),
            "{llm-d-async:requests:pool-a}:claimed"
        );
    }

    #[test]
    fn cancel_marker_matches_the_dispatcher() {
        assert_eq!(cancel_marker_key("req-1"), "request-cancel:req-1");
    }
}
