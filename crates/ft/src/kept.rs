//! The pages a protected guest rewrites from sync to sync, left writable
//! (so it takes no write-protection fault on them), and the contents the
//! standby holds of them (the last sent), so that a carried page is sent
//! only if it changed. A page unchanged for [`COLD_SYNCS`] syncs in a row is
//! cold; once [`COLD_RESET`] are, the writable set is reset so that it
//! follows what the guest rewrites now.

use vmm::memory::GuestMemoryMmap;

use transfer::pages::PAGE;
use transfer::precopy::read_page;
use transfer::TransferError;

/// A kept page unchanged for this many syncs in a row is cold.
pub const COLD_SYNCS: u32 = 8;
/// The writable set is reset once this many kept pages are cold.
pub const COLD_RESET: usize = 8;

/// The contents the standby holds of the pages left writable (the last
/// contents sent), so that a carried page is sent only if it changed.
#[derive(Default)]
pub struct KeptPages {
    /// Each page's last contents sent, and for how many syncs in a row it
    /// has not changed.
    copies: std::collections::HashMap<u64, (Box<[u8; PAGE]>, u32)>,
    /// Buffers of dropped copies, reused (no allocation in the pause).
    spare: Vec<Box<[u8; PAGE]>>,
    scratch: Vec<u8>,
    keep: std::collections::HashSet<u64>,
    sent: std::collections::HashSet<u64>,
    gone: Vec<u64>,
}

impl KeptPages {
    /// The pages of `carried` whose contents differ from the copy (or that
    /// have none).
    pub fn changed(
        &mut self,
        mem: &GuestMemoryMmap,
        carried: &[u64],
    ) -> Result<Vec<u64>, TransferError> {
        self.scratch.resize(PAGE, 0);
        let mut out = Vec::new();
        for &pfn in carried {
            read_page(mem, pfn, &mut self.scratch)?;
            match self.copies.get_mut(&pfn) {
                Some((copy, same)) if copy[..] == self.scratch[..] => *same += 1,
                _ => out.push(pfn),
            }
        }
        Ok(out)
    }

    /// How many kept pages have not changed for [`COLD_SYNCS`] syncs.
    pub fn cold(&self) -> usize {
        self.copies
            .values()
            .filter(|(_, same)| *same >= COLD_SYNCS)
            .count()
    }

    /// After a sync that sent `sent`: keeps a copy of each page of `kept`
    /// (taken again if it was sent), drops the others.
    pub fn refresh(
        &mut self,
        mem: &GuestMemoryMmap,
        kept: &[u64],
        sent: &[u64],
    ) -> Result<(), TransferError> {
        if kept.is_empty() {
            self.spare.extend(self.copies.drain().map(|(_, (b, _))| b));
            return Ok(());
        }
        // Reused sets: no allocation in the guest's pause once warm.
        self.keep.clear();
        self.keep.extend(kept.iter().copied());
        self.gone.clear();
        self.gone.extend(
            self.copies
                .keys()
                .filter(|p| !self.keep.contains(p))
                .copied(),
        );
        for pfn in self.gone.drain(..) {
            if let Some((b, _)) = self.copies.remove(&pfn) {
                self.spare.push(b);
            }
        }
        self.sent.clear();
        self.sent.extend(sent.iter().copied());
        for &pfn in kept {
            if self.copies.contains_key(&pfn) && !self.sent.contains(&pfn) {
                continue;
            }
            let mut buf = self
                .copies
                .remove(&pfn)
                .map(|(b, _)| b)
                .or_else(|| self.spare.pop())
                .unwrap_or_else(|| Box::new([0; PAGE]));
            read_page(mem, pfn, &mut buf[..])?;
            self.copies.insert(pfn, (buf, 0));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestAddress};
    use vmm::memory::{GuestMemoryFile, MemoryBacking};

    fn page(mem: &GuestMemoryMmap, pfn: u64, byte: u8) {
        mem.write_slice(&[byte; PAGE], GuestAddress(pfn * PAGE as u64))
            .unwrap();
    }

    #[test]
    fn kept_pages_are_sent_only_when_they_changed() {
        let file = GuestMemoryFile::create(16 << 20, &MemoryBacking::Memfd).unwrap();
        let mem = file.map().unwrap();
        let mut kept = KeptPages::default();
        // No copy yet: carried pages count as changed.
        assert_eq!(kept.changed(&mem, &[1, 2]).unwrap(), vec![1, 2]);
        page(&mem, 1, 0xaa);
        kept.refresh(&mem, &[1, 2], &[1, 2]).unwrap();
        // Unchanged: not sent; page 2 rewritten with other bytes: sent.
        assert!(kept.changed(&mem, &[1, 2]).unwrap().is_empty());
        page(&mem, 2, 0x55);
        assert_eq!(kept.changed(&mem, &[1, 2]).unwrap(), vec![2]);
        kept.refresh(&mem, &[1, 2], &[2]).unwrap();
        assert!(kept.changed(&mem, &[1, 2]).unwrap().is_empty());
        // The same bytes written again are no change (the standby has them).
        page(&mem, 1, 0xaa);
        assert!(kept.changed(&mem, &[1]).unwrap().is_empty());
        // A page no longer kept loses its copy; a reset (nothing kept)
        // drops every copy.
        kept.refresh(&mem, &[2], &[]).unwrap();
        assert_eq!(kept.changed(&mem, &[1]).unwrap(), vec![1]);
        kept.refresh(&mem, &[], &[]).unwrap();
        assert_eq!(kept.changed(&mem, &[2]).unwrap(), vec![2]);
        assert!(kept.copies.is_empty() && !kept.spare.is_empty());
    }

    #[test]
    fn pages_unchanged_for_several_syncs_are_cold() {
        let file = GuestMemoryFile::create(16 << 20, &MemoryBacking::Memfd).unwrap();
        let mem = file.map().unwrap();
        let mut kept = KeptPages::default();
        let pages: Vec<u64> = (0..COLD_RESET as u64 + 1).collect();
        kept.refresh(&mem, &pages, &pages).unwrap();
        for sync in 0..COLD_SYNCS {
            assert_eq!(kept.cold(), 0, "sync {sync}");
            // Page 0 changes every time; the others never do.
            page(&mem, 0, sync as u8 + 1);
            let changed = kept.changed(&mem, &pages).unwrap();
            assert_eq!(changed, vec![0]);
            kept.refresh(&mem, &pages, &changed).unwrap();
        }
        assert_eq!(kept.cold(), COLD_RESET);
    }
}
