use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Bytes per record in a plan file.
pub const RECORD_LEN: usize = 20;

/// Where one request line is in the input file.
///
/// On disk: offset u64, length u32, prefix hash u32, line u32, little-endian. The original
/// processor's 16-byte record has no line index; ours carries it because the line index is part
/// of every request id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// Byte offset of the line.
    pub offset: u64,
    /// Length without the newline.
    pub len: u32,
    /// FNV-1a 32 of the first system prompt, or [`crate::NO_PREFIX`].
    pub prefix_hash: u32,
    /// 0-based line index.
    pub line: u32,
}

impl Record {
    fn encode(&self) -> [u8; RECORD_LEN] {
        let mut b = [0u8; RECORD_LEN];
        b[0..8].copy_from_slice(&self.offset.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&self.prefix_hash.to_le_bytes());
        b[16..20].copy_from_slice(&self.line.to_le_bytes());
        b
    }

    fn decode(b: &[u8; RECORD_LEN]) -> Self {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Self {
            offset: u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
            len: u32_at(8),
            prefix_hash: u32_at(12),
            line: u32_at(16),
        }
    }
}

pub(crate) fn write_records(path: &Path, records: &[Record]) -> std::io::Result<()> {
    let mut out = BufWriter::new(File::create(path)?);
    for r in records {
        out.write_all(&r.encode())?;
    }
    out.into_inner().map_err(|e| e.into_error())?.sync_all()
}

/// Streams the records of a plan file.
#[derive(Debug)]
pub struct RecordReader {
    inner: BufReader<File>,
}

impl RecordReader {
    pub(crate) fn open(path: &Path) -> std::io::Result<Self> {
        Ok(Self {
            inner: BufReader::with_capacity(1 << 16, File::open(path)?),
        })
    }
}

impl Iterator for RecordReader {
    type Item = std::io::Result<Record>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut buf = [0u8; RECORD_LEN];
        match self.inner.read_exact(&mut buf) {
            Ok(()) => Some(Ok(Record::decode(&buf))),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => None,
            Err(e) => Some(Err(e)),
        }
    }
}

/// The input file, for positioned reads of single lines.
#[derive(Debug)]
pub struct InputFile {
    file: File,
}

impl InputFile {
    /// Opens `path` for reading.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        Ok(Self {
            file: File::open(path)?,
        })
    }

    /// The line `record` points at, without its newline.
    pub fn read(&self, record: &Record) -> std::io::Result<Vec<u8>> {
        let mut buf = Vec::new();
        self.read_into(record, &mut buf)?;
        Ok(buf)
    }

    /// Like [`InputFile::read`], reusing `buf`.
    pub fn read_into(&self, record: &Record, buf: &mut Vec<u8>) -> std::io::Result<()> {
        buf.clear();
        buf.resize(record.len as usize, 0);
        self.file.read_exact_at(buf, record.offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn encode_decode(offset in any::<u64>(), len in any::<u32>(), prefix_hash in any::<u32>(), line in any::<u32>()) {
            let r = Record { offset, len, prefix_hash, line };
            prop_assert_eq!(Record::decode(&r.encode()), r);
        }
    }
}
