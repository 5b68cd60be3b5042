//! The jobs a replica runs, as the result consumers see them.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use batch_consumer::{HandlerError, ResultHandler, Routed, WriteReport};
use batch_sink::Written;

use crate::job::Job;
use crate::metrics::Tally;

/// Active jobs by id; writes each routed result into its job's files.
#[derive(Default)]
pub(crate) struct Registry {
    jobs: RwLock<HashMap<String, Arc<Job>>>,
}

impl Registry {
    pub(crate) fn insert(&self, job: Arc<Job>) {
        self.jobs
            .write()
            .expect("registry lock")
            .insert(job.id.clone(), job);
    }

    pub(crate) fn remove(&self, id: &str) {
        self.jobs.write().expect("registry lock").remove(id);
    }

    fn get(&self, id: &str) -> Option<Arc<Job>> {
        self.jobs.read().expect("registry lock").get(id).cloned()
    }
}

impl ResultHandler for Registry {
    fn write(&self, results: &[Routed]) -> Result<WriteReport, HandlerError> {
        let mut report = WriteReport::default();
        // One lock, one flush and one round of metrics per job and batch.
        let mut by_job: Vec<&Routed> = results.iter().collect();
        by_job.sort_by(|a, b| a.job_id.cmp(&b.job_id));
        for group in by_job.chunk_by(|a, b| a.job_id == b.job_id) {
            let Some(job) = self.get(&group[0].job_id) else {
                report.unknown_job += group.len() as u64;
                continue;
            };
            let mut tally = Tally::default();
            let mut sink = job.sink.lock().expect("sink lock");
            for r in group {
                if job.custom_id(r.index).is_none() {
                    report.unknown_job += 1;
                    continue;
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
