#![doc = include_str!("../README.md")]

mod done;
mod render;
mod usage;

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use batch_wire::{error_codes, parse_request_id, Outcome, RequestCounts, Usage};
use serde::Deserialize;

pub use done::DoneSet;
pub use render::{render, render_into, LineKind, Rendered};

// The names of a job directory's files, defined with the file formats in batch-wire so that
// readers of the files need not depend on the sink.
pub use batch_wire::{BATCH_FILE, ERROR_FILE, OUTPUT_FILE};

/// Why the sink could not do its job.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// Reading or writing a file failed.
    ///
    /// The I/O error is part of the message, not a `source()`, so a printed chain shows it once.
    #[error("{path}: {error}")]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// What failed.
        error: std::io::Error,
    },
    /// A file holds a line that does not belong to this job.
    #[error("{path}: line {line} does not belong to job {job_id}: {reason}")]
    Foreign {
        /// The file concerned.
        path: PathBuf,
        /// 1-based line.
        line: u64,
        /// The job being opened.
        job_id: String,
        /// What is wrong with the line.
        reason: String,
    },
    /// The request index is outside the job.
    #[error("request index {index} is outside job {job_id} of {total} requests")]
    OutOfRange {
        /// The job.
        job_id: String,
        /// The index given.
        index: u64,
        /// Requests in the job.
        total: u64,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SinkError + '_ {
    move |error| SinkError::Io {
        path: path.to_owned(),
        error,
    }
}

/// What [`JobSink::record`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// A line in `output.jsonl`.
    Output {
        /// The HTTP status written.
        status: u16,
        /// Token counts from the response body, when it has them.
        usage: Option<Usage>,
    },
    /// A line in `error.jsonl`.
    Error,
    /// The index already had its line; nothing was written.
    Duplicate,
}

/// What a job's result files hold, counted as the lines are written (and on resume, from the
/// lines kept).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// Lines in `output.jsonl`.
    pub output_lines: u64,
    /// Lines in `error.jsonl`.
    pub error_lines: u64,
    /// Token counts summed over the 2xx responses.
    pub usage: Usage,
    /// Requests closed by a cancel (`batch_cancelled` error lines).
    pub cancelled: u64,
    /// Requests closed by the deadline (`batch_expired` error lines).
    pub expired: u64,
}

impl Totals {
    /// Counts an error line with `code`.
    fn error_line(&mut self, code: &str) {
        self.error_lines += 1;
        match code {
            error_codes::BATCH_CANCELLED => self.cancelled += 1,
            error_codes::BATCH_EXPIRED => self.expired += 1,
            _ => {}
        }
    }

    /// Counts an output line whose response has `usage`.
    fn output_line(&mut self, usage: Option<Usage>) {
        self.output_lines += 1;
        if let Some(u) = usage {
            self.usage += u;
        }
    }
}

/// The result files of one job.
///
/// Lines are written in batches: everything recorded since the last successful
/// [`JobSink::flush`] either reaches the files whole, or, when a write fails (a full disk, a
/// file-size limit), is taken back: the files are cut back to their last complete line and those
/// requests count as not done, so writing them again later leaves no torn or doubled line.
#[derive(Debug)]
pub struct JobSink {
    job_id: String,
    output: Appender,
    error: Appender,
    done: DoneSet,
    counts: RequestCounts,
    totals: Totals,
    /// `totals` at the last successful flush.
    committed_totals: Totals,
    /// Requests recorded since the last flush, and whether each counted as completed.
    pending: Vec<(u64, bool)>,
    /// The line being rendered, kept to reuse its allocation.
    scratch: Vec<u8>,
    /// Request ids of this job without their index (`batch_req_<job>_`).
    id_prefix: String,
    /// The id being rendered, kept to reuse its allocation.
    id: String,
}

/// One result file: a buffered appender that knows where its last flushed line ends.
#[derive(Debug)]
struct Appender {
    path: PathBuf,
    writer: BufWriter<File>,
    /// Bytes handed to `writer` so far.
    written: u64,
    /// Length of the file at the last successful flush.
    committed: u64,
}

impl Appender {
    fn new(path: PathBuf, file: File, len: u64) -> Self {
        Self {
            path,
            writer: BufWriter::with_capacity(1 << 16, file),
            written: len,
            committed: len,
        }
    }

    fn write_line(&mut self, line: &[u8]) -> std::io::Result<()> {
        self.writer.write_all(line)?;
        self.writer.write_all(b"\n")?;
        self.written += line.len() as u64 + 1;
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.writer.flush()
    }

    /// Drops what is buffered and cuts the file back to its last flushed line.
    fn roll_back(&mut self) -> std::io::Result<()> {
        let file = self.writer.get_ref().try_clone()?;
        let fresh = BufWriter::with_capacity(self.writer.capacity(), file);
        // `into_parts` hands back the buffer instead of writing it, as dropping would.
        let (file, _unwritten) = std::mem::replace(&mut self.writer, fresh).into_parts();
        file.set_len(self.committed)?;
        self.written = self.committed;
        Ok(())
    }
}

impl JobSink {
    /// Opens (creating or resuming) the files of job `job_id` with `total` requests in `dir`.
    pub fn open(dir: &Path, job_id: &str, total: u64) -> Result<Self, SinkError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let mut done = DoneSet::new(total);
        let mut counts = RequestCounts {
            total,
            ..RequestCounts::default()
        };
        let output_path = dir.join(OUTPUT_FILE);
        let error_path = dir.join(ERROR_FILE);
        let mut totals = Totals::default();
        let mut resumed = Resumed {
            job_id,
            done: &mut done,
            counts: &mut counts,
            totals: &mut totals,
        };
        let (output, out_len) = resumed.file(&output_path)?;
        let (error, err_len) = resumed.file(&error_path)?;
        Ok(Self {
            job_id: job_id.to_owned(),
            output: Appender::new(output_path, output, out_len),
            error: Appender::new(error_path, error, err_len),
            done,
            counts,
            totals,
            committed_totals: totals,
            pending: Vec::new(),
            scratch: Vec::new(),
            id_prefix: id_prefix(job_id),
            id: String::new(),
        })
    }

    /// Writes the line of request `index` unless it has one already.
    pub fn record(
        &mut self,
        index: u64,
        custom_id: &str,
        outcome: &Outcome<'_>,
    ) -> Result<Written, SinkError> {
        if index >= self.counts.total {
            return Err(SinkError::OutOfRange {
                job_id: self.job_id.clone(),
                index,
                total: self.counts.total,
            });
        }
        if self.done.contains(index) {
            return Ok(Written::Duplicate);
        }
        self.id.clear();
        self.id.push_str(&self.id_prefix);
        write!(self.id, "{index}").expect("writing to a String");
        self.scratch.clear();
        let rendered = render_into(&mut self.scratch, &self.id, custom_id, outcome);
        let file = match rendered.status {
            Some(_) => &mut self.output,
            None => &mut self.error,
        };
        if let Err(e) = file.write_line(&self.scratch) {
            let path = file.path.clone();
            return Err(self.roll_back(path, e));
        }
        self.done.insert(index);
        match (rendered.status, outcome) {
            (Some(_), _) => self.totals.output_line(rendered.usage),
            (None, Outcome::Failed { code, .. }) => self.totals.error_line(code),
            // A 2xx without a JSON body: a `server_error` or `parse_error` line.
            (None, Outcome::Http { .. }) => self.totals.error_line(""),
        }
        let completed = rendered.status == Some(200);
        if completed {
            self.counts.completed += 1;
        } else {
            self.counts.failed += 1;
        }
        self.pending.push((index, completed));
        Ok(match rendered.status {
            Some(status) => Written::Output {
                status,
                usage: rendered.usage,
            },
            None => Written::Error,
        })
    }

    /// Whether request `index` has its line.
    pub fn is_done(&self, index: u64) -> bool {
        self.done.contains(index)
    }

    /// Indexes still without a line, in order.
    pub fn unresolved(&self) -> impl Iterator<Item = u64> + '_ {
        self.done.missing()
    }

    /// Requests still without a line.
    pub fn remaining(&self) -> u64 {
        self.counts.total - self.done.len()
    }

    /// `request_counts` so far.
    pub fn counts(&self) -> RequestCounts {
        self.counts
    }

    /// What the files hold so far (see [`Totals`]).
    pub fn totals(&self) -> Totals {
        self.totals
    }

    /// Hands buffered lines to the operating system; after this a crash of the process loses
    /// nothing written. When it fails, every line recorded since the last successful flush is
    /// taken back (see [`JobSink`]) and its request counts as not done.
    pub fn flush(&mut self) -> Result<(), SinkError> {
        let failed = match self.output.flush() {
            Err(e) => Some((self.output.path.clone(), e)),
            Ok(()) => self
                .error
                .flush()
                .err()
                .map(|e| (self.error.path.clone(), e)),
        };
        if let Some((path, e)) = failed {
            return Err(self.roll_back(path, e));
        }
        // Both files hold every pending line: only now are they kept.
        self.output.committed = self.output.written;
        self.error.committed = self.error.written;
        self.committed_totals = self.totals;
        self.pending.clear();
        Ok(())
    }

    /// Takes back everything recorded since the last successful flush after `error`.
    fn roll_back(&mut self, path: PathBuf, error: std::io::Error) -> SinkError {
        for file in [&mut self.output, &mut self.error] {
            if let Err(e) = file.roll_back() {
                // The next open cuts a torn last line anyway; say why this one could not.
                tracing::error!(path = %file.path.display(), error = %e, "could not cut a result file back to its last line");
            }
        }
        self.totals = self.committed_totals;
        for (index, completed) in self.pending.drain(..) {
            self.done.remove(index);
            if completed {
                self.counts.completed -= 1;
            } else {
                self.counts.failed -= 1;
            }
        }
        SinkError::Io { path, error }
    }

    /// Lengths of `output.jsonl` and `error.jsonl` at the last successful flush: prefixes that
    /// hold only whole lines, and that later writes only extend.
    pub fn committed_lengths(&self) -> (u64, u64) {
        (self.output.committed, self.error.committed)
    }

    /// Flushes and asks the disk to keep the files (for the job's end).
    pub fn sync(&mut self) -> Result<(), SinkError> {
        self.flush()?;
        for file in [&self.output, &self.error] {
            file.writer.get_ref().sync_all().map_err(io(&file.path))?;
        }
        Ok(())
    }
}

/// What every request id of job `job_id` starts with: its id without the index.
fn id_prefix(job_id: &str) -> String {
    let mut id = batch_wire::request_id(job_id, 0);
    id.pop();
    id
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_the_prefix_and_the_index() {
        for job in ["batch_1", "job 1/ü", ""] {
            for index in [0, 7, 10, 123_456_789] {
                let id = format!("{}{index}", super::id_prefix(job));
                assert_eq!(id, batch_wire::request_id(job, index));
            }
        }
    }
}

#[derive(Deserialize)]
struct LineHead<'a> {
    #[serde(borrow)]
    id: std::borrow::Cow<'a, str>,
    #[serde(default, borrow)]
    response: Option<ResponseHead<'a>>,
    #[serde(default, borrow)]
    error: Option<ErrorHead<'a>>,
}

#[derive(Deserialize)]
struct ResponseHead<'a> {
    status_code: u16,
    #[serde(default, borrow)]
    body: Option<&'a serde_json::value::RawValue>,
}

#[derive(Deserialize)]
struct ErrorHead<'a> {
    #[serde(default, borrow)]
    code: std::borrow::Cow<'a, str>,
}

/// What opening a job's files counts of the lines they hold.
struct Resumed<'a> {
    job_id: &'a str,
    done: &'a mut DoneSet,
    counts: &'a mut RequestCounts,
    totals: &'a mut Totals,
}

impl Resumed<'_> {
    /// Opens `path` for appending after reading back what it holds; cuts a torn last line.
    /// Returns the file and its length.
    fn file(&mut self, path: &Path) -> Result<(File, u64), SinkError> {
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .map_err(io(path))?;
        let mut reader = BufReader::new(&mut file);
        let mut buf = Vec::new();
        let (mut kept, mut line_no) = (0u64, 0u64);
        loop {
            buf.clear();
            let n = reader.read_until(b'\n', &mut buf).map_err(io(path))?;
            if n == 0 || buf.last() != Some(&b'\n') {
                break;
            }
            line_no += 1;
            let foreign = |reason: String| SinkError::Foreign {
                path: path.to_owned(),
                line: line_no,
                job_id: self.job_id.to_owned(),
                reason,
            };
            let head: LineHead = serde_json::from_slice(&buf)
                .map_err(|e| foreign(format!("not an output line: {e}")))?;
            let index = match parse_request_id(&head.id) {
                Some((job, index)) if job == self.job_id => index,
                _ => return Err(foreign(format!("id {:?}", head.id))),
            };
            if index >= self.counts.total {
                return Err(foreign(format!("index {index} is beyond the job")));
            }
            kept += n as u64;
            if self.done.insert(index) {
                self.count(&head);
            }
        }
        drop(reader);
        if file.seek(SeekFrom::End(0)).map_err(io(path))? != kept {
            // A crash mid-write left a partial line: its request is not done and will be written again.
            file.set_len(kept).map_err(io(path))?;
        }
        Ok((file, kept))
    }

    /// Counts a kept line as [`JobSink::record`] counted it when it wrote it.
    fn count(&mut self, head: &LineHead<'_>) {
        match &head.response {
            Some(r) => {
                if r.status_code == 200 {
                    self.counts.completed += 1;
                } else {
                    self.counts.failed += 1;
                }
                let usage = r
                    .body
                    .filter(|_| (200..300).contains(&r.status_code))
                    .and_then(|body| {
                        let body = body.get().as_bytes();
                        let doc = batch_wire::json::check(body).ok()?;
                        usage::usage(body, &doc)
                    });
                self.totals.output_line(usage);
            }
            None => {
                self.counts.failed += 1;
                let code = head.error.as_ref().map_or("", |e| e.code.as_ref());
                self.totals.error_line(code);
            }
        }
    }
}
