//! Draining the in-flight list: batches read and routed ahead, written by the handler, then
//! acknowledged, the three stages overlapping.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use batch_keys::ListKeys;
use batch_redis::Backoff;
use batch_wire::{split_request_id, RawResult};
use fred::bytes_utils::Str;
use fred::interfaces::{HashesInterface, ListInterface};
use tokio_util::sync::CancellationToken;

use crate::lists::{parse_route, warn_lists_differ};
use crate::{now_unix, scripts, ConsumerStats, Halt, Lease, ResultConsumer, Routed};

impl ResultConsumer {
    /// Writes everything in the in-flight list (`len` results), oldest first, a batch at a
    /// time, acknowledging each batch once written; returns how many results it read.
    ///
    /// Three stages overlap: batches are read and parsed ahead (on a blocking thread), one is
    /// written (on another) while the one before it is acknowledged. Acknowledgements stay in
    /// order, each sent once the one before it is applied. Nothing else adds to the list
    /// meanwhile, and acknowledgements trim its right end, so positions counted from the left
    /// stay where they were when reading began.
    pub(crate) async fn drain_in_flight(
        &self,
        len: u64,
        lease: &Lease,
        shutdown: &CancellationToken,
    ) -> Result<u64, Halt> {
        let (tx, rx) = tokio::sync::mpsc::channel(READ_AHEAD);
        let (read, written) = tokio::join!(
            self.read_ahead(len, tx),
            self.write_and_ack(rx, lease, shutdown)
        );
        // The writer stopping first (shut down, lease lost) ends the reader; a read error ends
        // the writer once it has written what was read before it.
        written?;
        read
    }

    /// Reads and parses the `len` in-flight results a batch at a time, oldest first, into
    /// `tx` until the writer stops taking them; returns how many it read. Each batch is parsed
    /// while the next one is read.
    async fn read_ahead(
        &self,
        len: u64,
        tx: tokio::sync::mpsc::Sender<Taken>,
    ) -> Result<u64, Halt> {
        let batch = self.options.batch.max(1) as u64;
        let range = |end: u64| (end.saturating_sub(batch), end);
        let mut read = 0;
        let (mut start, end) = range(len);
        let mut items = self.read_in_flight(start, end).await?;
        while !items.is_empty() {
            read += items.len() as u64;
            let parse = async {
                let stats = self.stats.clone();
                let list = self.keys.list.clone();
                tokio::task::spawn_blocking(move || {
                    let routed = route_batch(&stats, &list, &items);
                    Taken { items, routed }
                })
                .await
                .map_err(|e| Halt::Error(format!("parsing results failed: {e}")))
            };
            let (next_start, next_end) = range(start);
            let (next, parsed) = tokio::join!(self.read_in_flight(next_start, next_end), parse);
            if tx.send(parsed?).await.is_err() {
                break;
            }
            items = next?;
            start = next_start;
        }
        Ok(read)
    }

    /// The in-flight results at positions `start..end` from the left, in list order (newest
    /// first).
    async fn read_in_flight(&self, start: u64, end: u64) -> Result<Vec<Str>, Halt> {
        if start >= end {
            return Ok(Vec::new());
        }
        let items = self
            .client
            .lrange(&self.keys.inflight, start as i64, end as i64 - 1)
            .await?;
        Ok(items)
    }

    /// Writes each batch `rx` brings and acknowledges it, the acknowledgement of one
    /// overlapping the write of the next.
    async fn write_and_ack(
        &self,
        mut rx: tokio::sync::mpsc::Receiver<Taken>,
        lease: &Lease,
        shutdown: &CancellationToken,
    ) -> Result<(), Halt> {
        let mut written: Option<Unacked> = None;
        while let Some(taken) = rx.recv().await {
            let previous = written.take();
            let ack = async {
                match &previous {
                    Some(w) => self.ack(lease, &w.items, &w.not_here).await,
                    None => Ok(()),
                }
            };
            let (acked, handled) = tokio::join!(ack, self.handle(&taken.routed, shutdown));
            acked?;
            let Some(not_here) = handled else {
                // Shutting down: what is not written stays in flight for the next reader.
                return Ok(());
            };
            written = Some(Unacked {
                items: taken.items,
                not_here,
            });
        }
        if let Some(w) = written {
            self.ack(lease, &w.items, &w.not_here).await?;
        }
        Ok(())
    }

    /// Removes a written batch (list order) from flight, parking the results of jobs that
    /// run elsewhere.
    async fn ack(
        &self,
        lease: &Lease,
        items: &[Str],
        not_here: &[(usize, String)],
    ) -> Result<(), Halt> {
        let now = now_unix();
        let handed;
        let not_here = if not_here.is_empty() || self.options.routes.is_none() {
            not_here
        } else {
            handed = self.hand_on(items, not_here, now).await?;
            handed.as_slice()
        };
        let acked = self
            .scripts
            .ack(
                &self.client,
                &self.keys,
                lease.value(),
                items,
                not_here,
                now,
            )
            .await?;
        match acked {
            scripts::Ack::Done { parked } => {
                let dropped = not_here.len() as u64 - parked;
                self.stats.parked_and_dropped(parked, dropped);
                if dropped > 0 {
                    tracing::warn!(results = %self.keys.list, count = dropped, "dropped results of jobs that exist nowhere");
                }
                Ok(())
            }
            scripts::Ack::LeaseLost => Err(Halt::LeaseLost),
            scripts::Ack::Mismatch => Err(Halt::Error(
                "the in-flight list changed under its reader".into(),
            )),
        }
    }

    /// Pushes the results of `not_here` whose jobs' requests name another list onto that list
    /// (oldest first, as the dispatcher would have); returns the rest, for the acknowledgement
    /// to park or drop.
    async fn hand_on(
        &self,
        items: &[Str],
        not_here: &[(usize, String)],
        now: i64,
    ) -> Result<Vec<(usize, String)>, Halt> {
        let Some(routes) = &self.options.routes else {
            return Ok(not_here.to_vec());
        };
        let mut jobs: Vec<&str> = not_here.iter().map(|(_, j)| j.as_str()).collect();
        jobs.sort_unstable();
        jobs.dedup();
        let found: Vec<Option<String>> = self.client.hmget(routes, jobs.clone()).await?;
        let mut to: HashMap<&str, String> = HashMap::new();
        for (job, route) in jobs.iter().zip(found) {
            let Some((deadline, list)) = route.as_deref().and_then(parse_route) else {
                continue;
            };
            if deadline > now && list != self.keys.base() {
                to.insert(job, list.to_owned());
            }
        }
        if to.is_empty() {
            return Ok(not_here.to_vec());
        }
        let mut rest = Vec::new();
        let mut by_list: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (pos, job) in not_here {
            match to.get(job.as_str()) {
                Some(list) => by_list.entry(list).or_default().push(*pos),
                None => rest.push((*pos, job.clone())),
            }
        }
        for (list, mut positions) in by_list {
            // Oldest (rightmost, highest position) first, so it ends rightmost there too.
            positions.sort_unstable_by(|a, b| b.cmp(a));
            let moved: Vec<&Str> = positions.iter().filter_map(|&p| items.get(p)).collect();
            self.scripts
                .hand_on(&self.client, &ListKeys::new(list), &self.keys.list, &moved)
                .await?;
            self.stats.handed_on(moved.len() as u64);
            warn_lists_differ(list, &self.keys.list);
        }
        Ok(rest)
    }

    /// Writes a routed batch, retrying the handler until it succeeds. Returns the (list
    /// position, job) of results of jobs not here, or `None` when shut down first.
    async fn handle(
        &self,
        batch: &RoutedBatch,
        shutdown: &CancellationToken,
    ) -> Option<Vec<(usize, String)>> {
        self.stats.received(batch.received);
        let RoutedBatch {
            positions, routed, ..
        } = batch;
        if routed.is_empty() {
            return Some(Vec::new());
        }
        let mut backoff = Backoff::new(self.options.min_backoff, self.options.max_backoff);
        let mut failing = false;
        loop {
            let handler = self.handler.clone();
            let batch = routed.clone();
            match tokio::task::spawn_blocking(move || handler.write(&batch)).await {
                Ok(Ok(report)) => {
                    if failing {
                        tracing::info!(results = %self.keys.list, "results are written again");
                    }
                    self.stats.report(&report);
                    return Some(
                        report
                            .not_here
                            .iter()
                            .filter_map(|&i| {
                                Some((*positions.get(i)?, routed.get(i)?.job_id.to_string()))
                            })
                            .collect(),
                    );
                }
                Ok(Err(e)) if !failing => {
                    failing = true;
                    tracing::error!(error = %e, "could not write results; they stay in flight and are retried (logged once until it recovers)")
                }
                Ok(Err(e)) => tracing::debug!(error = %e, "still cannot write results"),
                Err(e) => tracing::error!(error = %e, "result handler panicked; retrying"),
            }
            self.stats.handler_error();
            if !backoff.wait(shutdown).await {
                return None;
            }
        }
    }
}

/// Batches read ahead of the one being written: each is about a megabyte per 1,000 results.
const READ_AHEAD: usize = 1;

/// A batch read from flight: as it is in the list (newest first), and parsed.
struct Taken {
    items: Vec<Str>,
    routed: RoutedBatch,
}

/// A batch written and not yet acknowledged.
struct Unacked {
    /// As it is in the list.
    items: Vec<Str>,
    /// The (list position, job) of results of jobs not here.
    not_here: Vec<(usize, String)>,
}

/// Parses and routes `items` (list order), oldest first; malformed ones are counted and left
/// out.
fn route_batch(stats: &ConsumerStats, list: &str, items: &[Str]) -> RoutedBatch {
    // Oldest first: the rightmost item is the oldest.
    let mut positions = Vec::with_capacity(items.len());
    let mut routed = Vec::with_capacity(items.len());
    let mut last_job: Option<Arc<str>> = None;
    for (pos, raw) in items.iter().enumerate().rev() {
        if let Some(r) = route(stats, list, raw, &mut last_job) {
            positions.push(pos);
            routed.push(r);
        }
    }
    RoutedBatch {
        received: items.len() as u64,
        positions,
        routed: Arc::new(routed),
    }
}

/// Parses and routes one element; `last_job` is the job of the one before, whose name is
/// shared rather than copied when this one belongs to it too.
fn route(
    stats: &ConsumerStats,
    list: &str,
    raw: &Str,
    last_job: &mut Option<Arc<str>>,
) -> Option<Routed> {
    let result = match RawResult::parse(raw.clone()) {
        Ok(r) => r,
        Err(e) => {
            stats.malformed();
            tracing::warn!(results = %list, error = %e, message = %preview(raw), "dropped a malformed result");
            return None;
        }
    };
    let by_metadata = || {
        let m = result.metadata()?;
        Some((
            Cow::Borrowed(m.get("job_id")?.as_str()),
            m.get("request_index")?.parse().ok()?,
        ))
    };
    let Some((job, index)) = split_request_id(result.id()).or_else(by_metadata) else {
        stats.malformed();
        tracing::warn!(results = %list, id = %preview(result.id()), "dropped a result whose id names no job");
        return None;
    };
    let job_id = match last_job {
        Some(last) if **last == *job => last.clone(),
        _ => last_job.insert(Arc::from(job.as_ref())).clone(),
    };
    Some(Routed {
        job_id,
        index,
        result,
    })
}

/// A batch of results parsed and routed, oldest first.
struct RoutedBatch {
    /// Results read, the malformed ones included.
    received: u64,
    /// The list position of each result.
    positions: Vec<usize>,
    routed: Arc<Vec<Routed>>,
}

fn preview(raw: &str) -> String {
    let mut end = raw.len().min(200);
    while !raw.is_char_boundary(end) {
        end -= 1;
    }
    raw[..end].to_owned()
}
