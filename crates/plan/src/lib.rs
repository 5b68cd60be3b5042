#![doc = include_str!("../README.md")]

mod blocks;
mod carry;
mod custom_ids;
mod records;
mod rules;
mod scan;
mod validate;

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Mutex};

use batch_wire::{error_codes, BatchError};

use blocks::{
    blank_line_error, check_block, Block, BlockReader, CheckedBlock, InOrder, LineCheck, Outcome,
};
pub use carry::dispatcher_change;
pub use custom_ids::CustomIds;
pub use records::{InputFile, Record, RecordReader, RECORD_LEN};
pub use validate::{check_line, check_line_with_serde, CheckedLine, NO_PREFIX};

/// At most this many validation errors are listed; one more entry says how many were left out.
pub const MAX_REPORTED_ERRORS: usize = 10_000;

/// Lines are checked on this many threads while the file is read, a block of lines at a time.
const CHECK_THREADS: usize = 2;
/// About this many bytes of whole lines per block; at most `2 * CHECK_THREADS + 1` blocks are
/// held at once.
const BLOCK_BYTES: usize = 1 << 20;

/// Input limits, OpenAI's by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most request lines in one file.
    pub max_requests: u64,
    /// Largest file, in bytes.
    pub max_file_bytes: u64,
    /// The one `url` every line must name (the batch's `endpoint`, as OpenAI requires), one of
    /// [`batch_wire::ALLOWED_URLS`]; `None` lets each line name its own.
    pub endpoint: Option<&'static str>,
    /// The requests go through the llm-d-async dispatcher (async mode): a line whose body it
    /// would change or drop is refused ([`dispatcher_change`]).
    pub dispatcher: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_requests: 50_000,
            max_file_bytes: 200 * 1024 * 1024,
            endpoint: None,
            dispatcher: false,
        }
    }
}

/// Why no plan was made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The file is not a valid batch input; every bad line is listed (OpenAI's `errors.data`).
    #[error("the input file is invalid ({} problems)", .0.len())]
    Invalid(Vec<BatchError>),
    /// Reading the input or writing a plan file failed.
    ///
    /// The I/O error is part of the message, not a `source()`, so a printed chain shows it once.
    #[error("{action} {path}: {error}")]
    Io {
        /// What was being done, such as `reading the input file`.
        action: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// What failed.
        error: std::io::Error,
    },
}

const READ_INPUT: &str = "reading the input file";
const READ_PLAN: &str = "reading the plan file";

fn io_error<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> PlanError + 'a {
    move |error| PlanError::Io {
        action,
        path: path.to_owned(),
        error,
    }
}

/// One model's share of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelPlan {
    /// The model named by the requests.
    pub model: String,
    /// How many requests name it.
    pub requests: u64,
    /// Its plan file.
    pub path: PathBuf,
}

/// What identifies an input file's content: its size and a hash of every byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputDigest {
    /// Bytes in the file.
    pub bytes: u64,
    /// XXH3-64 of the whole file.
    pub xxh3: u64,
}

/// A validated input file and its per-model plan files.
#[derive(Debug)]
pub struct Plan {
    input: PathBuf,
    digest: InputDigest,
    models: Vec<ModelPlan>,
    custom_ids: CustomIds,
    endpoint: Option<String>,
}

impl Plan {
    /// Validates `input` in one pass and writes the plan files into `dir` (created if needed,
    /// earlier plan files replaced).
    pub fn build(input: &Path, dir: &Path, limits: Limits) -> Result<Plan, PlanError> {
        Self::build_in_blocks(input, dir, limits, BLOCK_BYTES)
    }

    fn build_in_blocks(
        input: &Path,
        dir: &Path,
        limits: Limits,
        block_bytes: usize,
    ) -> Result<Plan, PlanError> {
        let mut file = File::open(input).map_err(io_error(READ_INPUT, input))?;
        let size = file.metadata().map_err(io_error(READ_INPUT, input))?.len();
        if size > limits.max_file_bytes {
            return Err(PlanError::Invalid(vec![BatchError {
                code: error_codes::FILE_TOO_LARGE.into(),
                message: format!(
                    "the file has {size} bytes; at most {} are allowed",
                    limits.max_file_bytes
                ),
                param: None,
                line: None,
            }]));
        }
        let mut builder = Builder::new(limits);
        let mut hash = xxhash_rust::xxh3::Xxh3::new();
        // The file is read (and hashed) here; its lines are checked on worker threads, a block
        // at a time, and taken into the plan here in file order.
        let (work, work_rx) = mpsc::sync_channel::<Block>(CHECK_THREADS);
        let work_rx = Mutex::new(work_rx);
        let bytes = std::thread::scope(|scope| -> Result<u64, PlanError> {
            let (done_tx, done) = mpsc::channel::<CheckedBlock>();
            for _ in 0..CHECK_THREADS {
                let (work_rx, done_tx) = (&work_rx, done_tx.clone());
                scope.spawn(move || loop {
                    let next = work_rx.lock().expect("work queue lock").recv();
                    let Ok(block) = next else { return };
                    if done_tx.send(check_block(block, &limits)).is_err() {
                        return;
                    }
                });
            }
            drop(done_tx);
            let mut order = InOrder::default();
            let mut blocks = BlockReader::new(block_bytes);
            while let Some(block) = blocks
                .next(&mut file)
                .map_err(io_error(READ_INPUT, input))?
            {
                hash.update(&block.bytes);
                // The workers stop when this sender is dropped, on error too.
                if work.send(block).is_err() {
                    break;
                }
                while let Ok(checked) = done.try_recv() {
                    order.take(checked, &mut builder);
                }
            }
            drop(work);
            for checked in done {
                order.take(checked, &mut builder);
            }
            Ok(blocks.offset)
        })?;
        let digest = InputDigest {
            bytes,
            xxh3: hash.digest(),
        };
        builder.finish(input, dir, digest)
    }

    /// Size and hash of the input as it was planned.
    pub fn digest(&self) -> InputDigest {
        self.digest
    }

    /// The input file.
    pub fn input(&self) -> &Path {
        &self.input
    }

    /// Opens the input for positioned reads of its lines.
    pub fn open_input(&self) -> Result<InputFile, PlanError> {
        InputFile::open(&self.input).map_err(io_error(READ_INPUT, &self.input))
    }

    /// Every request line.
    pub fn total(&self) -> u64 {
        self.custom_ids.len() as u64
    }

    /// Models in name order.
    pub fn models(&self) -> &[ModelPlan] {
        &self.models
    }

    /// The `custom_id` of each line.
    pub fn custom_ids(&self) -> &CustomIds {
        &self.custom_ids
    }

    /// The url shared by every line, if they share one.
    pub fn endpoint(&self) -> Option<&str> {
        self.endpoint.as_deref()
    }

    /// The records of one model, in send order.
    pub fn records(&self, model: &ModelPlan) -> Result<RecordReader, PlanError> {
        RecordReader::open(&model.path).map_err(io_error(READ_PLAN, &model.path))
    }
}

struct Builder {
    limits: Limits,
    lines: u64,
    by_model: BTreeMap<String, Vec<Record>>,
    custom_ids: CustomIds,
    seen: HashMap<u64, u32>,
    seen_overflow: HashMap<String, u32>,
    endpoint: Option<Option<String>>,
    errors: Vec<BatchError>,
    errors_left_out: u64,
    pending_blank: Option<u64>,
}

impl Builder {
    fn new(limits: Limits) -> Self {
        Self {
            limits,
            lines: 0,
            by_model: BTreeMap::new(),
            custom_ids: CustomIds::default(),
            seen: HashMap::new(),
            seen_overflow: HashMap::new(),
            endpoint: None,
            errors: Vec::new(),
            errors_left_out: 0,
            pending_blank: None,
        }
    }

    fn error(&mut self, e: BatchError) {
        if self.errors.len() < MAX_REPORTED_ERRORS {
            self.errors.push(e);
        } else {
            self.errors_left_out += 1;
        }
    }

    /// Takes a line checked by [`check_block`].
    fn line(&mut self, line: &LineCheck, block: &CheckedBlock) {
        let line_no = self.lines + 1;
        self.lines += 1;
        debug_assert_eq!(line_no, line.line_no);
        // A blank last line (a trailing newline too many) adds no request; a blank line followed
        // by more requests is an error.
        if let Some(blank) = self.pending_blank.take() {
            self.error(blank_line_error(blank));
            self.custom_ids.push("");
        }
        if let Outcome::Blank = line.outcome {
            self.pending_blank = Some(line_no);
            return;
        }
        if line_no > self.limits.max_requests {
            if line_no == self.limits.max_requests + 1 {
                self.error(BatchError {
                    code: error_codes::TOO_MANY_REQUESTS_IN_FILE.into(),
                    message: format!(
                        "the file has more than {} requests",
                        self.limits.max_requests
                    ),
                    param: None,
                    line: Some(line_no),
                });
            }
            return;
        }
        // Every line up to the limit gets one slot in `custom_ids` (empty when invalid), so a
        // line's index is its slot.
        match &line.outcome {
            Outcome::Blank | Outcome::PastLimit => unreachable!("handled above"),
            Outcome::NotUtf8 => {
                self.error(BatchError {
                    code: error_codes::INVALID_JSON_LINE.into(),
                    message: "the line is not valid UTF-8".into(),
                    param: None,
                    line: Some(line_no),
                });
                self.custom_ids.push("");
            }
            Outcome::Invalid(errors) => {
                errors.iter().for_each(|e| self.error(e.clone()));
                self.custom_ids.push("");
            }
            Outcome::Valid {
                custom_id,
                model,
                url,
                prefix_hash,
            } => {
                let checked = CheckedLine {
                    custom_id: Cow::Borrowed(&block.custom_ids[custom_id.0..custom_id.1]),
                    model: Cow::Borrowed(&block.models[*model]),
                    url: Cow::Borrowed(url),
                    prefix_hash: *prefix_hash,
                };
                self.accept(line.offset, line.len, line_no, checked)
            }
        }
    }

    fn accept(&mut self, offset: u64, len: usize, line_no: u64, line: CheckedLine<'_>) {
        if let Some(first) = self.duplicate_of(&line.custom_id) {
            self.error(BatchError {
                code: error_codes::DUPLICATE_CUSTOM_ID.into(),
                message: format!(
                    "custom_id {:?} is already used on line {}",
                    line.custom_id,
                    first + 1
                ),
                param: Some("custom_id".into()),
                line: Some(line_no),
            });
            self.custom_ids.push("");
            return;
        }
        let index = (line_no - 1) as u32;
        self.custom_ids.push(&line.custom_id);
        if !self.errors.is_empty() {
            // The file is invalid: keep checking lines, but plan nothing.
            return;
        }
        match &mut self.endpoint {
            None => self.endpoint = Some(Some(line.url.into_owned())),
            Some(Some(url)) if *url != line.url => self.endpoint = Some(None),
            _ => {}
        }
        let record = Record {
            offset,
            len: len as u32,
            prefix_hash: line.prefix_hash,
            line: index,
        };
        match self.by_model.get_mut(line.model.as_ref()) {
            Some(records) => records.push(record),
            None => {
                self.by_model.insert(line.model.into_owned(), vec![record]);
            }
        }
    }

    /// The 0-based line that first used `custom_id`, remembering it otherwise.
    ///
    /// Only 64-bit hashes are kept; the strings live once, in `custom_ids`, and settle the rare
    /// hash collision.
    fn duplicate_of(&mut self, custom_id: &str) -> Option<u32> {
        let line = self.custom_ids.len() as u32;
        let hash = batch_wire::hash::fnv1a_64(custom_id.as_bytes());
        let Some(&first) = self.seen.get(&hash) else {
            self.seen.insert(hash, line);
            return None;
        };
        match self.custom_ids.get(first as usize) {
            Some(existing) if existing == custom_id => Some(first),
            _ => match self.seen_overflow.get(custom_id) {
                Some(&earlier) => Some(earlier),
                None => {
                    self.seen_overflow.insert(custom_id.to_owned(), line);
                    None
                }
            },
        }
    }

    fn finish(mut self, input: &Path, dir: &Path, digest: InputDigest) -> Result<Plan, PlanError> {
        if self.lines == 0 || (self.custom_ids.is_empty() && self.errors.is_empty()) {
            self.error(BatchError {
                code: error_codes::EMPTY_FILE.into(),
                message: "the file holds no request".into(),
                param: None,
                line: None,
            });
        }
        if !self.errors.is_empty() {
            if self.errors_left_out > 0 {
                self.errors.push(BatchError {
                    code: "too_many_errors".into(),
                    message: format!("{} more problems were not listed", self.errors_left_out),
                    param: None,
                    line: None,
                });
            }
            return Err(PlanError::Invalid(self.errors));
        }
        std::fs::create_dir_all(dir).map_err(io_error("creating the plan directory", dir))?;
        let mut models = Vec::with_capacity(self.by_model.len());
        for (i, (model, mut records)) in self.by_model.into_iter().enumerate() {
            // Stable: equal hashes keep input order, so every run sends in the same order.
            records.sort_by_key(|r| (r.prefix_hash, r.line));
            let path = dir.join(format!("model-{i:04}.plan"));
            records::write_records(&path, &records)
                .map_err(io_error("writing the plan file", &path))?;
            models.push(ModelPlan {
                model,
                requests: records.len() as u64,
                path,
            });
        }
        Ok(Plan {
            input: input.to_owned(),
            digest,
            models,
            custom_ids: self.custom_ids,
            endpoint: self.endpoint.flatten(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(custom_id: &str, model: &str, filler: usize) -> String {
        format!(
            r#"{{"custom_id":"{custom_id}","method":"POST","url":"/v1/chat/completions","body":{{"model":"{model}","messages":[{{"role":"system","content":"P{}"}},{{"role":"user","content":"{}"}}]}}}}"#,
            filler % 3,
            "x".repeat(filler)
        )
    }

    /// What a plan says of its input: every field a caller can see.
    fn summary(plan: Result<Plan, PlanError>) -> String {
        match plan {
            Err(PlanError::Invalid(errors)) => format!("{errors:?}"),
            Err(e) => format!("{e}"),
            Ok(plan) => {
                let mut text = format!(
                    "{:?} {:?} {:?}\n",
                    plan.digest(),
                    plan.endpoint(),
                    (0..plan.total())
                        .map(|i| plan.custom_ids().get(i as usize).unwrap_or("?").to_owned())
                        .collect::<Vec<_>>()
                );
                for m in plan.models() {
                    let records: Vec<_> = plan.records(m).unwrap().map(Result::unwrap).collect();
                    text += &format!("{} {} {records:?}\n", m.model, m.requests);
                }
                text
            }
        }
    }

    /// Blocks of any size, lines longer than a block included, give the plan of one block.
    #[test]
    fn block_size_changes_nothing() {
        let dir = batch_testkit::tempdir().unwrap();
        let valid: Vec<String> = (0..40)
            .map(|i| line(&format!("id-{i}"), ["b", "a", "c"][i % 3], i * 7))
            .collect();
        let mut invalid = valid.clone();
        invalid[5] = "not json".into();
        invalid[9] = String::new();
        invalid[17] = line("id-3", "a", 1);
        invalid[30] = "\u{feff}{}".into();
        let files: Vec<(Vec<u8>, Limits)> = vec![
            (
                format!("{}\n", valid.join("\n")).into_bytes(),
                Limits::default(),
            ),
            (valid.join("\r\n").into_bytes(), Limits::default()),
            (
                format!("{}\n\n", valid.join("\n")).into_bytes(),
                Limits::default(),
            ),
            (invalid.join("\n").into_bytes(), Limits::default()),
            (
                [
                    &b"{\"custom_id\":\"\xff\"}\n"[..],
                    valid.join("\n").as_bytes(),
                ]
                .concat(),
                Limits::default(),
            ),
            (
                valid.join("\n").into_bytes(),
                Limits {
                    max_requests: 12,
                    ..Limits::default()
                },
            ),
            (Vec::new(), Limits::default()),
            (b"\n".to_vec(), Limits::default()),
        ];
        for (n, (bytes, limits)) in files.iter().enumerate() {
            let input = dir.path().join(format!("input-{n}.jsonl"));
            std::fs::write(&input, bytes).unwrap();
            let plan = |block| {
                let plan_dir = dir.path().join(format!("plan-{n}-{block}"));
                summary(Plan::build_in_blocks(&input, &plan_dir, *limits, block))
            };
            let whole = plan(1 << 30);
            for block in [1, 7, 64, 300, 4096] {
                assert_eq!(plan(block), whole, "file {n}, blocks of {block} B");
            }
        }
    }
}
