//! One reader per result list: a lease, renewed while its holder runs.
//!
//! The lease is a key (`{<list>}:lease`) holding who reads the list, with an expiry that the
//! holder keeps pushing back. A process that dies stops renewing, so its lease lapses after one
//! TTL; a process found dead on this very machine (same boot, same PID namespace, its PID gone)
//! loses its lease at once. Two live processes never read one list.
//!
//! A process knows its own leases by a random token drawn when it starts (the holder's
//! `instance`) and a serial per lease. A lease of this process that is no longer live here (its
//! holder gave up on it after a cut from Redis longer than a TTL, while Redis kept the key) is
//! taken back at once, not waited out as if another process held it.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use fred::clients::Client;
use fred::types::scripts::Script;
use tokio_util::sync::CancellationToken;

/// Who holds a lease: enough to find the process, and to tell whether it still runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The host name.
    pub host: String,
    /// The process id on that host.
    pub pid: u32,
    /// The kernel boot and PID namespace the pid belongs to.
    pub space: String,
    /// Random per process, so a reused pid is not mistaken for its predecessor.
    pub instance: String,
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "host {}, pid {}", self.host, self.pid)
    }
}

impl Holder {
    /// This process.
    pub fn this_process() -> &'static Holder {
        static ME: OnceLock<Holder> = OnceLock::new();
        ME.get_or_init(|| Holder {
            host: host_name(),
            pid: std::process::id(),
            space: process_space(),
            instance: format!("{:016x}", rand::random::<u64>()),
        })
    }

    /// A lease value: `host pid space instance serial`, space-separated (no part holds a
    /// space); `serial` tells two leases of one process apart.
    pub fn encode(&self, serial: u64) -> String {
        format!(
            "{} {} {} {} {serial}",
            self.host.replace(' ', "_"),
            self.pid,
            self.space,
            self.instance
        )
    }

    /// Reads a lease value; `None` for anything else.
    pub fn decode(value: &str) -> Option<Holder> {
        let mut parts = value.split(' ');
        let holder = Holder {
            host: parts.next()?.to_owned(),
            pid: parts.next()?.parse().ok()?,
            space: parts.next()?.to_owned(),
            instance: parts.next()?.to_owned(),
        };
        parts.next()?.parse::<u64>().ok()?;
        parts.next().is_none().then_some(holder)
    }

    /// True only when the holder provably no longer runs: it lived on this machine, in this
    /// boot and PID namespace, and its pid is gone.
    pub fn is_dead_here(&self) -> bool {
        let me = Holder::this_process();
        if self.host != me.host || self.space != me.space || self.space.is_empty() {
            return false;
        }
        if self.pid == me.pid {
            return self.instance != me.instance;
        }
        // SAFETY: signal 0 only checks that the pid exists; nothing is sent.
        let alive = unsafe { libc::kill(self.pid as libc::pid_t, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        !alive
    }
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown-host".into())
}

fn process_space() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let pidns = std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    if boot.is_empty() || pidns.is_empty() {
        return String::new();
    }
    let ns: String = pidns.chars().filter(char::is_ascii_digit).collect();
    format!("{boot}/{ns}")
}

/// The leases this process holds now, by key: the value each was taken with. A value of this
/// process that is not here belongs to a lease it gave up, which it may take back at once.
fn live() -> std::sync::MutexGuard<'static, HashMap<String, String>> {
    static LIVE: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// True when `value` is a lease value of this very process (its start token) that no live
/// lease of this process holds on `key`: one it gave up, after a cut longer than a TTL.
fn is_own_given_up(key: &str, value: &str, holder: &Holder) -> bool {
    let me = Holder::this_process();
    holder.instance == me.instance
        && holder.host == me.host.replace(' ', "_")
        && holder.pid == me.pid
        && live().get(key).map(String::as_str) != Some(value)
}

// The lease's scripts; each file's header says what it does, its KEYS and ARGV.
const ACQUIRE_LUA: &str = include_str!("lease/acquire.lua");
const RENEW_LUA: &str = include_str!("lease/renew.lua");
const RELEASE_LUA: &str = include_str!("lease/release.lua");

/// What [`Lease::try_acquire`] found.
pub enum Acquired {
    /// The lease is ours now.
    Taken(Lease),
    /// Another process holds it (the raw value when it is not one of ours).
    Held(Result<Holder, String>),
}

/// A held lease on one key, renewed in the background until released or lost.
pub struct Lease {
    client: Client,
    key: String,
    me: String,
    lost: CancellationToken,
    stop: CancellationToken,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease").field("key", &self.key).finish()
    }
}

impl Lease {
    /// Takes the lease on `key` if it is free, ours, or held by a process that is provably
    /// dead; otherwise says who holds it.
    pub async fn try_acquire(
        client: &Client,
        key: &str,
        ttl: Duration,
    ) -> Result<Acquired, fred::error::Error> {
        static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let serial = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let me = Holder::this_process().encode(serial);
        let ttl_ms = ttl.as_millis().max(1) as u64;
        let script = Script::from_lua(ACQUIRE_LUA);
        let mut dead = String::new();
        for _ in 0..2 {
            let (taken, value): (i64, String) = script
                .evalsha_with_reload(client, key, vec![me.clone(), ttl_ms.to_string(), dead])
                .await?;
            if taken == 1 {
                return Ok(Acquired::Taken(Self::start(client.clone(), key, me, ttl)));
            }
            match Holder::decode(&value) {
                Some(h) if is_own_given_up(key, &value, &h) => {
                    tracing::info!(key, "taking back a lease this process gave up");
                    dead = value;
                }
                Some(h) if h.is_dead_here() => {
                    tracing::info!(key, holder = %h, "taking the lease of a process that is gone");
                    dead = value;
                }
                Some(h) => return Ok(Acquired::Held(Ok(h))),
                None => return Ok(Acquired::Held(Err(value))),
            }
        }
        Ok(Acquired::Held(Err("a process that keeps changing".into())))
    }

    /// Like [`Lease::try_acquire`], but when the holder is not provably dead, waits up to `wait`
    /// for its lease to lapse (a holder that stopped renewing). Returns the holder when it is
    /// still there after `wait`, or `None` if `stop` fired.
    pub async fn acquire_waiting(
        client: &Client,
        key: &str,
        ttl: Duration,
        wait: Duration,
        stop: &CancellationToken,
    ) -> Result<Result<Lease, Result<Holder, String>>, fred::error::Error> {
        let until = Instant::now() + wait;
        loop {
            match Self::try_acquire(client, key, ttl).await? {
                Acquired::Taken(lease) => return Ok(Ok(lease)),
                Acquired::Held(holder) if Instant::now() >= until || stop.is_cancelled() => {
                    return Ok(Err(holder))
                }
                Acquired::Held(_) => {
                    let pause = (ttl / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        _ = tokio::time::sleep(pause) => {}
                    }
                }
            }
        }
    }

    fn start(client: Client, key: &str, me: String, ttl: Duration) -> Lease {
        live().insert(key.to_owned(), me.clone());
        let lease = Lease {
            client,
            key: key.to_owned(),
            me,
            lost: CancellationToken::new(),
            stop: CancellationToken::new(),
        };
        tokio::spawn(renew(
            lease.client.clone(),
            lease.key.clone(),
            lease.me.clone(),
            ttl,
            lease.lost.clone(),
            lease.stop.clone(),
        ));
        lease
    }

    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The value identifying this process in the lease.
    pub fn value(&self) -> &str {
        &self.me
    }

    /// Fires when the lease is lost (taken by another after it lapsed, gone from Redis, or not
    /// renewable for a whole TTL): stop reading.
    pub fn lost(&self) -> &CancellationToken {
        &self.lost
    }

    /// Stops renewing and deletes the lease (if still ours), so another process may take it now.
    pub async fn release(self) {
        self.stop.cancel();
        let script = Script::from_lua(RELEASE_LUA);
        let released: Result<i64, _> = tokio::time::timeout(
            Duration::from_secs(2),
            script.evalsha_with_reload(&self.client, self.key.as_str(), vec![self.me.clone()]),
        )
        .await
        .unwrap_or_else(|_| {
            Err(fred::error::Error::new(
                fred::error::ErrorKind::Timeout,
                "timed out",
            ))
        });
        if let Err(e) = released {
            tracing::debug!(key = %self.key, error = %e, "could not release a lease; it lapses by itself");
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop.cancel();
        forget(&self.key, &self.me);
    }
}

/// Takes a lease of this process off the live ones (given up, lost or released).
fn forget(key: &str, me: &str) {
    let mut live = live();
    if live.get(key).map(String::as_str) == Some(me) {
        live.remove(key);
    }
}

async fn renew(
    client: Client,
    key: String,
    me: String,
    ttl: Duration,
    lost: CancellationToken,
    stop: CancellationToken,
) {
    let script = Script::from_lua(RENEW_LUA);
    let every = (ttl / 3).max(Duration::from_millis(10));
    let mut renewed = Instant::now();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let ttl_ms = ttl.as_millis().max(1) as u64;
        let call = script.evalsha_with_reload::<i64, _, _>(
            &client,
            key.as_str(),
            vec![me.clone(), ttl_ms.to_string()],
        );
        match tokio::time::timeout(every, call).await {
            Ok(Ok(1)) => renewed = Instant::now(),
            Ok(Ok(-1)) => {
                // Not another holder: Redis lost the key (a restart without persistence, a
                // flush, an eviction). The holder takes it again.
                tracing::warn!(
                    key,
                    "the lease vanished from Redis (did it lose its data?); taking it again"
                );
                lost.cancel();
                return;
            }
            Ok(Ok(_)) => {
                tracing::error!(key, "lost the lease to another process; stopping");
                lost.cancel();
                return;
            }
            Ok(Err(e)) => tracing::debug!(key, error = %e, "could not renew the lease"),
            Err(_) => tracing::debug!(key, "renewing the lease timed out"),
        }
        if renewed.elapsed() >= ttl {
            // Not renewed for a whole TTL: another process may hold it by now.
            tracing::warn!(
                key,
                "could not renew the lease for a whole TTL; stopping until it is taken again"
            );
            forget(&key, &me);
            lost.cancel();
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_round_trip_and_are_alive() {
        let me = Holder::this_process();
        assert_eq!(Holder::decode(&me.encode(7)).as_ref(), Some(me));
        assert!(!me.is_dead_here());
        assert!(Holder::decode("garbage").is_none());
        let gone = Holder {
            pid: 0x7fff_fff0,
            ..me.clone()
        };
        assert!(gone.is_dead_here(), "a pid that does not exist is dead");
        let elsewhere = Holder {
            host: "other-host".into(),
            ..gone.clone()
        };
        assert!(!elsewhere.is_dead_here(), "cannot tell for another host");
    }

    /// A lease this process gave up (not renewable for a whole TTL, say through a cut from
    /// Redis) while Redis kept its key is this process's own: taken back at once, not waited
    /// out as another process's. A lease it still holds is not taken twice.
    #[tokio::test]
    async fn a_lease_this_process_gave_up_is_taken_back_at_once() {
        let redis = batch_testkit::RedisServer::start();
        let client = batch_redis::connect(&redis.url(), &Default::default())
            .await
            .unwrap();
        let key = "{llm-d-async:results:pool-a:$batch}:lease";
        let ttl = Duration::from_secs(30);
        let Acquired::Taken(first) = Lease::try_acquire(&client, key, ttl).await.unwrap() else {
            panic!("a free lease is taken");
        };
        match Lease::try_acquire(&client, key, ttl).await.unwrap() {
            Acquired::Held(Ok(h)) => assert_eq!(&h, Holder::this_process()),
            _ => panic!("a lease held live here is not taken twice"),
        }
        // What the renewer does when it gives up: stop renewing and forget the lease; the key
        // stays in Redis until its TTL runs out.
        first.stop.cancel();
        forget(&first.key, &first.me);
        assert_eq!(
            redis.command(&["GET", key]),
            first.me,
            "the key outlives the give-up"
        );
        let Acquired::Taken(again) = Lease::try_acquire(&client, key, ttl).await.unwrap() else {
            panic!("a lease this process gave up is its own to take back");
        };
        assert_ne!(again.value(), first.value());
        drop(first);
        match Lease::try_acquire(&client, key, ttl).await.unwrap() {
            Acquired::Held(Ok(_)) => {}
            _ => panic!("dropping the old lease does not free the new one"),
        }
        again.release().await;
    }
}
