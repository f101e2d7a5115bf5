//! The self-checking 4 KiB disk block written by the `disk` workload.
//!
//! Layout (little endian):
//!
//! | offset | size | field                                              |
//! |--------|------|----------------------------------------------------|
//! | 0      | 8    | magic `KEMARIBK`                                   |
//! | 8      | 8    | block number (its index on the disk, in 4 KiB units)|
//! | 16     | 8    | sequence: the write's position in its run          |
//! | 24     | 8    | checksum of the whole block, this field as zero    |
//! | 32     | 4064 | payload derived from (block, sequence)             |
//!
//! A block that is all zeroes was never written ("missing"); any other block
//! that fails the magic, block-number or checksum test is "corrupt".

/// Size of one block: 8 sectors of 512 bytes.
pub const BLOCK_SIZE: usize = 4096;
/// Sectors per block.
pub const SECTORS_PER_BLOCK: u64 = (BLOCK_SIZE / 512) as u64;
/// `KEMARIBK` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"KEMARIBK");

const CHECKSUM_WORD: usize = 3;
const WORDS: usize = BLOCK_SIZE / 8;

/// What a block read back from the disk turned out to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// A valid block with this sequence number.
    Valid { seq: u64 },
    /// All zeroes: never written.
    Missing,
    /// Anything else.
    Corrupt,
}

fn word(buf: &[u8; BLOCK_SIZE], i: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&buf[i * 8..i * 8 + 8]);
    u64::from_le_bytes(w)
}

fn set_word(buf: &mut [u8; BLOCK_SIZE], i: usize, v: u64) {
    buf[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
}

/// A 64-bit checksum over the block's words (the checksum word counts as
/// zero): a multiply-rotate mix that catches reordered and flipped words.
pub fn checksum(buf: &[u8; BLOCK_SIZE]) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in 0..WORDS {
        let w = if i == CHECKSUM_WORD { 0 } else { word(buf, i) };
        h = (h ^ w ^ i as u64)
            .wrapping_mul(0xff51_afd7_ed55_8ccd)
            .rotate_left(29);
    }
    h
}

/// Fills `buf` with block `block`, written as the `seq`-th write of a run.
pub fn fill(buf: &mut [u8; BLOCK_SIZE], block: u64, seq: u64) {
    set_word(buf, 0, MAGIC);
    set_word(buf, 1, block);
    set_word(buf, 2, seq);
    set_word(buf, CHECKSUM_WORD, 0);
    // xorshift64 seeded from (block, seq); never zero.
    let mut x = block.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ seq.rotate_left(32) ^ 1;
    for i in 4..WORDS {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        set_word(buf, i, x);
    }
    let sum = checksum(buf);
    set_word(buf, CHECKSUM_WORD, sum);
}

/// Classifies a block read back from position `block`.
pub fn check(buf: &[u8; BLOCK_SIZE], block: u64) -> BlockState {
    if word(buf, 0) != MAGIC {
        return if buf.iter().all(|&b| b == 0) {
            BlockState::Missing
        } else {
            BlockState::Corrupt
        };
    }
    if word(buf, 1) != block || word(buf, CHECKSUM_WORD) != checksum(buf) {
        return BlockState::Corrupt;
    }
    BlockState::Valid { seq: word(buf, 2) }
}

/// The block written at step `i` of a run over `n` blocks: `i` itself, or
/// for random order `i * a + c mod n` with `a` coprime to `n` — a
/// permutation that needs no memory.
pub fn block_at(random: bool, i: u64, n: u64) -> u64 {
    Permutation::new(random, n).at(i)
}

/// The order `block_at` describes, with its multiplier computed once.
#[derive(Clone, Copy, Debug)]
pub struct Permutation {
    a: u64,
    c: u64,
    n: u64,
}

impl Permutation {
    /// The identity (`random` false) or the pseudo-random order over 0..n.
    pub fn new(random: bool, n: u64) -> Self {
        if !random || n == 0 {
            return Self { a: 1, c: 0, n };
        }
        let mut a = (n.wrapping_mul(0x9e37) >> 16) | 1;
        while gcd(a, n) != 1 {
            a += 2;
        }
        Self { a, c: n / 3, n }
    }

    /// Element `i` (< n) of the order.
    pub fn at(&self, i: u64) -> u64 {
        if self.a == 1 && self.c == 0 {
            return i;
        }
        ((i as u128 * self.a as u128 + self.c as u128) % self.n as u128) as u64
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_order_is_a_permutation() {
        for n in [1u64, 2, 3, 10, 97, 1000, 4096, 10_000] {
            let mut seen = std::vec![false; n as usize];
            for i in 0..n {
                let b = block_at(true, i, n);
                assert!(!seen[b as usize], "n={n}: block {b} twice");
                seen[b as usize] = true;
            }
        }
        assert_eq!(block_at(false, 5, 10), 5);
        assert_ne!(
            (0..10)
                .map(|i| block_at(true, i, 10_000))
                .collect::<std::vec::Vec<_>>(),
            (0..10).collect::<std::vec::Vec<_>>()
        );
    }

    #[test]
    fn round_trip() {
        let mut buf = [0u8; BLOCK_SIZE];
        fill(&mut buf, 1234, 7);
        assert_eq!(check(&buf, 1234), BlockState::Valid { seq: 7 });
    }

    #[test]
    fn zero_block_is_missing() {
        assert_eq!(check(&[0u8; BLOCK_SIZE], 0), BlockState::Missing);
    }

    #[test]
    fn misplaced_block_is_corrupt() {
        let mut buf = [0u8; BLOCK_SIZE];
        fill(&mut buf, 5, 0);
        assert_eq!(check(&buf, 6), BlockState::Corrupt);
    }

    #[test]
    fn any_flipped_bit_is_corrupt() {
        let mut buf = [0u8; BLOCK_SIZE];
        fill(&mut buf, 42, 3);
        for byte in [0, 9, 17, 25, 40, 2000, BLOCK_SIZE - 1] {
            for bit in 0..8 {
                let mut bad = buf;
                bad[byte] ^= 1 << bit;
                assert_eq!(
                    check(&bad, 42),
                    BlockState::Corrupt,
                    "byte {byte} bit {bit}"
                );
            }
        }
    }

    #[test]
    fn torn_block_is_corrupt() {
        let mut old = [0u8; BLOCK_SIZE];
        let mut new = [0u8; BLOCK_SIZE];
        fill(&mut old, 9, 1);
        fill(&mut new, 9, 2);
        // First sector of the new write, rest of the old one.
        new[512..].copy_from_slice(&old[512..]);
        assert_eq!(check(&new, 9), BlockState::Corrupt);
    }

    #[test]
    fn partly_zero_block_is_corrupt() {
        let mut buf = [0u8; BLOCK_SIZE];
        fill(&mut buf, 3, 0);
        buf[..512].fill(0);
        assert_eq!(check(&buf, 3), BlockState::Corrupt);
    }
}
