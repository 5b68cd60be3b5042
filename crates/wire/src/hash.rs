//! FNV-1a hashes, used where a stable, dependency-free digest is part of a format.

const OFFSET_32: u32 = 0x811c_9dc5;
const PRIME_32: u32 = 0x0100_0193;
const OFFSET_64: u64 = 0xcbf2_9ce4_8422_2325;
const PRIME_64: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a 32 of `bytes`: the plan files' system-prompt hash, as the original processor computes it.
pub fn fnv1a_32(bytes: &[u8]) -> u32 {
    bytes
        .iter()
        .fold(OFFSET_32, |h, &b| (h ^ b as u32).wrapping_mul(PRIME_32))
}

/// FNV-1a 64 of `bytes`.
pub fn fnv1a_64(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(OFFSET_64, |h, &b| (h ^ b as u64).wrapping_mul(PRIME_64))
}

/// The digest the simulated gateway puts in every reply: FNV-1a 64 of the exact request body,
/// as 16 lowercase hex digits. A test recomputes it from an input line's body to prove that an
/// output line answers that very line.
pub fn body_digest(body: &[u8]) -> String {
    format!("{:016x}", fnv1a_64(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vectors() {
        // Published FNV-1a test vectors.
        assert_eq!(fnv1a_32(b""), 0x811c9dc5);
        assert_eq!(fnv1a_32(b"a"), 0xe40c292c);
        assert_eq!(fnv1a_32(b"foobar"), 0xbf9cf968);
        assert_eq!(fnv1a_64(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a_64(b"foobar"), 0x85944171f73967e8);
        assert_eq!(body_digest(b"a"), "af63dc4c8601ec8c");
    }
}
