//! A whole job's requests at once: streamed in, searched for, and withdrawn.
//!
//! The caller hands over its lines as an iterator (reading them from disk is its business); the
//! producer runs the iterator on a blocking thread, builds each member there, and keeps a
//! bounded number of chunks in flight to Redis while the next ones are built.

use std::collections::HashSet;

use batch_wire::Envelope;
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::mpsc;

use crate::{JobMessages, PendingMember, Producer, ProducerError, RemoveReport};

/// One line of a job to enqueue.
#[derive(Debug, Clone)]
pub struct Request {
    /// 0-based line index in the job.
    pub index: u64,
    /// Its score in the request set ([`JobMessages::score_at`]).
    pub score: f64,
    /// The input line.
    pub line: Vec<u8>,
}

/// Why a streamed operation stopped: the caller's lines, or the producer.
#[derive(Debug, thiserror::Error)]
pub enum StreamError<E> {
    /// The iterator of lines yielded this error.
    #[error(transparent)]
    Source(E),
    /// Redis failed, a line could not be made a member, or the producer was stopped.
    #[error(transparent)]
    Producer(#[from] ProducerError),
}

/// What [`Producer::enqueue_requests`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Enqueued {
    /// Members sent.
    pub sent: u64,
    /// Members that were new to the set.
    pub added: u64,
}

/// Runs `source` on a blocking thread, turning each item into a `T` with `build`, and sends
/// them on in chunks of `chunk`. One chunk is built ahead of the one being sent: building is
/// much faster than sending, and every chunk held is megabytes.
fn chunks<I, E, T, F>(
    source: I,
    chunk: usize,
    build: F,
) -> mpsc::Receiver<Result<Vec<T>, StreamError<E>>>
where
    I: IntoIterator + Send + 'static,
    I::IntoIter: Send,
    E: Send + 'static,
    T: Send + 'static,
    F: Fn(I::Item) -> Result<T, StreamError<E>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(1);
    tokio::task::spawn_blocking(move || {
        let send = |item| tx.blocking_send(item).is_ok();
        let mut batch = Vec::with_capacity(chunk);
        for item in source {
            match build(item) {
                Ok(t) => batch.push(t),
                Err(e) => return send(Err(e)),
            }
            if batch.len() == chunk && !send(Ok(std::mem::take(&mut batch))) {
                return false;
            }
        }
        batch.is_empty() || send(Ok(batch))
    });
    rx
}

impl Producer {
    /// ZADDs the member of every request into the job's request set, building members on a
    /// blocking thread while up to `depth` earlier chunks are sent.
    pub async fn enqueue_requests<I, E>(
        &self,
        job: &JobMessages,
        requests: I,
    ) -> Result<Enqueued, StreamError<E>>
    where
        I: IntoIterator<Item = Result<Request, E>> + Send + 'static,
        I::IntoIter: Send,
        E: Send + 'static,
    {
        let msgs = job.clone();
        let mut rx = chunks(requests, self.options.chunk.max(1), move |r| {
            let r = r.map_err(StreamError::Source)?;
            Ok((r.score, msgs.member(r.index, &r.line)?))
        });
        let mut in_flight = FuturesUnordered::new();
        let mut done = Enqueued::default();
        let mut failure = None;
        while let Some(chunk) = rx.recv().await {
            let chunk = match chunk {
                Ok(c) => c,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            };
            done.sent += chunk.len() as u64;
            in_flight.push(self.enqueue_scored(&job.request_queue, chunk));
            while in_flight.len() >= self.options.depth.max(1) {
                done.added += in_flight.next().await.expect("not empty")?;
            }
        }
        while let Some(added) = in_flight.next().await {
            done.added += added?;
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(done),
        }
    }

    /// Line indexes of `job_id`'s requests the dispatcher holds in some form: in one of
    /// `request_queues` or in `retry_queue` (matched by request id, whatever bytes the
    /// dispatcher re-wrote them with), or claimed by a v0.10 dispatcher.
    pub async fn held_lines(
        &self,
        job_id: &str,
        request_queues: &[&str],
        retry_queue: &str,
    ) -> Result<HashSet<u64>, ProducerError> {
        let prefix = batch_wire::request_id_prefix(job_id);
        let mut held = HashSet::new();
        let mut keep = |id: &str| {
            if let Some((job, index)) = batch_wire::split_request_id(id) {
                if job == job_id {
                    held.insert(index);
                }
            }
        };
        let mut sets: Vec<&str> = request_queues.to_vec();
        sets.push(retry_queue);
        sets.sort_unstable();
        sets.dedup();
        for set in &sets {
            for member in self.scan_members(set, &member_pattern(&prefix)).await? {
                if let Ok(envelope) = Envelope::parse(&member) {
                    keep(&envelope.data.id);
                }
            }
        }
        for queue in sets.iter().filter(|s| **s != retry_queue) {
            let claimed = batch_keys::claimed_key(queue);
            for field in self.scan_fields(&claimed, &format!("{prefix}*")).await? {
                keep(field.split('\0').next().unwrap_or_default());
            }
        }
        Ok(held)
    }

    /// Takes `lines` of the job — (index, input line) — out of its request set, marks those
    /// the dispatcher may have in hand, a chunk at a time, then removes what is left of the job
    /// in the request set and in `retry_queue` whatever bytes the dispatcher re-wrote it with.
    pub async fn withdraw<I, E>(
        &self,
        job: &JobMessages,
        lines: I,
        retry_queue: &str,
    ) -> Result<RemoveReport, StreamError<E>>
    where
        I: IntoIterator<Item = Result<(u64, Vec<u8>), E>> + Send + 'static,
        I::IntoIter: Send,
        E: Send + 'static,
    {
        let msgs = job.clone();
        let mut rx = chunks(lines, self.options.chunk.max(1), move |l| {
            let (index, line) = l.map_err(StreamError::Source)?;
            Ok(msgs.pending(index, &line)?)
        });
        let mut report = RemoveReport::default();
        while let Some(chunk) = rx.recv().await {
            let pending: Vec<PendingMember> = chunk?;
            let r = self.remove(&job.request_queue, &pending).await?;
            report.removed += r.removed;
            report.marked += r.marked;
        }
        let pattern = member_pattern(&batch_wire::request_id_prefix(&job.job_id));
        for set in [job.request_queue.as_str(), retry_queue] {
            let leftovers: Vec<String> = self
                .scan_members(set, &pattern)
                .await?
                .into_iter()
                .filter(|m| {
                    Envelope::parse(m).is_ok_and(|e| {
                        batch_wire::split_request_id(&e.data.id)
                            .is_some_and(|(j, _)| j == job.job_id)
                    })
                })
                .collect();
            if !leftovers.is_empty() {
                report.removed += self.remove_exact(set, &leftovers).await?;
            }
        }
        Ok(report)
    }
}

/// The ZSCAN pattern of members whose id starts with `prefix`.
fn member_pattern(prefix: &str) -> String {
    format!("*\"id\":\"{prefix}*")
}
