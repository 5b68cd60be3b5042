//! The input cut into blocks of whole lines, each checked on a worker thread and taken into
//! the plan in file order.

use super::*;

/// Whole lines of the input, read in one piece.
pub(crate) struct Block {
    pub(crate) seq: u64,
    /// Offset in the file of the first byte.
    pub(crate) offset: u64,
    /// 1-based number of the first line.
    pub(crate) first_line: u64,
    pub(crate) bytes: Vec<u8>,
    /// The offset just after each newline in `bytes`.
    pub(crate) ends: Vec<usize>,
}

/// Cuts the input into [`Block`]s of whole lines (the last line may lack its newline).
pub(crate) struct BlockReader {
    block_bytes: usize,
    /// Bytes read past the last newline, the start of the next block.
    carry: Vec<u8>,
    seq: u64,
    /// Offset of the next block.
    pub(crate) offset: u64,
    line: u64,
    eof: bool,
}

impl BlockReader {
    pub(crate) fn new(block_bytes: usize) -> Self {
        Self {
            block_bytes: block_bytes.max(1),
            carry: Vec::new(),
            seq: 0,
            offset: 0,
            line: 1,
            eof: false,
        }
    }

    pub(crate) fn next(&mut self, file: &mut File) -> std::io::Result<Option<Block>> {
        let mut bytes = std::mem::take(&mut self.carry);
        // Ends at the last newline read; a line longer than a block makes the block longer.
        let end = loop {
            let searched = bytes.len();
            if !self.eof {
                let want = searched + self.block_bytes;
                bytes.reserve(want - searched);
                let n = file
                    .by_ref()
                    .take(self.block_bytes as u64)
                    .read_to_end(&mut bytes)?;
                self.eof = n == 0;
            }
            match memchr::memrchr(b'\n', &bytes) {
                Some(i) if !self.eof || i + 1 == bytes.len() => break i + 1,
                _ if self.eof => break bytes.len(),
                _ => continue,
            }
        };
        if end == 0 {
            return Ok(None);
        }
        self.carry = bytes[end..].to_vec();
        bytes.truncate(end);
        let ends: Vec<usize> = memchr::memchr_iter(b'\n', &bytes).map(|i| i + 1).collect();
        let lines = ends.len() as u64 + u64::from(bytes.last() != Some(&b'\n'));
        let block = Block {
            seq: self.seq,
            offset: self.offset,
            first_line: self.line,
            bytes,
            ends,
        };
        self.seq += 1;
        self.offset += block.bytes.len() as u64;
        self.line += lines;
        Ok(Some(block))
    }
}

/// What a worker found in one line.
pub(crate) struct LineCheck {
    pub(crate) line_no: u64,
    pub(crate) offset: u64,
    /// Bytes without the line end.
    pub(crate) len: usize,
    pub(crate) outcome: Outcome,
}

pub(crate) enum Outcome {
    /// Only whitespace.
    Blank,
    /// Past `max_requests`: not checked.
    PastLimit,
    NotUtf8,
    Invalid(Vec<BatchError>),
    Valid {
        /// Its range in [`CheckedBlock::custom_ids`].
        custom_id: (usize, usize),
        /// Its index in [`CheckedBlock::models`].
        model: usize,
        url: &'static str,
        prefix_hash: u32,
    },
}

/// The lines of one [`Block`], checked.
pub(crate) struct CheckedBlock {
    pub(crate) seq: u64,
    pub(crate) lines: Vec<LineCheck>,
    /// Every valid line's `custom_id`, end to end.
    pub(crate) custom_ids: String,
    /// The models named in the block.
    pub(crate) models: Vec<String>,
}

pub(crate) fn check_block(block: Block, limits: &Limits) -> CheckedBlock {
    let mut checked = CheckedBlock {
        seq: block.seq,
        lines: Vec::new(),
        custom_ids: String::new(),
        models: Vec::new(),
    };
    let (mut offset, mut line_no) = (block.offset, block.first_line);
    for raw in lines_of(&block.bytes, &block.ends) {
        let mut text = raw;
        text = text.strip_suffix(b"\n").unwrap_or(text);
        text = text.strip_suffix(b"\r").unwrap_or(text);
        let outcome = if text.iter().all(u8::is_ascii_whitespace) {
            Outcome::Blank
        } else if line_no > limits.max_requests {
            Outcome::PastLimit
        } else {
            match std::str::from_utf8(text) {
                Err(_) => Outcome::NotUtf8,
                Ok(text) => match check_line(text, line_no) {
                    Err(errors) => Outcome::Invalid(errors),
                    Ok(line) if limits.endpoint.is_some_and(|e| e != line.url) => {
                        Outcome::Invalid(vec![BatchError {
                            code: error_codes::URL_MISMATCH.into(),
                            message: format!(
                                "The url {} does not match the batch's endpoint {}.",
                                line.url,
                                limits.endpoint.unwrap_or_default()
                            ),
                            param: Some("url".into()),
                            line: Some(line_no),
                        }])
                    }
                    Ok(line) => match limits.dispatcher.then(|| dispatcher_change(text)) {
                        Some(Some((field, why))) => Outcome::Invalid(vec![BatchError {
                            code: error_codes::DISPATCHER_CANNOT_CARRY.into(),
                            message: format!("{field}: {why}"),
                            param: Some(field),
                            line: Some(line_no),
                        }]),
                        _ => valid(&mut checked, line),
                    },
                },
            }
        };
        checked.lines.push(LineCheck {
            line_no,
            offset,
            len: text.len(),
            outcome,
        });
        offset += raw.len() as u64;
        line_no += 1;
    }
    checked
}

/// A valid line's outcome, its custom_id and model kept in the block's buffers.
fn valid(checked: &mut CheckedBlock, line: CheckedLine<'_>) -> Outcome {
    let start = checked.custom_ids.len();
    checked.custom_ids.push_str(&line.custom_id);
    let model = match checked.models.iter().position(|m| *m == line.model) {
        Some(i) => i,
        None => {
            checked.models.push(line.model.into_owned());
            checked.models.len() - 1
        }
    };
    let url = batch_wire::ALLOWED_URLS
        .iter()
        .find(|u| **u == line.url)
        .expect("a valid line has an allowed url");
    Outcome::Valid {
        custom_id: (start, checked.custom_ids.len()),
        model,
        url,
        prefix_hash: line.prefix_hash,
    }
}

/// The lines of `bytes`, each with its newline (the last may lack one), given the offset after
/// each newline.
fn lines_of<'a>(bytes: &'a [u8], ends: &'a [usize]) -> impl Iterator<Item = &'a [u8]> {
    let mut start = 0;
    ends.iter()
        .copied()
        .chain(std::iter::once(bytes.len()))
        .filter_map(move |end| {
            let line = (end > start).then(|| &bytes[start..end]);
            start = end;
            line
        })
}

/// Hands checked blocks to the builder in file order, whatever order the workers finish in.
#[derive(Default)]
pub(crate) struct InOrder {
    next: u64,
    early: BTreeMap<u64, CheckedBlock>,
}

impl InOrder {
    pub(crate) fn take(&mut self, checked: CheckedBlock, builder: &mut Builder) {
        self.early.insert(checked.seq, checked);
        while let Some(block) = self.early.remove(&self.next) {
            for line in &block.lines {
                builder.line(line, &block);
            }
            self.next += 1;
        }
    }
}

pub(crate) fn blank_line_error(line_no: u64) -> BatchError {
    BatchError {
        code: error_codes::INVALID_JSON_LINE.into(),
        message: "the line is empty".into(),
        param: None,
        line: Some(line_no),
    }
}
