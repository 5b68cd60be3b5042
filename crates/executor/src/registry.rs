//! The jobs a replica runs, as the result consumers see them.

use std::collections::HashMap;
use std::sync::{Arc, RwLock, Weak};

use batch_consumer::{HandlerError, ResultHandler, Routed, WriteReport};
use batch_producer::request_token;
use batch_sink::Written;

use crate::job::Job;
use crate::metrics::Tally;

/// Active jobs by id; writes each routed result into its job's files.
///
/// Held weakly: a job its caller dropped (prepared, never run) is gone, and so is the lock on
/// its directory.
#[derive(Default)]
pub(crate) struct Registry {
    jobs: RwLock<HashMap<String, Weak<Job>>>,
}

impl Registry {
    pub(crate) fn insert(&self, job: Arc<Job>) {
        let mut jobs = self.jobs.write().expect("registry lock");
        jobs.retain(|_, j| j.strong_count() > 0);
        jobs.insert(job.id.clone(), Arc::downgrade(&job));
    }

    pub(crate) fn remove(&self, id: &str) {
        self.jobs.write().expect("registry lock").remove(id);
    }

    fn get(&self, id: &str) -> Option<Arc<Job>> {
        self.jobs.read().expect("registry lock").get(id)?.upgrade()
    }
}

impl ResultHandler for Registry {
    fn write(&self, results: &[Routed]) -> Result<WriteReport, HandlerError> {
        let mut report = WriteReport::default();
        // One lock, one flush and one round of metrics per job and batch.
        let same =
            |a: &Routed, b: &Routed| Arc::ptr_eq(&a.job_id, &b.job_id) || a.job_id == b.job_id;
        let mut by_job: Vec<(usize, &Routed)> = results.iter().enumerate().collect();
        if !by_job.windows(2).all(|w| same(w[0].1, w[1].1)) {
            by_job.sort_by(|a, b| a.1.job_id.cmp(&b.1.job_id));
        }
        for group in by_job.chunk_by(|a, b| same(a.1, b.1)) {
            // A job whose results are held is not written here: they are parked for it.
            let job = self.get(&group[0].1.job_id).filter(|j| !j.results_held());
            let Some(job) = job else {
                report.not_here.extend(group.iter().map(|(i, _)| *i));
                continue;
            };
            let created = job.created_at();
            let mut tally = Tally::default();
            let mut sink = job.sink.lock().expect("sink lock");
            for &(_, r) in group {
                if job.custom_id(r.index).is_none() {
                    // Not a line of this job: nobody else can use it either.
                    report.duplicates += 1;
                    continue;
                }
                if let Some(token) = r.result.request_token() {
                    // v0.10 echoes the token: another one means another attempt or job.
                    if token != request_token(&job.id, created, r.index) {
                        report.mismatched += 1;
                        continue;
                    }
                }
                let written = job
                    .record_unflushed(&mut sink, r.index, &r.result.outcome(), &mut tally)
                    .map_err(|e| HandlerError(e.to_string()))?;
                match written {
                    Written::Duplicate => report.duplicates += 1,
                    _ => report.written += 1,
                }
            }
            sink.flush().map_err(|e| HandlerError(e.to_string()))?;
            let counts = sink.counts();
            drop(sink);
            job.emit(tally, true);
            job.publish(counts);
        }
        Ok(report)
    }
}
