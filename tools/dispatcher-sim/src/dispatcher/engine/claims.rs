//! v0.10's durable dequeue (contract §6): a member is claimed by a Lua script that ZREMs it and
//! records it under a lease; a heartbeat renews the leases of the claims in hand; an ack
//! releases a claim once its result is written; a reclaimer puts claims whose lease ran out
//! back into their sorted set.
//!
//! Every key a script touches is passed in KEYS, and all of them share the queue's hash slot:
//! the queue `q` itself and `{q}:claimed`, `{q}:claim-owners`, `{q}:claims-idx` (the hash tag
//! `{q}` hashes to `q`'s slot). That is why the result LPUSH is not inside the ack script: the
//! result list lives in another slot. It is pushed first, then the claim is released, so a
//! crash in between re-sends the request (a duplicate result with the same id and token, which
//! consumers may drop) instead of losing it.

use fred::prelude::{Client as RedisClient, HashesInterface, SortedSetsInterface};
use fred::types::scripts::Script;

/// The Redis keys of one sorted set's claims.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClaimKeys {
    /// The sorted set claimed from (a request queue or the retry set).
    pub queue: String,
    /// `{<queue>}:claimed`: hash, claim key → member.
    pub claimed: String,
    /// `{<queue>}:claim-owners`: hash, claim key → dispatcher instance id.
    pub owners: String,
    /// `{<queue>}:claims-idx`: sorted set of claim keys by lease expiry (Unix seconds).
    pub index: String,
}

impl ClaimKeys {
    /// The hash-tagged claim keys of `queue`.
    pub fn for_queue(queue: &str) -> Self {
        Self {
            queue: queue.to_owned(),
            claimed: format!("{{{queue}}}:claimed"),
            owners: format!("{{{queue}}}:claim-owners"),
            index: format!("{{{queue}}}:claims-idx"),
        }
    }

    /// The four keys, in the order the claim and reclaim scripts take them in `KEYS`.
    fn script_keys(&self) -> Vec<String> {
        vec![
            self.queue.clone(),
            self.claimed.clone(),
            self.owners.clone(),
            self.index.clone(),
        ]
    }

    /// The claim key of a request: `id` + NUL + `request_token`.
    pub fn claim_key(id: &str, token: &str) -> String {
        format!("{id}\0{token}")
    }
}

/// KEYS: queue, claimed, owners, index. ARGV: member, claim key, owner, lease expiry.
const CLAIM: &str = r#"
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[2])
return 1
"#;

/// KEYS: owners, index. ARGV: claim key, owner, new expiry. 0 when the claim is not ours.
const RENEW: &str = r#"
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
"#;

/// KEYS: claimed, owners, index. ARGV: claim key, owner. 0 when the claim is not ours.
const RELEASE: &str = r#"
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"#;

/// KEYS: queue, claimed, owners, index. ARGV: claim key, now, score. Puts the member back only
/// if the lease is still expired (a heartbeat may have renewed it meanwhile).
const RECLAIM: &str = r#"
local expiry = redis.call('ZSCORE', KEYS[4], ARGV[1])
if not expiry or tonumber(expiry) > tonumber(ARGV[2]) then return 0 end
local member = redis.call('HGET', KEYS[2], ARGV[1])
if member then redis.call('ZADD', KEYS[1], ARGV[3], member) end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return 1
"#;

/// The loaded scripts (EVALSHA, reloaded after a Redis restart).
pub(crate) struct Scripts {
    claim: Script,
    renew: Script,
    release: Script,
    reclaim: Script,
}

impl Scripts {
    pub fn new() -> Self {
        Self {
            claim: Script::from_lua(CLAIM),
            renew: Script::from_lua(RENEW),
            release: Script::from_lua(RELEASE),
            reclaim: Script::from_lua(RECLAIM),
        }
    }

    /// Moves `member` from the queue into a claim owned by `owner`; false when another
    /// dispatcher took it first.
    pub async fn claim(
        &self,
        redis: &RedisClient,
        keys: &ClaimKeys,
        member: &str,
        claim_key: &str,
        owner: &str,
        expiry: f64,
    ) -> Result<bool, fred::error::Error> {
        let won: i64 = self
            .claim
            .evalsha_with_reload(
                redis,
                keys.script_keys(),
                vec![
                    member.to_owned(),
                    claim_key.to_owned(),
                    owner.to_owned(),
                    expiry.to_string(),
                ],
            )
            .await?;
        Ok(won == 1)
    }

    /// Extends the lease; false when the claim is no longer `owner`'s.
    pub async fn renew(
        &self,
        redis: &RedisClient,
        keys: &ClaimKeys,
        claim_key: &str,
        owner: &str,
        expiry: f64,
    ) -> Result<bool, fred::error::Error> {
        let ours: i64 = self
            .renew
            .evalsha_with_reload(
                redis,
                vec![keys.owners.clone(), keys.index.clone()],
                vec![claim_key.to_owned(), owner.to_owned(), expiry.to_string()],
            )
            .await?;
        Ok(ours == 1)
    }

    /// Deletes the claim's entries; false when it was not `owner`'s (any more).
    pub async fn release(
        &self,
        redis: &RedisClient,
        keys: &ClaimKeys,
        claim_key: &str,
        owner: &str,
    ) -> Result<bool, fred::error::Error> {
        let ours: i64 = self
            .release
            .evalsha_with_reload(
                redis,
                vec![
                    keys.claimed.clone(),
                    keys.owners.clone(),
                    keys.index.clone(),
                ],
                vec![claim_key.to_owned(), owner.to_owned()],
            )
            .await?;
        Ok(ours == 1)
    }

    /// Claim keys whose lease ended before `now`, at most `limit`.
    pub async fn expired(
        &self,
        redis: &RedisClient,
        keys: &ClaimKeys,
        now: f64,
        limit: i64,
    ) -> Result<Vec<String>, fred::error::Error> {
        redis
            .zrangebyscore(keys.index.as_str(), "-inf", now, false, Some((0, limit)))
            .await
    }

    /// The member held under a claim.
    pub async fn member(
        &self,
        redis: &RedisClient,
        keys: &ClaimKeys,
        claim_key: &str,
    ) -> Result<Option<String>, fred::error::Error> {
        redis.hget(keys.claimed.as_str(), claim_key).await
    }

    /// Puts an expired claim's member back at `score`; false when it was renewed or is gone.
    pub async fn reclaim(
        &self,
        redis: &RedisClient,
        keys: &ClaimKeys,
        claim_key: &str,
        now: f64,
        score: f64,
    ) -> Result<bool, fred::error::Error> {
        let done: i64 = self
            .reclaim
            .evalsha_with_reload(
                redis,
                keys.script_keys(),
                vec![claim_key.to_owned(), now.to_string(), score.to_string()],
            )
            .await?;
        Ok(done == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_hash_tagged_by_the_queue_name() {
        let k = ClaimKeys::for_queue("llm-d-async:requests:pool-a");
        assert_eq!(k.claimed, "{llm-d-async:requests:pool-a}:claimed");
        assert_eq!(k.owners, "{llm-d-async:requests:pool-a}:claim-owners");
        assert_eq!(k.index, "{llm-d-async:requests:pool-a}:claims-idx");
        assert_eq!(ClaimKeys::claim_key("id-1", "tok"), "id-1\0tok");
    }
}
