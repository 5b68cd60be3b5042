//! Ingestion: one streaming pass over a batch input file that validates every line and writes one
//! plan file per model.
//!
//! A plan file is a sequence of fixed-size little-endian [`Record`]s (byte offset, length, system
//! prompt hash, line index), sorted by prompt hash and then by line, so requests sharing a system
//! prompt are sent together (better prefix-cache hits) and the order is the same on every run.
//! Models come in name order. Request bodies are never held in memory: [`InputFile::read`] reads a
//! line back with a positioned read when it is sent.
//!
//! ```no_run
//! use batch_plan::{Limits, Plan, PlanError};
//!
//! match Plan::build("batch.jsonl".as_ref(), "work/plan".as_ref(), Limits::default()) {
//!     Ok(plan) => {
//!         let input = plan.open_input()?;
//!         for model in plan.models() {
//!             for record in plan.records(model)? {
//!                 let record = record?;
//!                 let line = input.read(&record)?;
//!                 println!("{} line {}: {} bytes", model.model, record.line, line.len());
//!             }
//!         }
//!     }
//!     Err(PlanError::Invalid(errors)) => {
//!         for e in errors {
//!             eprintln!("line {:?}: {} ({})", e.line, e.message, e.code);
//!         }
//!     }
//!     Err(e) => return Err(e.into()),
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod custom_ids;
mod records;
mod validate;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use batch_wire::{error_codes, BatchError};

pub use custom_ids::CustomIds;
pub use records::{InputFile, Record, RecordReader, RECORD_LEN};
pub use validate::{check_line, CheckedLine, NO_PREFIX};

/// At most this many validation errors are listed; one more entry says how many were left out.
pub const MAX_REPORTED_ERRORS: usize = 10_000;

/// Input limits, OpenAI's by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most request lines in one file.
    pub max_requests: u64,
    /// Largest file, in bytes.
    pub max_file_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_requests: 50_000,
            max_file_bytes: 200 * 1024 * 1024,
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
        let file = File::open(input).map_err(io_error(READ_INPUT, input))?;
        let size = file.metadata().map_err(io_error(READ_INPUT, input))?.len();
        if size > limits.max_file_bytes {
            return Err(PlanError::Invalid(vec![BatchError {
                code: error_codes::TOO_LARGE.into(),
                message: format!(
                    "the file has {size} bytes; at most {} are allowed",
                    limits.max_file_bytes
                ),
                param: None,
                line: None,
            }]));
        }
        let mut builder = Builder::new(limits);
        let mut reader = BufReader::with_capacity(1 << 16, file);
        let mut buf = Vec::new();
        let mut offset = 0u64;
        let mut hash = xxhash_rust::xxh3::Xxh3::new();
        loop {
            buf.clear();
            let n = reader
                .read_until(b'\n', &mut buf)
                .map_err(io_error(READ_INPUT, input))?;
            if n == 0 {
                break;
            }
            hash.update(&buf);
            let mut text = &buf[..];
            text = text.strip_suffix(b"\n").unwrap_or(text);
            text = text.strip_suffix(b"\r").unwrap_or(text);
            builder.line(offset, text);
            offset += n as u64;
        }
        let digest = InputDigest {
            bytes: offset,
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

    fn line(&mut self, offset: u64, text: &[u8]) {
        let line_no = self.lines + 1;
        self.lines += 1;
        // A blank last line (a trailing newline too many) adds no request; a blank line followed
        // by more requests is an error.
        if let Some(blank) = self.pending_blank.take() {
            self.error(blank_line_error(blank));
            self.custom_ids.push("");
        }
        if text.iter().all(u8::is_ascii_whitespace) {
            self.pending_blank = Some(line_no);
            return;
        }
        if line_no > self.limits.max_requests {
            if line_no == self.limits.max_requests + 1 {
                self.error(BatchError {
                    code: error_codes::TOO_LARGE.into(),
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
        let Ok(text) = std::str::from_utf8(text) else {
            self.error(BatchError {
                code: error_codes::INVALID_JSON_LINE.into(),
                message: "the line is not valid UTF-8".into(),
                param: None,
                line: Some(line_no),
            });
            self.custom_ids.push("");
            return;
        };
        match check_line(text, line_no) {
            Err(errors) => {
                errors.into_iter().for_each(|e| self.error(e));
                self.custom_ids.push("");
            }
            Ok(line) => self.accept(offset, text.len(), line_no, line),
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

fn blank_line_error(line_no: u64) -> BatchError {
    BatchError {
        code: error_codes::INVALID_JSON_LINE.into(),
        message: "the line is empty".into(),
        param: None,
        line: Some(line_no),
    }
}
