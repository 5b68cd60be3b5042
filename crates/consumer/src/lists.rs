//! Which result list a process reads, and which jobs a list's reader keeps results for.
//!
//! Each process reads result lists of its own, under their leases ([`claim_list`]). A job
//! registers in the registry of the list its requests name (`{<list>}:jobs`) and in its pool's
//! result routes ([`register_job`]): then whichever process reads that list, or any other list
//! of the pool, keeps its results for it instead of dropping them.

use std::collections::HashSet;
use std::time::Duration;

use batch_keys::{ListKeys, NameError, QueueNames};
use batch_redis::{Retry, RetryError};
use fred::clients::Client;
use fred::interfaces::{HashesInterface, KeysInterface};
use tokio_util::sync::CancellationToken;

use crate::{scripts, Acquired, Lease};

/// How many lists named `<consumer_id>`, `<consumer_id>-2`, ... a process tries by itself.
pub const AUTO_LISTS: usize = 64;

/// Why a process has no result list of its own, or a job could not be registered.
#[derive(Debug, thiserror::Error)]
pub enum ListError {
    /// Every list this process may take is read by another live process.
    #[error("{0}")]
    Held(String),
    /// The pool or consumer id cannot make a key.
    #[error(transparent)]
    Name(#[from] NameError),
    /// Redis failed for good, or the stop token fired while it was out.
    #[error(transparent)]
    Redis(#[from] RetryError),
}

impl ListError {
    /// The stop token fired while Redis was out.
    pub fn is_stopped(&self) -> bool {
        matches!(self, Self::Redis(RetryError::Stopped))
    }

    /// Whether waiting could cure it (a list another process reads may be freed).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Held(_) => true,
            Self::Name(_) => false,
            Self::Redis(RetryError::Stopped) => false,
            Self::Redis(RetryError::Failed { error, .. }) => batch_redis::is_transient(error),
        }
    }
}

/// Takes the lease of a result list of `pool` for this process.
///
/// With `explicit` (the consumer id was given) it is the list `names` gives or nothing: a holder
/// that stopped renewing lapses within one `ttl`, so it waits that long. Otherwise it is the
/// first free list of `$batch`, `$batch-2`, ... up to [`AUTO_LISTS`].
pub async fn claim_list(
    client: &Client,
    names: &QueueNames,
    pool: &str,
    ttl: Duration,
    explicit: bool,
    stop: &CancellationToken,
) -> Result<(String, Lease), ListError> {
    if explicit {
        let list = names.result_queue_name(pool)?;
        let keys = ListKeys::new(&list);
        let wait = ttl + Duration::from_secs(1);
        let taken = Retry::new(format!("taking {}", keys.lease))
            .run(stop, || {
                Lease::acquire_waiting(client, &keys.lease, ttl, wait, stop)
            })
            .await?;
        return match taken {
            Ok(lease) => Ok((list, lease)),
            Err(holder) => {
                let who = holder.map_or_else(|raw| raw, |h| h.to_string());
                Err(ListError::Held(format!(
                    "result list {list} is read by another live process ({who}); give each process its own async_dispatch.consumer_id, or leave it unset to have one picked"
                )))
            }
        };
    }
    for n in 1..=AUTO_LISTS {
        let list = names.numbered(n).result_queue_name(pool)?;
        let keys = ListKeys::new(&list);
        let taken = Retry::new(format!("taking {}", keys.lease))
            .run(stop, || Lease::try_acquire(client, &keys.lease, ttl))
            .await?;
        if let Acquired::Taken(lease) = taken {
            return Ok((list, lease));
        }
    }
    let base = names.consumer_id();
    Err(ListError::Held(format!(
        "all {AUTO_LISTS} result lists of pool {pool} ({base} to {base}-{AUTO_LISTS}) are read by other processes"
    )))
}

/// Registers `job` (whose requests name `list`, until `deadline`, Unix s) in the list's
/// registry and in the pool's result `routes`, waiting out Redis outages until `stop` fires.
///
/// Idempotent: a job registers again whenever Redis may have lost its entries.
pub async fn register_job(
    client: &Client,
    list: &str,
    routes: &str,
    job: &str,
    deadline: i64,
    stop: &CancellationToken,
) -> Result<(), RetryError> {
    let keys = ListKeys::new(list);
    let route = route_value(deadline, list);
    Retry::new(format!("HSET {}", keys.jobs))
        .run(stop, || async {
            client.hset::<(), _, _>(&keys.jobs, (job, deadline)).await?;
            client.hset::<(), _, _>(routes, (job, route.as_str())).await
        })
        .await
}

/// Forgets `job` in `list`'s registry and the pool's result `routes`: later results of it are
/// dropped. Tries once; an entry left behind lapses at the job's deadline.
pub async fn unregister_job(
    client: &Client,
    list: &str,
    routes: &str,
    job: &str,
) -> Result<(), fred::error::Error> {
    client.hdel::<i64, _, _>(routes, job).await?;
    client
        .hdel::<i64, _, _>(&ListKeys::new(list).jobs, job)
        .await?;
    Ok(())
}

/// The list whose reader last handed results on to `list` (the dispatcher's queue entry names
/// that one), if any other.
pub async fn handed_from(
    client: &Client,
    list: &str,
) -> Result<Option<String>, fred::error::Error> {
    let from: Option<String> = client.get(&ListKeys::new(list).handed_from).await?;
    Ok(from.filter(|f| f != list))
}

/// Line indexes of `job` whose results wait unread anywhere a reader of one of `lists` keeps
/// them ([`waiting_ids`]), waiting out Redis outages until `stop` fires.
pub async fn waiting_lines(
    client: &Client,
    lists: &[String],
    job: &str,
    stop: &CancellationToken,
) -> Result<HashSet<u64>, RetryError> {
    let prefix = batch_wire::request_id_prefix(job);
    let mut lines = HashSet::new();
    for list in lists {
        let ids = Retry::new(format!("reading the results waiting in {list}"))
            .run(stop, || waiting_ids(client, list, job, &prefix))
            .await?;
        lines.extend(ids.iter().filter_map(|id| {
            let (j, index) = batch_wire::split_request_id(id)?;
            (j == job).then_some(index)
        }));
    }
    Ok(lines)
}

/// Ids starting with `prefix` of the results waiting anywhere a reader of `list` keeps them:
/// the list, its in-flight list, and the parked list of `job` with its own in-flight list.
///
/// The lost-line search asks this before it puts a line back: a line whose result waits
/// unread is not lost.
pub async fn waiting_ids(
    client: &Client,
    list: &str,
    job: &str,
    prefix: &str,
) -> Result<Vec<String>, fred::error::Error> {
    let keys = ListKeys::new(list);
    let parked = ListKeys::parked(list, job);
    let mut out = Vec::new();
    for key in [&keys.list, &keys.inflight, &parked.list, &parked.inflight] {
        out.extend(scripts::ids_in_list(client, key, prefix, 1000).await?);
    }
    Ok(out)
}

/// Says, once per process, that the dispatcher sends results of requests that name
/// `requested` to `actual`: its queue entry sets `result_queue_name`.
pub fn warn_lists_differ(requested: &str, actual: &str) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            requested,
            actual,
            "the dispatcher sends results of requests that name {requested} to {actual}: its queue entry for the pool sets result_queue_name. Each result is handed on to the process that runs its job, one hop later, and waits while no process reads {actual}. Remove result_queue_name from the queue entry so that each process reads its own list, or run one process per pool with async_dispatch.consumer_id set to the list's last part"
        );
    }
}

/// A route's value: `<deadline> <list>`.
pub(crate) fn parse_route(value: &str) -> Option<(i64, &str)> {
    let (deadline, list) = value.split_once(' ')?;
    Some((deadline.parse().ok()?, list))
}

/// The value of a job's route: its deadline and the result list its requests name.
pub fn route_value(deadline: i64, list: &str) -> String {
    format!("{deadline} {list}")
}
