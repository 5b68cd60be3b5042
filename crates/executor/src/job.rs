//! One active job: its Batch object, plan, input, result files and progress.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use batch_plan::{InputFile, Plan, PlanError, Record};
use batch_sink::{JobSink, Written};
use batch_wire::{Batch, BatchErrors, BatchStatus, Outcome, RequestCounts};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::watch;

use crate::dir::{InputRecord, JobDir, Manifest};
use crate::metrics as m;
use crate::ExecError;

mod checkpoint;

pub use checkpoint::{restore_checkpoint, Checkpoint};

/// What a caller asks to run.
#[derive(Debug, Clone)]
pub struct JobSpec {
    /// The batch input file (JSONL).
    pub input: PathBuf,
    /// Where `output.jsonl`, `error.jsonl` and `batch.json` go. Running a spec again with the
    /// same directory resumes the job there.
    pub output_dir: PathBuf,
    /// The job id; generated (`batch_<hex>`) when absent. Taken from `batch.json` on resume.
    pub job_id: Option<String>,
    /// The completion window: the job's SLO deadline is its creation time plus this.
    pub completion_window: Duration,
    /// Headers added to every request of the job.
    pub headers: BTreeMap<String, String>,
    /// When the job was created (Unix seconds), if before this run: the deadline counts from
    /// it. `None`: now.
    pub created_at: Option<i64>,
    /// The one `url` every line must name (a batch's `endpoint`); a line naming another fails
    /// validation with `url_mismatch`. `None`: each line names its own.
    pub endpoint: Option<String>,
    /// Permits shared with other jobs (the service gives one per tenant): in sync mode each
    /// request of the job holds one while it is sent, so the jobs sharing it have at most its
    /// size in flight together. Async mode ignores it: the dispatcher meters requests there.
    pub request_slots: Option<std::sync::Arc<tokio::sync::Semaphore>>,
    /// Jobs naming the same share (the service names each job's tenant) have together, per
    /// model, at most as many requests waiting for or holding the endpoint's limit as one job
    /// alone has, in sync mode, and the limit, served to the shares waiting for it in turn,
    /// is shared among shares rather than among jobs: a tenant running three batches does not
    /// get three times the requests of a tenant running one. `None`: the job is a share of its
    /// own.
    pub share: Option<String>,
}

impl JobSpec {
    /// A spec with a 24 h window, a generated id and no extra headers.
    pub fn new(input: impl Into<PathBuf>, output_dir: impl Into<PathBuf>) -> Self {
        Self {
            input: input.into(),
            output_dir: output_dir.into(),
            job_id: None,
            completion_window: Duration::from_secs(24 * 3600),
            headers: BTreeMap::new(),
            created_at: None,
            endpoint: None,
            request_slots: None,
            share: None,
        }
    }

    /// How long until the job's deadline: the one recorded in its directory when it ran
    /// before, its window from now when it is new (or its `batch.json` cannot be read, which
    /// preparing it will report); `None` when it has ended.
    pub fn time_left(&self) -> Option<Duration> {
        match JobDir::batch_at(&self.output_dir) {
            Ok(Some(b)) if b.status.is_terminal() => None,
            Ok(Some(b)) => {
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs() as i64);
                Some(Duration::from_secs(
                    b.expires_at.saturating_sub(now).max(0) as u64
                ))
            }
            _ => Some(self.completion_window),
        }
    }
}

/// Where a job stands, published while it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobProgress {
    /// The job id.
    pub job_id: String,
    /// Its status.
    pub status: BatchStatus,
    /// Its counters.
    pub counts: RequestCounts,
    /// Requests handed to the dispatcher (async) or sent (sync) by this run.
    pub dispatched: u64,
}

impl JobProgress {
    /// Requests still without a line.
    pub fn remaining(&self) -> u64 {
        self.counts.total - self.counts.completed - self.counts.failed
    }
}

pub(crate) fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn new_job_id() -> String {
    format!("batch_{:032x}", rand::random::<u128>())
}

/// How a job's dispatch ended: what a mode's [`crate::Dispatch::run`] returns.
#[derive(Debug)]
pub enum End {
    /// Every line has a result.
    Completed,
    /// The deadline passed first: open lines get `batch_expired`.
    Expired,
    /// The job was cancelled: open lines get `batch_cancelled`.
    Cancelled,
    /// Stopped to be resumed later (SIGTERM): nothing withdrawn, nothing closed.
    Paused,
    /// The mode could not go on: the job fails and open lines get `batch_failed`.
    Failed(JobFailure),
}

/// Why a job's dispatch failed; its text is what the job's error lines and log say.
#[derive(Debug, thiserror::Error)]
pub enum JobFailure {
    /// Dispatching returned an error (its `source()` chain kept).
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// Every call ended but some lines had no answer and no stop explains it.
    #[error("{0} requests were left without an answer")]
    Unanswered(u64),
}

/// A job being executed.
pub struct Job {
    pub(crate) id: String,
    /// Its directory, locked while the job lives.
    pub(crate) dir: JobDir,
    pub(crate) plan: Plan,
    pub(crate) input: InputFile,
    pub(crate) batch: Mutex<Batch>,
    pub(crate) sink: Mutex<JobSink>,
    /// Index into `plan.models()` of each line, for per-model metrics.
    pub(crate) model_of_line: Vec<u16>,
    pub(crate) headers: BTreeMap<String, String>,
    /// See [`JobSpec::request_slots`].
    pub(crate) request_slots: Option<std::sync::Arc<tokio::sync::Semaphore>>,
    /// See [`JobSpec::share`].
    pub(crate) share: Option<String>,
    pub(crate) resumed: bool,
    pub(crate) started: Instant,
    progress: watch::Sender<JobProgress>,
    last_result: Mutex<Instant>,
    pub(crate) manifest: Mutex<Manifest>,
    /// Its requests counted in `model_inflight_requests`.
    pub(crate) inflight: m::Inflight,
    /// See [`Job::hold_results`].
    results_held: std::sync::atomic::AtomicBool,
    /// Fired by [`Job::yield_slot`].
    pub(crate) yielding: tokio_util::sync::CancellationToken,
}

/// The batch of an unfinished job found in its directory, when it is the job `spec` asks for.
fn resume(spec: &JobSpec, batch: Batch) -> Result<Batch, ExecError> {
    if let Some(id) = spec.job_id.as_ref().filter(|id| **id != batch.id) {
        return Err(ExecError::OtherJob {
            dir: spec.output_dir.clone(),
            found: batch.id,
            wanted: id.clone(),
        });
    }
    tracing::info!(job = %batch.id, dir = %spec.output_dir.display(), status = batch.status.as_str(), "resuming job");
    Ok(batch)
}

/// The batch of a new job, written to its directory before anything else.
fn create(spec: &JobSpec, dir: &JobDir) -> Result<Batch, ExecError> {
    let id = spec.job_id.clone().unwrap_or_else(new_job_id);
    let created = spec.created_at.unwrap_or_else(now_unix);
    let window = humantime_window(spec.completion_window);
    let expires = batch_wire::deadline(created, spec.completion_window).ok_or_else(|| {
        ExecError::Config(format!(
            "the completion window {:?} is longer than the {}-day limit",
            spec.completion_window,
            batch_wire::MAX_COMPLETION_WINDOW.as_secs() / 86_400
        ))
    })?;
    let batch = Batch::new(
        id,
        spec.input.display().to_string(),
        window,
        created,
        expires,
    );
    dir.write_batch(&batch)?;
    Ok(batch)
}

/// Ends a job whose input is invalid: the batch failed, with every bad line listed.
fn fail_validation(
    dir: &JobDir,
    mut batch: Batch,
    errors: Vec<batch_wire::BatchError>,
) -> Result<Prepared, ExecError> {
    tracing::warn!(job = %batch.id, problems = errors.len(), "input file is invalid");
    batch.errors = Some(BatchErrors::new(errors));
    batch.set_status(BatchStatus::Failed, now_unix());
    dir.write_batch(&batch)?;
    m::job_processed(BatchStatus::Failed, "validation", None);
    Ok(Prepared::Finished(Box::new(batch)))
}

/// The index of each input line's model among the plan's models.
fn model_of_line(plan: &Plan) -> Result<Vec<u16>, ExecError> {
    let mut model_of_line = vec![0u16; plan.total() as usize];
    for (i, model) in plan.models().iter().enumerate() {
        for record in plan.records(model)? {
            let record = record.map_err(|e| ExecError::io(&model.path, e))?;
            model_of_line[record.line as usize] = i as u16;
        }
    }
    Ok(model_of_line)
}

/// Records in the batch what the plan and the sink know (endpoint, result files, counts so
/// far) and moves a validating batch to in progress.
fn start(dir: &JobDir, batch: &mut Batch, plan: &Plan, sink: &JobSink) -> Result<(), ExecError> {
    batch.endpoint = plan.endpoint().map(str::to_owned);
    batch.output_file_id = Some(batch_sink::OUTPUT_FILE.into());
    batch.error_file_id = Some(batch_sink::ERROR_FILE.into());
    batch.request_counts = sink.counts();
    if batch.status == BatchStatus::Validating {
        batch.set_status(BatchStatus::InProgress, now_unix());
    }
    dir.write_batch(batch)
}

/// A prepared job, or one that needs nothing more.
pub enum Prepared {
    /// Validated and ready to dispatch.
    Ready(std::sync::Arc<Job>),
    /// Already terminal (finished earlier, or failed validation now).
    Finished(Box<Batch>),
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("id", &self.id)
            .field("dir", &self.dir.path())
            .finish()
    }
}

impl Job {
    /// Creates or resumes the job of `spec`: reads `batch.json` if any, validates and plans the
    /// input, opens the result files.
    pub(crate) fn prepare(
        spec: &JobSpec,
        work_dir: &Path,
        limits: batch_plan::Limits,
    ) -> Result<Prepared, ExecError> {
        let dir = JobDir::open(&spec.output_dir)?;
        let (mut batch, resumed) = match dir.batch()? {
            Some(b) if b.status.is_terminal() => return Ok(Prepared::Finished(Box::new(b))),
            Some(b) => (resume(spec, b)?, true),
            None => (create(spec, &dir)?, false),
        };
        let plan_dir = work_dir.join(&batch.id).join("plan");
        let plan = match Plan::build(&spec.input, &plan_dir, limits) {
            Ok(plan) => plan,
            Err(PlanError::Invalid(errors)) => return fail_validation(&dir, batch, errors),
            Err(e) => return Err(e.into()),
        };
        let manifest = dir.tie_to_input(&batch.id, &spec.input, input_record(spec, &plan))?;
        let input = plan.open_input()?;
        let model_of_line = model_of_line(&plan)?;
        let sink = dir.open_sink(&batch.id, plan.total())?;
        start(&dir, &mut batch, &plan, &sink)?;
        let progress = watch::Sender::new(JobProgress {
            job_id: batch.id.clone(),
            status: batch.status,
            counts: batch.request_counts,
            dispatched: 0,
        });
        Ok(Prepared::Ready(std::sync::Arc::new(Job {
            id: batch.id.clone(),
            dir,
            plan,
            input,
            batch: Mutex::new(batch),
            sink: Mutex::new(sink),
            model_of_line,
            headers: spec.headers.clone(),
            request_slots: spec.request_slots.clone(),
            share: spec.share.clone(),
            resumed,
            started: Instant::now(),
            progress,
            last_result: Mutex::new(Instant::now()),
            manifest: Mutex::new(manifest),
            inflight: m::Inflight::default(),
            results_held: Default::default(),
            yielding: Default::default(),
        })))
    }

    /// The dispatch mode's own record of the job, kept in `job-state.json` across runs;
    /// `T::default()` when there is none. Its fields sit beside the manifest's own (`job_id`,
    /// `input`), which a mode's names must not take.
    pub fn mode_state<T: DeserializeOwned + Default>(&self) -> Result<T, ExecError> {
        let manifest = self.manifest.lock().expect("manifest lock");
        self.decode_mode_state(&manifest)
    }

    /// Changes the mode's record (see [`Job::mode_state`]) with `change`, which says whether it
    /// changed anything; a change is in `job-state.json` (written atomically) when this
    /// returns. Returns the record as it is then. Blocking file work.
    pub fn update_mode_state<T: Serialize + DeserializeOwned + Default>(
        &self,
        change: impl FnOnce(&mut T) -> bool,
    ) -> Result<T, ExecError> {
        let mut manifest = self.manifest.lock().expect("manifest lock");
        let mut state: T = self.decode_mode_state(&manifest)?;
        if change(&mut state) {
            let fields = match serde_json::to_value(&state) {
                Ok(serde_json::Value::Object(fields)) => fields,
                Ok(_) => return Err(self.bad_mode_state("a mode's record is not a JSON object")),
                Err(e) => return Err(self.bad_mode_state(e)),
            };
            let mut changed = manifest.clone();
            changed.mode.extend(fields);
            self.dir.write_manifest(&changed)?;
            *manifest = changed;
        }
        Ok(state)
    }

    fn decode_mode_state<T: DeserializeOwned + Default>(
        &self,
        manifest: &Manifest,
    ) -> Result<T, ExecError> {
        if manifest.mode.is_empty() {
            return Ok(T::default());
        }
        serde_json::from_value(serde_json::Value::Object(manifest.mode.clone()))
            .map_err(|e| self.bad_mode_state(e))
    }

    fn bad_mode_state(&self, e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> ExecError {
        let path = self.dir.path().join(crate::MANIFEST_FILE);
        ExecError::io(
            &path,
            std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        )
    }

    /// Holds back (or lets through again) the results that come for this job: while held,
    /// the result consumers leave them to the job's parked list instead of writing them here.
    /// A service holds them while it cannot confirm the job's lease: another replica may have
    /// taken the job over, and what this one wrote then would be lost with its run; parked,
    /// they reach whichever run holds the job.
    pub fn hold_results(&self, held: bool) {
        self.results_held
            .store(held, std::sync::atomic::Ordering::SeqCst);
    }

    /// Stops the run to give its slot back (a service's preemption for a fairer share): it
    /// takes no new line, lets the requests in flight end where its mode can (sync mode; async
    /// mode leaves its queued requests where they are, as at a pause), and ends paused, to be
    /// resumed from where it stands. Each line is sent once across the two runs.
    pub fn yield_slot(&self) {
        self.yielding.cancel();
    }

    /// Whether [`Job::yield_slot`] was asked.
    pub fn yielded(&self) -> bool {
        self.yielding.is_cancelled()
    }

    /// Whether [`Job::hold_results`] holds its results back.
    pub(crate) fn results_held(&self) -> bool {
        self.results_held.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The job id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The models the job's requests name, each once.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.plan.models().iter().map(|m| m.model.as_str())
    }

    /// A receiver of the job's progress.
    pub fn progress(&self) -> watch::Receiver<JobProgress> {
        self.progress.subscribe()
    }

    /// The job's status now.
    pub fn status(&self) -> BatchStatus {
        self.batch.lock().expect("batch lock").status
    }

    /// The job's plan: its models, and the records of each model's lines.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Headers the caller added to every request of the job ([`JobSpec::headers`]).
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
    }

    /// The SLO deadline, Unix seconds.
    pub fn expires_at(&self) -> i64 {
        self.batch.lock().expect("batch lock").expires_at
    }

    /// The creation time, Unix seconds.
    pub fn created_at(&self) -> i64 {
        self.batch.lock().expect("batch lock").created_at
    }

    /// The custom_id of line `index`, `None` when outside the job.
    pub fn custom_id(&self, index: u64) -> Option<&str> {
        self.plan.custom_ids().get(index as usize)
    }

    /// The index into `plan.models()` of line `index`.
    pub(crate) fn model_index(&self, index: u64) -> u16 {
        self.model_of_line.get(index as usize).copied().unwrap_or(0)
    }

    /// Writes one outcome (skipped when the line exists), without flushing; `tally` collects
    /// what the metrics need.
    pub(crate) fn record_unflushed(
        &self,
        sink: &mut JobSink,
        index: u64,
        outcome: &Outcome<'_>,
        tally: &mut m::Tally,
    ) -> Result<Written, ExecError> {
        let custom_id = self.custom_id(index).unwrap_or_default();
        let written = sink.record(index, custom_id, outcome)?;
        tally.add(self.model_index(index), &written);
        Ok(written)
    }

    /// Emits a tally's metrics under this job's model names.
    pub(crate) fn emit(&self, tally: m::Tally, settle_inflight: bool) {
        tally.emit(
            |i| self.plan.models()[i as usize].model.clone(),
            settle_inflight.then_some(&self.inflight),
        );
    }

    /// Writes the outcomes of lines (by line index; each skipped when its line has one
    /// already) and flushes once. On an error nothing of them is kept (see [`JobSink`]): the
    /// whole call can be made again. Blocking file work.
    pub fn record_all<'a>(
        &self,
        outcomes: impl IntoIterator<Item = (u64, Outcome<'a>)>,
    ) -> Result<(), ExecError> {
        let mut tally = m::Tally::default();
        let mut sink = self.sink.lock().expect("sink lock");
        for (index, outcome) in outcomes {
            self.record_unflushed(&mut sink, index, &outcome, &mut tally)?;
        }
        sink.flush()?;
        let counts = sink.counts();
        drop(sink);
        self.emit(tally, false);
        self.publish(counts);
        Ok(())
    }

    /// Publishes new counters after writes.
    pub(crate) fn publish(&self, counts: RequestCounts) {
        *self.last_result.lock().expect("progress lock") = Instant::now();
        self.progress.send_if_modified(|p| {
            let changed = p.counts != counts;
            p.counts = counts;
            changed
        });
    }

    /// Counts `n` more requests handed on (sent, enqueued) by this run, in [`JobProgress`].
    pub fn dispatched(&self, n: u64) {
        self.progress.send_modify(|p| p.dispatched += n);
    }

    /// How long since a result last arrived (or since the job started).
    pub(crate) fn quiet_for(&self) -> Duration {
        self.last_result.lock().expect("progress lock").elapsed()
    }

    /// Marks progress now, so a stall is measured from here.
    pub(crate) fn touch(&self) {
        *self.last_result.lock().expect("progress lock") = Instant::now();
    }

    /// Requests still without a line.
    pub fn remaining(&self) -> u64 {
        self.sink.lock().expect("sink lock").remaining()
    }

    /// The records of `model`'s lines still without a result, in plan order. Blocking file
    /// work.
    pub fn unresolved_records(
        &self,
        model: &batch_plan::ModelPlan,
    ) -> Result<Vec<Record>, ExecError> {
        let positions = self.unresolved_positions(model)?;
        Ok(positions.into_iter().map(|(_, r)| r).collect())
    }

    /// Unresolved records of one model with their positions in the model's plan order.
    pub(crate) fn unresolved_positions(
        &self,
        model: &batch_plan::ModelPlan,
    ) -> Result<Vec<(u64, Record)>, ExecError> {
        // The plan file is read before the sink is locked: result writers wait on that lock.
        let records: Vec<Record> = self
            .plan
            .records(model)?
            .collect::<Result<_, _>>()
            .map_err(|e| ExecError::io(&model.path, e))?;
        let sink = self.sink.lock().expect("sink lock");
        Ok(records
            .into_iter()
            .enumerate()
            .filter(|(_, r)| !sink.is_done(r.line as u64))
            .map(|(pos, r)| (pos as u64, r))
            .collect())
    }

    /// Reads the input line of `record`.
    pub(crate) fn read_line(&self, record: &Record) -> Result<Vec<u8>, ExecError> {
        self.input
            .read(record)
            .map_err(|e| ExecError::io(self.plan.input(), e))
    }

    /// The input lines of `records`, each with its record. Blocking file work.
    pub fn read_lines(&self, records: Vec<Record>) -> Result<Vec<(Record, Vec<u8>)>, ExecError> {
        records
            .into_iter()
            .map(|r| Ok((r, self.read_line(&r)?)))
            .collect()
    }

    /// Gives every line still without one an error line with `code`.
    pub(crate) fn resolve_all(&self, code: &str, message: &str) -> Result<u64, ExecError> {
        let mut tally = m::Tally::default();
        let mut sink = self.sink.lock().expect("sink lock");
        let open: Vec<u64> = sink.unresolved().collect();
        for &index in &open {
            let outcome = Outcome::Failed { code, message };
            self.record_unflushed(&mut sink, index, &outcome, &mut tally)?;
        }
        sink.flush()?;
        let counts = sink.counts();
        drop(sink);
        self.emit(tally, false);
        self.publish(counts);
        Ok(open.len() as u64)
    }

    /// What the job's result files hold so far, counted as they were written (see
    /// [`batch_sink::Totals`]).
    pub fn totals(&self) -> batch_sink::Totals {
        self.sink.lock().expect("sink lock").totals()
    }

    /// Moves to `status` and writes `batch.json`.
    pub(crate) fn set_status(&self, status: BatchStatus) -> Result<Batch, ExecError> {
        let counts = self.sink.lock().expect("sink lock").counts();
        let mut batch = self.batch.lock().expect("batch lock");
        batch.set_status(status, now_unix());
        batch.request_counts = counts;
        self.dir.write_batch(&batch)?;
        self.progress.send_modify(|p| {
            p.status = status;
            p.counts = counts;
        });
        Ok(batch.clone())
    }

    /// Records a system error in `batch.json`'s errors.
    pub(crate) fn add_error(&self, code: &str, message: &str) {
        let mut batch = self.batch.lock().expect("batch lock");
        let errors = batch
            .errors
            .get_or_insert_with(|| BatchErrors::new(Vec::new()));
        errors.data.push(batch_wire::BatchError {
            code: code.into(),
            message: message.into(),
            param: None,
            line: None,
        });
    }

    /// The job's directory (its result files, `batch.json`, `job-state.json`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Flushes and syncs the result files.
    pub(crate) fn sync_files(&self) -> Result<(), ExecError> {
        Ok(self.sink.lock().expect("sink lock").sync()?)
    }
}

/// What the manifest records of the input of `spec`, as planned.
fn input_record(spec: &JobSpec, plan: &Plan) -> InputRecord {
    let digest = plan.digest();
    InputRecord {
        path: std::fs::canonicalize(&spec.input).unwrap_or_else(|_| spec.input.clone()),
        bytes: digest.bytes,
        xxh3: format!("{:016x}", digest.xxh3),
    }
}

/// `24h`-style text of a window, as OpenAI writes `completion_window`.
fn humantime_window(window: Duration) -> String {
    let secs = window.as_secs();
    match secs {
        s if s % 3600 == 0 => format!("{}h", s / 3600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_read_like_openai() {
        assert_eq!(humantime_window(Duration::from_secs(86400)), "24h");
        assert_eq!(humantime_window(Duration::from_secs(90)), "90s");
        assert_eq!(humantime_window(Duration::from_secs(120)), "2m");
    }

    #[test]
    fn job_ids_are_unique() {
        assert_ne!(new_job_id(), new_job_id());
        assert!(new_job_id().starts_with("batch_"));
    }
}
