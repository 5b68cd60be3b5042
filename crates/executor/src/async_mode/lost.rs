//! Lost lines: which of a job's unresolved lines are nowhere in the dispatcher's hands and
//! have no result waiting, and putting them back. A v0.9 dispatcher holds what it is sending in
//! no Redis key, so a line is put back only once no answer can still come for it: after
//! `lost_request_timeout` without a result (counted from a resume too), two looks far enough
//! apart both miss it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use batch_producer::Producer;
use tokio_util::sync::CancellationToken;

use super::{requests, AsyncMode, ModelQueue};
use crate::job::Job;
use crate::metrics as m;
use crate::{blocking, ExecError};

/// Lines found missing by a look, and since when.
pub(super) type Suspects = HashMap<u32, Instant>;

impl AsyncMode {
    /// Puts back the unresolved lines whose requests are nowhere in the dispatcher's hands
    /// and whose results wait nowhere unread. Reads only those lines.
    ///
    /// With `confirm` = (suspects, after), a missing line is only put back when it was already
    /// missing `after` ago; the suspects left are returned for the next look.
    pub(super) async fn put_back_missing(
        &self,
        job: &Arc<Job>,
        queues: &[ModelQueue],
        producer: &Producer,
        confirm: Option<(Suspects, Duration)>,
        stop: &CancellationToken,
    ) -> Result<(u64, Suspects), ExecError> {
        let held = Arc::new(self.held_lines(job, queues, producer, stop).await?);
        let (mut known, after) = match confirm {
            Some((known, after)) => (Some(known), after),
            None => (None, Duration::ZERO),
        };
        let mut left = Suspects::new();
        let mut total = 0;
        for q in queues {
            let (j, model, held, mut known_here) =
                (job.clone(), q.model.clone(), held.clone(), known.take());
            let (missing, known_back, left_here) = blocking(move || {
                let now = Instant::now();
                let mut missing = Vec::new();
                let mut left = Suspects::new();
                for (pos, record) in j.unresolved_positions(&model)? {
                    if held.contains(&(record.line as u64)) {
                        continue;
                    }
                    if let Some(known) = &known_here {
                        match known.get(&record.line) {
                            Some(since) if now.duration_since(*since) >= after => {}
                            since => {
                                left.insert(record.line, since.copied().unwrap_or(now));
                                continue;
                            }
                        }
                    }
                    missing.push((pos, record));
                }
                if let Some(known) = &mut known_here {
                    known.retain(|line, _| !left.contains_key(line));
                }
                Ok((missing, known_here, left))
            })
            .await?;
            known = known_back;
            left.extend(left_here);
            let done = producer
                .enqueue_requests(&q.messages, requests(job, q, missing))
                .await?;
            if job.resumed && job.progress().borrow().dispatched == 0 {
                job.dispatched(done.sent);
                job.inflight.add(&q.model.model, done.sent);
            }
            m::pool_counter("batch_requests_requeued_total", &q.pool, done.added);
            total += done.added;
        }
        Ok((total, left))
    }

    /// Line indexes of the job whose requests the dispatcher holds in some form, or whose
    /// results wait unread in a list.
    async fn held_lines(
        &self,
        job: &Job,
        queues: &[ModelQueue],
        producer: &Producer,
        stop: &CancellationToken,
    ) -> Result<HashSet<u64>, ExecError> {
        let sets: Vec<&str> = queues
            .iter()
            .map(|q| q.messages.request_queue.as_str())
            .collect();
        let mut held = producer
            .held_lines(&job.id, &sets, self.retry_queue())
            .await?;
        let named: Vec<(&str, &str)> = queues
            .iter()
            .map(|q| (q.pool.as_str(), q.messages.result_queue.as_str()))
            .collect();
        let lists = self.readers.lists_to_search(&named)?;
        let waiting = batch_consumer::waiting_lines(&self.client, &lists, &job.id, stop)
            .await
            .map_err(batch_consumer::ListError::from)?;
        held.extend(waiting);
        Ok(held)
    }
}
