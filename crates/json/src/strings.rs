//! The string layer: where a JSON string ends and its unescaped text, a block of bytes at a
//! time.

/// String text is looked at a block at a time: 32 bytes as two SSE2 vectors (SSE2 is part of
/// every x86-64 CPU), else (and with the `portable` feature) 8 bytes in a `u64`. A block's mask
/// marks its stops (`"`, `\` and control characters) exactly, so one mask serves every stop of
/// its block.
#[cfg(all(target_arch = "x86_64", not(feature = "portable")))]
mod block {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_max_epu8, _mm_movemask_epi8, _mm_or_si128,
        _mm_set1_epi8,
    };

    pub(super) const LEN: usize = 32;

    /// One bit per byte of a block, lowest first.
    pub(super) type Mask = u64;

    /// The stops of 16 bytes.
    #[inline(always)]
    fn stops16(v: __m128i) -> u32 {
        // SAFETY: SSE2 is in the x86-64 baseline; these read and write registers only.
        unsafe {
            let quote = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'"' as i8));
            let backslash = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\\' as i8));
            // Unsigned `v <= 0x1f`: max(v, 0x1f) is 0x1f.
            let low = _mm_set1_epi8(0x1f);
            let control = _mm_cmpeq_epi8(_mm_max_epu8(v, low), low);
            _mm_movemask_epi8(_mm_or_si128(_mm_or_si128(quote, backslash), control)) as u16 as u32
        }
    }

    /// The stops of `chunk`.
    #[inline(always)]
    pub(super) fn stops(chunk: &[u8; LEN]) -> Mask {
        // SAFETY: each load reads 16 bytes of `chunk`, unaligned.
        let (lo, hi) = unsafe {
            (
                _mm_loadu_si128(chunk.as_ptr().cast()),
                _mm_loadu_si128(chunk.as_ptr().add(16).cast()),
            )
        };
        (stops16(lo) | stops16(hi) << 16) as Mask
    }

    /// The offset of the first stop, or [`LEN`].
    #[inline(always)]
    pub(super) fn first(mask: Mask) -> usize {
        (mask | 1 << LEN).trailing_zeros() as usize
    }

    /// `mask` without the stops before offset `n` (`n < LEN`).
    #[inline(always)]
    pub(super) fn from(mask: Mask, n: usize) -> Mask {
        mask & (!0 << n)
    }
}

#[cfg(any(not(target_arch = "x86_64"), feature = "portable"))]
mod block {
    pub(super) const LEN: usize = 8;

    /// The high bit of each byte of a block, lowest first.
    pub(super) type Mask = u64;

    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;

    /// The high bit of each zero byte of `x`, exactly (no borrow crosses bytes).
    #[inline(always)]
    fn zero_bytes(x: u64) -> u64 {
        !(((x & LOW7).wrapping_add(LOW7)) | x | LOW7)
    }

    /// The stops of `chunk`.
    #[inline(always)]
    pub(super) fn stops(chunk: &[u8; LEN]) -> Mask {
        let w = u64::from_le_bytes(*chunk);
        let splat = |b: u8| u64::from_le_bytes([b; 8]);
        // A control character has none of its top three bits set.
        zero_bytes(w ^ splat(b'"')) | zero_bytes(w ^ splat(b'\\')) | zero_bytes(w & splat(0xe0))
    }

    /// The offset of the first stop, or [`LEN`].
    #[inline(always)]
    pub(super) fn first(mask: Mask) -> usize {
        (mask.trailing_zeros() / 8) as usize
    }

    /// `mask` without the stops before offset `n` (`n < LEN`).
    #[inline(always)]
    pub(super) fn from(mask: Mask, n: usize) -> Mask {
        mask & (!0 << (8 * n))
    }
}

/// The block of `s` at `i`; past the end of `s` it holds `"`, which stops every scan (callers
/// tell that stop from a real one by its position).
#[inline(always)]
fn load(s: &[u8], i: usize) -> [u8; block::LEN] {
    match s.get(i..i + block::LEN) {
        Some(whole) => whole.try_into().expect("a whole block"),
        None => {
            let mut padded = [b'"'; block::LEN];
            let rest = &s[i.min(s.len())..];
            padded[..rest.len()].copy_from_slice(rest);
            padded
        }
    }
}

/// The stops of the block of `s` at `i`, read in place when the block is whole.
#[inline(always)]
fn stops_at(s: &[u8], i: usize) -> block::Mask {
    match s.get(i..i + block::LEN) {
        Some(whole) => block::stops(whole.try_into().expect("a whole block")),
        None => block::stops(&load(s, i)),
    }
}

/// The index of the first byte at or after `i` that is `"`, `\` or a control character,
/// or `s.len()`.
#[inline(always)]
pub(super) fn skip_plain(s: &[u8], mut i: usize) -> usize {
    loop {
        let k = block::first(stops_at(s, i));
        i += k;
        if k < block::LEN {
            return i.min(s.len());
        }
    }
}

fn hex4(s: &[u8], i: usize) -> Option<u16> {
    let digits = s.get(i..i + 4)?;
    digits.iter().try_fold(0u16, |n, &c| {
        let d = (c as char).to_digit(16)?;
        Some(n << 4 | d as u16)
    })
}

/// How surrogate escapes are judged: a string read as text needs them paired; a value only
/// checked (serde_json's `ignore`) takes any four hex digits.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Surrogates {
    Paired,
    Any,
}

/// The end of the escape at `s[i] == '\\'`: the index after it.
#[inline(always)]
fn escape_end(s: &[u8], i: usize, surrogates: Surrogates) -> Option<usize> {
    match s.get(i + 1)? {
        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Some(i + 2),
        b'u' => unicode_escape(s, i, surrogates).map(|(end, _)| end),
        _ => None,
    }
}

/// The `\u` escape at `s[i]`: the index after it (after both halves of a surrogate pair) and
/// its code point, which is a lone surrogate only when `surrogates` lets it be.
#[cold]
#[inline(never)]
fn unicode_escape(s: &[u8], i: usize, surrogates: Surrogates) -> Option<(usize, u32)> {
    let unit = hex4(s, i + 2)? as u32;
    if surrogates == Surrogates::Any {
        return Some((i + 6, unit));
    }
    match unit {
        0xD800..=0xDBFF => {
            if s.get(i + 6..i + 8)? != b"\\u" {
                return None;
            }
            let low = hex4(s, i + 8)? as u32;
            if !(0xDC00..=0xDFFF).contains(&low) {
                return None;
            }
            Some((i + 12, 0x1_0000 + ((unit - 0xD800) << 10) + (low - 0xDC00)))
        }
        0xDC00..=0xDFFF => None,
        _ => Some((i + 6, unit)),
    }
}

/// Where the string whose text starts at `start` (just after its opening quote) ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StringEnd {
    /// The index of the closing quote.
    pub quote: usize,
    /// Whether the text holds escapes (so it is not its own value).
    pub escaped: bool,
}

/// Finds the end of the JSON string whose text starts at `start`, checking it as serde_json
/// does when it reads a string: no control characters, valid escapes, surrogates in pairs.
/// `None` when it is not a valid string.
pub fn string_end(s: &[u8], start: usize) -> Option<StringEnd> {
    scan_string(s, start, Surrogates::Paired)
}

#[inline(always)]
pub(super) fn scan_string(s: &[u8], start: usize, surrogates: Surrogates) -> Option<StringEnd> {
    let mut base = start;
    let mut escaped = false;
    loop {
        let mut mask = stops_at(s, base);
        loop {
            let k = block::first(mask);
            if k == block::LEN {
                break;
            }
            let at = base + k;
            match *s.get(at)? {
                b'"' => return Some(StringEnd { quote: at, escaped }),
                b'\\' => {
                    escaped = true;
                    let end = escape_end(s, at, surrogates)?;
                    if end - base >= block::LEN {
                        base = end - block::LEN;
                        break;
                    }
                    mask = block::from(mask, end - base);
                }
                _ => return None,
            }
        }
        base += block::LEN;
    }
}

/// Reads the JSON string whose text starts at `start` (just after its opening quote) as
/// serde_json reads a string, in one pass: where it ends, and, when it holds escapes, its text
/// appended to `out` (when it holds none, its text is `s[start..quote]` and `out` is left as it
/// was). `None`, with `out` as it was, when it is not a valid string.
pub fn read_string(s: &[u8], start: usize, out: &mut Vec<u8>) -> Option<StringEnd> {
    let first = skip_plain(s, start);
    if s.get(first) == Some(&b'"') {
        return Some(StringEnd {
            quote: first,
            escaped: false,
        });
    }
    let base = out.len();
    // Unescaping never lengthens: room for the rest of `s`, and a block for the last copy.
    out.resize(base + (s.len() - start) + block::LEN, 0);
    // `unescape` takes the end of `s` for the quote of an unterminated string.
    let read = unescape(s, start, &mut out[base..]).filter(|&(quote, _)| quote < s.len());
    let (quote, written) = read.unwrap_or((0, 0));
    out.truncate(base + written);
    read.map(|_| StringEnd {
        quote,
        escaped: true,
    })
}

/// Appends the text of a JSON string, given as its escaped contents (without quotes), to `out`.
/// False, with `out` as it was, when `escaped` is not such contents (an invalid escape, a lone
/// surrogate, a raw `"` or control character).
pub fn unescape_into(escaped: &str, out: &mut Vec<u8>) -> bool {
    let s = escaped.as_bytes();
    let base = out.len();
    out.resize(base + s.len() + block::LEN, 0);
    // Past its end the text reads as a closing quote: one found earlier is a raw `"`.
    let read = unescape(s, 0, &mut out[base..]).filter(|&(quote, _)| quote == s.len());
    out.truncate(base + read.map_or(0, |(_, written)| written));
    read.is_some()
}

/// Unescapes the string text of `s` from `start` into `dst` (a block longer than the rest of
/// `s`) up to its closing quote: the quote's index (`s.len()` when it is missing) and the
/// length written.
#[inline(always)]
fn unescape(s: &[u8], start: usize, dst: &mut [u8]) -> Option<(usize, usize)> {
    // `s[i..]` goes to `dst[o..]`; each copy is a whole block, kept up to the next stop (what
    // follows is written over). `o <= i - start`, so a block always fits.
    let (mut i, mut o) = (start, 0);
    loop {
        let base = i;
        let c = load(s, base);
        dst[o..o + block::LEN].copy_from_slice(&c);
        let mut mask = block::stops(&c);
        loop {
            let k = block::first(mask);
            let at = base + k;
            o += at - i;
            i = at;
            if k == block::LEN {
                break;
            }
            let byte = match s.get(at) {
                // Past the end: the stop was the padding.
                None => return Some((s.len(), o - (at - s.len()))),
                Some(b'"') => return Some((at, o)),
                Some(b'\\') => match *s.get(at + 1)? {
                    quoted @ (b'"' | b'\\' | b'/') => quoted,
                    b'n' => b'\n',
                    b't' => b'\t',
                    b'r' => b'\r',
                    b'b' => 0x08,
                    b'f' => 0x0c,
                    b'u' => {
                        let (end, point) = unicode_escape(s, at, Surrogates::Paired)?;
                        let ch = char::from_u32(point)?;
                        o += ch.encode_utf8(&mut dst[o..]).len();
                        i = end;
                        break;
                    }
                    _ => return None,
                },
                Some(_) => return None,
            };
            dst[o] = byte;
            o += 1;
            i = at + 2;
            if i - base >= block::LEN {
                break;
            }
            // The rest of the block again, one byte further down.
            dst[o..o + block::LEN].copy_from_slice(&load(s, i));
            mask = block::from(mask, i - base);
        }
    }
}
