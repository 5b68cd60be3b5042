//! Whether Redis will keep what the processor writes: its eviction policy and persistence.
//!
//! A Redis that evicts keys under memory pressure (any `maxmemory-policy` but `noeviction`)
//! silently drops queued requests, leases and records; one without persistence forgets them
//! all at a restart. The first is refused unless the operator says they accept it, the second
//! is a warning and a gauge (`batch_redis_persistence_enabled`).

use std::sync::atomic::{AtomicBool, Ordering};

use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand, Value};

/// What Redis says of its eviction policy and persistence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Durability {
    /// `maxmemory-policy`.
    pub maxmemory_policy: String,
    /// `appendonly yes`.
    pub aof: bool,
    /// A non-empty `save` schedule (RDB snapshots).
    pub rdb: bool,
}

impl Durability {
    /// Keys survive memory pressure.
    pub fn never_evicts(&self) -> bool {
        self.maxmemory_policy == "noeviction"
    }

    /// Keys survive a restart (AOF or RDB).
    pub fn persists(&self) -> bool {
        self.aof || self.rdb
    }
}

/// Redis may evict the processor's keys and the operator did not accept it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("Redis's maxmemory-policy is {policy}: under memory pressure it evicts keys, and with them queued requests, leases and batch records. Set `maxmemory-policy noeviction` (redis.conf, or CONFIG SET maxmemory-policy noeviction), or set redis_allow_eviction: true in the config to run anyway")]
pub struct EvictionRefused {
    /// The policy found.
    pub policy: String,
}

async fn config_get(client: &Client, name: &str) -> Result<String, Error> {
    let cmd = CustomCommand::new_static("CONFIG", ClusterHash::Random, false);
    let reply: Value = client
        .custom(cmd, vec![Value::from("GET"), Value::from(name)])
        .await?;
    // RESP2 gives [name, value]; RESP3 a map.
    let value = match reply {
        Value::Array(items) => items.get(1).and_then(|v| v.as_string()),
        Value::Map(map) => map.inner().values().next().and_then(|v| v.as_string()),
        _ => None,
    };
    value.ok_or_else(|| {
        Error::new(
            ErrorKind::Unknown,
            format!("CONFIG GET {name} gave no value"),
        )
    })
}

/// Reads the eviction policy and persistence settings (`CONFIG GET`).
pub async fn durability(client: &Client) -> Result<Durability, Error> {
    Ok(Durability {
        maxmemory_policy: config_get(client, "maxmemory-policy").await?,
        aof: config_get(client, "appendonly").await? == "yes",
        rdb: !config_get(client, "save").await?.trim().is_empty(),
    })
}

/// Checks the Redis behind `client` at start: an evicting policy is an error unless
/// `allow_eviction`; missing persistence is a warning. Both, and a check that could not run
/// (`CONFIG` refused by a managed Redis or an ACL), are logged once per process.
pub async fn check_durability(
    client: &Client,
    allow_eviction: bool,
) -> Result<Option<Durability>, EvictionRefused> {
    static LOGGED: AtomicBool = AtomicBool::new(false);
    let first = !LOGGED.swap(true, Ordering::Relaxed);
    let found = match durability(client).await {
        Ok(d) => d,
        Err(e) => {
            if first {
                tracing::warn!(error = %e.details(), "could not read Redis's eviction policy and persistence (CONFIG GET refused?): the check was skipped; make sure maxmemory-policy is noeviction and persistence is on");
            }
            return Ok(None);
        }
    };
    metrics::gauge!("batch_redis_persistence_enabled").set(if found.persists() {
        1.0
    } else {
        0.0
    });
    if !found.never_evicts() {
        if !allow_eviction {
            return Err(EvictionRefused {
                policy: found.maxmemory_policy,
            });
        }
        if first {
            tracing::warn!(policy = %found.maxmemory_policy, "Redis may evict keys under memory pressure (redis_allow_eviction: true): queued requests, leases and records can vanish");
        }
    }
    if !found.persists() && first {
        tracing::warn!("Redis has no persistence (appendonly no, no save schedule): a restart forgets queued requests, leases and records");
    }
    Ok(Some(found))
}
