//! The self-checking contents of a virtio-pmem window, written by the `pmem`
//! workload, and by tests from the host into the backing file.
//!
//! One *generation* covers the whole window. Layout (little endian, 8-byte
//! words):
//!
//! | offset | size | field                                                  |
//! |--------|------|--------------------------------------------------------|
//! | 0      | 8    | magic `KEMARIPM`                                       |
//! | 8      | 8    | generation                                             |
//! | 16     | 8    | size: the window's length in bytes when written        |
//! | 24     | 8    | header check: a mix of the three words before          |
//! | 32     | …    | word `i` (byte `8·i`) = `pattern(generation, i)`       |
//!
//! Every word of the window depends on the generation and its position, so a
//! window holding another generation, stale pages, pages moved about or a
//! single flipped bit fails the check. A window that is all zeroes was never
//! written ("empty").

/// `KEMARIPM` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"KEMARIPM");
/// Words of the header.
pub const HEADER_WORDS: usize = 4;

/// What a window read back turned out to hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PmemState {
    /// A whole generation.
    Valid { generation: u64 },
    /// All zeroes: never written.
    Empty,
    /// No header of this format (wrong magic, size or header check), and
    /// not all zero: nothing to compare the rest against.
    BadHeader { magic: u64, size: u64 },
    /// A valid header, but `bad_words` words differ from its generation's
    /// pattern, the first at byte `first_bad`.
    Damaged {
        generation: u64,
        first_bad: u64,
        bad_words: u64,
    },
}

/// The word at index `i` (>= [`HEADER_WORDS`]) of generation `generation`:
/// a splitmix64-style mix of both, so neighbouring words and neighbouring
/// generations share nothing.
pub fn pattern(generation: u64, i: u64) -> u64 {
    let mut z =
        generation.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 30)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z = (z ^ (z >> 27)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^ (z >> 31)
}

fn header_check(generation: u64, size: u64) -> u64 {
    pattern(MAGIC ^ generation, size)
}

fn word(buf: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&buf[i * 8..i * 8 + 8]);
    u64::from_le_bytes(w)
}

fn set_word(buf: &mut [u8], i: usize, v: u64) {
    buf[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
}

/// Writes generation `generation` over the whole of `window` (its length a
/// multiple of 8, at least the header). The header goes last, so a window
/// left half-written keeps the previous header and fails the check.
pub fn fill(window: &mut [u8], generation: u64) {
    assert!(window.len().is_multiple_of(8) && window.len() >= HEADER_WORDS * 8);
    for (i, w) in window.chunks_exact_mut(8).enumerate().skip(HEADER_WORDS) {
        w.copy_from_slice(&pattern(generation, i as u64).to_le_bytes());
    }
    let size = window.len() as u64;
    set_word(window, 1, generation);
    set_word(window, 2, size);
    set_word(window, 3, header_check(generation, size));
    set_word(window, 0, MAGIC);
}

/// Classifies a window read back (its length as given to [`fill`]).
pub fn check(window: &[u8]) -> PmemState {
    if window.len() < HEADER_WORDS * 8 || !window.len().is_multiple_of(8) {
        return PmemState::BadHeader { magic: 0, size: 0 };
    }
    let (magic, generation, size) = (word(window, 0), word(window, 1), word(window, 2));
    if magic != MAGIC
        || size != window.len() as u64
        || word(window, 3) != header_check(generation, size)
    {
        return if window.iter().all(|&b| b == 0) {
            PmemState::Empty
        } else {
            PmemState::BadHeader { magic, size }
        };
    }
    let mut first_bad = None;
    let mut bad_words = 0;
    for (i, w) in window.chunks_exact(8).enumerate().skip(HEADER_WORDS) {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        if u64::from_le_bytes(b) != pattern(generation, i as u64) {
            first_bad.get_or_insert(i as u64 * 8);
            bad_words += 1;
        }
    }
    match first_bad {
        None => PmemState::Valid { generation },
        Some(first_bad) => PmemState::Damaged {
            generation,
            first_bad,
            bad_words,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZE: usize = 64 << 10;

    fn window(generation: u64) -> std::vec::Vec<u8> {
        let mut w = std::vec![0u8; SIZE];
        fill(&mut w, generation);
        w
    }

    #[test]
    fn round_trip() {
        for g in [0, 1, 7, u64::MAX] {
            assert_eq!(check(&window(g)), PmemState::Valid { generation: g });
        }
    }

    #[test]
    fn zero_window_is_empty() {
        assert_eq!(check(&[0u8; SIZE]), PmemState::Empty);
    }

    #[test]
    fn a_flipped_bit_anywhere_is_found() {
        let good = window(3);
        for byte in [0, 9, 17, 25, 32, 4095, 4096, SIZE - 1] {
            let mut bad = good.clone();
            bad[byte] ^= 0x10;
            match check(&bad) {
                PmemState::BadHeader { .. } => assert!(byte < 32, "byte {byte}"),
                PmemState::Damaged {
                    generation,
                    first_bad,
                    bad_words,
                } => {
                    assert_eq!((generation, bad_words), (3, 1), "byte {byte}");
                    assert_eq!(first_bad, byte as u64 & !7);
                }
                other => panic!("byte {byte}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_page_of_the_previous_generation_is_found() {
        let old = window(4);
        let mut new = window(5);
        new[8192..12288].copy_from_slice(&old[8192..12288]);
        assert_eq!(
            check(&new),
            PmemState::Damaged {
                generation: 5,
                first_bad: 8192,
                bad_words: 512
            }
        );
    }

    #[test]
    fn a_window_of_another_size_has_a_bad_header() {
        let w = window(2);
        assert!(matches!(
            check(&w[..SIZE / 2]),
            PmemState::BadHeader { magic: MAGIC, .. }
        ));
        let mut longer = w.clone();
        longer.resize(SIZE * 2, 0);
        assert!(matches!(check(&longer), PmemState::BadHeader { .. }));
    }

    #[test]
    fn a_half_written_window_keeps_the_old_header_and_fails() {
        let mut w = window(8);
        // The body of generation 9 written, the crash before its header.
        let nine = window(9);
        w[32..].copy_from_slice(&nine[32..]);
        assert!(matches!(
            check(&w),
            PmemState::Damaged { generation: 8, .. }
        ));
    }

    #[test]
    fn zeroed_pages_are_damage_not_emptiness() {
        let mut w = window(1);
        w[4096..].fill(0);
        assert!(matches!(
            check(&w),
            PmemState::Damaged {
                generation: 1,
                first_bad: 4096,
                ..
            }
        ));
    }
}
