//! The fallback and baseline: KVM's per-slot dirty bitmap.
//!
//! KVM_GET_DIRTY_LOG copies one bit per page of the slot, so a harvest costs
//! O(guest memory) however few pages changed. Without manual protection the
//! ioctl also clears the bitmap and re-protects the pages it reported; with
//! KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 it only reads, and we re-protect with
//! KVM_CLEAR_DIRTY_LOG over the span of words that had bits set.

use crate::vstate::vm::{Vm, VmError};

/// One slot's reusable bitmap buffer.
#[derive(Debug)]
struct SlotBitmap {
    slot: u32,
    pages: u64,
    words: Vec<u64>,
}

/// Harvests the dirty bitmaps of every slot.
#[derive(Debug)]
pub struct BitmapLog {
    slots: Vec<SlotBitmap>,
    manual_protect: bool,
}

impl BitmapLog {
    /// Buffers for `slots` = (slot id, pages). `manual_protect` says whether
    /// KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 is on for the VM.
    pub fn new(slots: impl IntoIterator<Item = (u32, u64)>, manual_protect: bool) -> Self {
        BitmapLog {
            slots: slots
                .into_iter()
                .map(|(slot, pages)| SlotBitmap {
                    slot,
                    pages,
                    words: vec![0; pages.div_ceil(64) as usize],
                })
                .collect(),
            manual_protect,
        }
    }

    /// Whether KVM_CLEAR_DIRTY_LOG is used.
    pub fn manual_protect(&self) -> bool {
        self.manual_protect
    }

    /// Fetches every slot's bitmap, re-protects what it reports, and calls
    /// `f(slot, page_offset)` for each dirty page.
    pub fn harvest(&mut self, vm: &Vm, mut f: impl FnMut(u32, u64)) -> Result<(), VmError> {
        for s in &mut self.slots {
            vm.get_dirty_log_into(s.slot, &mut s.words)?;
            let Some((first, last)) = nonzero_span(&s.words) else {
                continue;
            };
            if self.manual_protect {
                let (first_page, num_pages) = clear_range(first, last, s.pages);
                vm.clear_dirty_log(s.slot, first_page, num_pages, &s.words[first..=last])?;
            }
            for page in set_bits(&s.words[first..=last], first as u64 * 64) {
                f(s.slot, page);
            }
        }
        Ok(())
    }
}

/// Indices of the first and last non-zero words.
pub fn nonzero_span(words: &[u64]) -> Option<(usize, usize)> {
    let first = words.iter().position(|&w| w != 0)?;
    let last = words.iter().rposition(|&w| w != 0)?;
    Some((first, last))
}

/// The KVM_CLEAR_DIRTY_LOG range covering words `first..=last` of a slot of
/// `slot_pages` pages: `first_page` a multiple of 64, and `num_pages` a
/// multiple of 64 unless the range reaches the slot's end (KVM's rule).
pub fn clear_range(first: usize, last: usize, slot_pages: u64) -> (u64, u32) {
    let first_page = first as u64 * 64;
    let end = ((last as u64 + 1) * 64).min(slot_pages);
    (first_page, end.saturating_sub(first_page) as u32)
}

/// Page numbers of the set bits of `words`, bit 0 of word 0 being `base`.
pub fn set_bits(words: &[u64], base: u64) -> impl Iterator<Item = u64> + '_ {
    words.iter().enumerate().flat_map(move |(i, &w)| {
        let mut w = w;
        std::iter::from_fn(move || {
            if w == 0 {
                return None;
            }
            let bit = w.trailing_zeros();
            w &= w - 1;
            Some(base + i as u64 * 64 + u64::from(bit))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_bits_lists_pages() {
        let words = [0b1010, 0, 1 << 63];
        assert_eq!(
            set_bits(&words, 128).collect::<Vec<_>>(),
            vec![129, 131, 128 + 128 + 63]
        );
        assert_eq!(set_bits(&[0, 0], 0).count(), 0);
    }

    #[test]
    fn span_and_clear_range_follow_kvm_rules() {
        assert_eq!(nonzero_span(&[0, 0]), None);
        assert_eq!(nonzero_span(&[0, 4, 0, 1, 0]), Some((1, 3)));
        // Middle of a big slot: whole words.
        assert_eq!(clear_range(1, 3, 1 << 20), (64, 192));
        // Reaching a slot end that is not a multiple of 64.
        assert_eq!(clear_range(1, 1, 100), (64, 36));
    }
}
