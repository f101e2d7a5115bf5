//! [`DirtyTracker`]: every guest page that changed since the previous harvest,
//! whoever wrote it — the guest's vCPUs (through KVM's dirty ring, or its
//! dirty bitmap where there is no ring) and the VMM itself (through
//! [`VmmDirtyPages`](super::VmmDirtyPages)).
//!
//! Life cycle (see docs/dirty-tracking.md):
//! 1. [`DirtyTracker::new`] right after the VM is created and *before any
//!    vCPU exists*: chooses ring or bitmap and enables the ring capability.
//! 2. [`DirtyTracker::attach_vcpu`] for each vCPU before its thread starts:
//!    maps the vCPU's ring and installs its ring-full handler.
//! 3. At run time, [`start`](DirtyTracker::start) /
//!    [`harvest`](DirtyTracker::harvest) /
//!    [`harvest_running`](DirtyTracker::harvest_running) /
//!    [`stop`](DirtyTracker::stop), as often as needed.
//!
//! Semantics: after `start()` returns, every harvest returns (as guest page
//! frame numbers, each once) at least every page written since `start()`
//! returned or since the previous harvest began; it may also return pages
//! written while the previous harvest ran (they are reported again later if
//! written again). A page's contents read *after* the harvest returns are at
//! least as new as the write that made it dirty: any later write is reported
//! by a later harvest.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use super::bitmap::BitmapLog;
use super::ring::{DirtyRing, RingError, MIN_RING_ENTRIES};
use super::PAGE_SIZE;
use crate::memory::{self, GuestMemoryMmap};
use crate::vstate::vcpu::{Vcpu, VcpuError, VcpuHandle};
use crate::vstate::vm::{Vm, VmError};

/// Default ring size: 64 KiB per vCPU; KVM asks for a harvest after 4032
/// entries (64 are reserved).
pub const DEFAULT_RING_ENTRIES: u32 = 4096;

/// How KVM reports pages the guest writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DirtyTrackerKind {
    /// Per-vCPU dirty rings: harvest cost O(dirty pages).
    Ring,
    /// Per-slot dirty bitmaps: harvest cost O(guest memory).
    Bitmap,
}

/// Which kind the caller wants.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DirtyTrackingMode {
    /// The ring if KVM has it, else the bitmap.
    #[default]
    Auto,
    /// The ring, or an error.
    Ring,
    /// The bitmap, even if KVM has the ring.
    Bitmap,
}

/// Choices made at VM creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirtyTrackerConfig {
    /// Ring, bitmap or automatic.
    pub mode: DirtyTrackingMode,
    /// Entries per vCPU ring: a power of two, at least 256.
    pub ring_entries: u32,
}

impl Default for DirtyTrackerConfig {
    fn default() -> Self {
        DirtyTrackerConfig {
            mode: DirtyTrackingMode::Auto,
            ring_entries: DEFAULT_RING_ENTRIES,
        }
    }
}

/// Errors of dirty tracking.
#[derive(Debug, thiserror::Error)]
pub enum DirtyError {
    /// The ring was asked for and KVM has none.
    #[error("KVM offers no dirty ring (KVM_CAP_DIRTY_LOG_RING[_ACQ_REL])")]
    RingUnavailable,
    /// The ring size is out of KVM's range.
    #[error("dirty ring of {entries} entries: KVM allows {min}..={max} (powers of two)")]
    RingSize {
        /// Asked for.
        entries: u32,
        /// Smallest.
        min: u32,
        /// Largest KVM offers.
        max: u32,
    },
    /// Mapping a ring failed.
    #[error(transparent)]
    Ring(#[from] RingError),
    /// A VM ioctl failed.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// Kicking a vCPU failed.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// A vCPU was attached twice.
    #[error("vCPU {0} already has a dirty ring")]
    AlreadyAttached(u8),
}

/// Counters (metrics).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirtyStats {
    /// Harvests returned to callers.
    pub harvests: u64,
    /// Pages returned, summed over harvests.
    pub pages: u64,
    /// Ring entries read (including duplicates and ring-full harvests).
    pub ring_entries: u64,
    /// Harvests made by vCPUs on KVM_EXIT_DIRTY_RING_FULL.
    pub ring_full: u64,
    /// Ring entries naming no known slot/page (ignored).
    pub bad_entries: u64,
    /// Pages the VMM wrote.
    pub vmm_pages: u64,
}

#[derive(Default)]
struct Counters {
    harvests: AtomicU64,
    pages: AtomicU64,
    ring_entries: AtomicU64,
    ring_full: AtomicU64,
    bad_entries: AtomicU64,
    vmm_pages: AtomicU64,
}

/// One KVM memory slot as the tracker sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SlotInfo {
    id: u32,
    first_pfn: u64,
    pages: u64,
    /// Index of the slot's first page among all tracked pages.
    dense_base: u64,
}

/// Translation between KVM's (slot, offset), guest page frame numbers, and a
/// dense page index over all slots (for the dedup flags).
#[derive(Debug, Clone, Default)]
pub(crate) struct SlotMap {
    slots: Vec<SlotInfo>,
    total_pages: u64,
}

impl SlotMap {
    /// From (slot id, guest physical address, size in bytes).
    pub(crate) fn new(regions: impl IntoIterator<Item = (u32, u64, u64)>) -> Self {
        let mut slots: Vec<SlotInfo> = regions
            .into_iter()
            .map(|(id, gpa, size)| SlotInfo {
                id,
                first_pfn: gpa / PAGE_SIZE as u64,
                pages: size / PAGE_SIZE as u64,
                dense_base: 0,
            })
            .collect();
        slots.sort_by_key(|s| s.first_pfn);
        let mut total = 0;
        for s in &mut slots {
            s.dense_base = total;
            total += s.pages;
        }
        SlotMap {
            slots,
            total_pages: total,
        }
    }

    pub(crate) fn total_pages(&self) -> u64 {
        self.total_pages
    }

    /// Dense index of a ring entry's page; `None` for anything KVM should not
    /// have reported (another address space, unknown slot, offset past the end).
    pub(crate) fn dense_of_entry(&self, slot_field: u32, offset: u64) -> Option<u64> {
        let (as_id, id) = (slot_field >> 16, slot_field & 0xffff);
        if as_id != 0 {
            return None;
        }
        let s = self.slots.iter().find(|s| s.id == id)?;
        (offset < s.pages).then(|| s.dense_base + offset)
    }

    pub(crate) fn dense_of_pfn(&self, pfn: u64) -> Option<u64> {
        let s = self
            .slots
            .iter()
            .find(|s| pfn >= s.first_pfn && pfn - s.first_pfn < s.pages)?;
        Some(s.dense_base + (pfn - s.first_pfn))
    }

    pub(crate) fn pfn_of_dense(&self, dense: u64) -> Option<u64> {
        let i = self.slots.partition_point(|s| s.dense_base <= dense);
        let s = self.slots.get(i.checked_sub(1)?)?;
        (dense - s.dense_base < s.pages).then(|| s.first_pfn + (dense - s.dense_base))
    }
}

/// A set of dense page indices with O(1) insert and O(len) take: a flag per
/// page plus a queue, the KVM-Kemari paper's structure.
#[derive(Debug, Default)]
pub(crate) struct PageSet {
    flags: Vec<u64>,
    queue: Vec<u64>,
    pages: u64,
}

impl PageSet {
    pub(crate) fn new(pages: u64) -> Self {
        PageSet {
            flags: vec![0; pages.div_ceil(64) as usize],
            queue: Vec::new(),
            pages,
        }
    }

    /// Adds `page`; false if it was already there (or out of range).
    pub(crate) fn insert(&mut self, page: u64) -> bool {
        if page >= self.pages {
            return false;
        }
        let (word, bit) = ((page / 64) as usize, page % 64);
        let Some(w) = self.flags.get_mut(word) else {
            return false;
        };
        if *w & (1 << bit) != 0 {
            return false;
        }
        *w |= 1 << bit;
        self.queue.push(page);
        true
    }

    /// Takes every page, in insertion order, leaving the set empty.
    pub(crate) fn take(&mut self) -> Vec<u64> {
        let pages = std::mem::take(&mut self.queue);
        for &p in &pages {
            self.flags[(p / 64) as usize] &= !(1 << (p % 64));
        }
        pages
    }

    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether `page` is in the set.
    pub(crate) fn contains(&self, page: u64) -> bool {
        page < self.pages && self.flags[(page / 64) as usize] & (1 << (page % 64)) != 0
    }

    /// The pages, in insertion order, left in the set.
    pub(crate) fn pages(&self) -> &[u64] {
        &self.queue
    }
}

/// State while tracking is on.
struct Tracking {
    slots: SlotMap,
    pending: PageSet,
    bitmap: Option<BitmapLog>,
    /// Pages whose ring entries were harvested by
    /// [`DirtyTracker::harvest_paused_keep_writable`] but not yet reset: KVM
    /// still lets the guest write them without a fault, so without a ring
    /// entry either. Every harvest returns them until a reset re-protects
    /// them.
    writable: PageSet,
    /// Scratch: the ring entries of the keep-writable harvest under way.
    fresh: PageSet,
}

/// Where [`DirtyTracker::read_rings`] puts the pages it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RingTarget {
    Pending,
    Fresh,
}

/// What [`DirtyTracker::harvest_paused_keep_writable`] found (guest page
/// frame numbers).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeptHarvest {
    /// Written since the previous harvest: the guest's ring entries and the
    /// VMM's own writes, each once.
    pub dirty: Vec<u64>,
    /// Left writable by an earlier harvest (so untracked since), not in
    /// `dirty`: each may or may not have changed.
    pub carried: Vec<u64>,
    /// Every page left writable after this harvest (`carried` and the
    /// guest's new ones): the next harvest's `carried`, less what it finds
    /// dirty. Empty after a reset.
    pub kept: Vec<u64>,
}

struct State {
    /// Ring of each vCPU, by index.
    rings: Vec<Option<DirtyRing>>,
    tracking: Option<Tracking>,
    /// Ring entries were harvested without KVM_RESET_DIRTY_RINGS since.
    reset_owed: bool,
}

/// Dirty-page tracking of one VM. Share it as `Arc<DirtyTracker>`.
pub struct DirtyTracker {
    vm: Vm,
    memory: GuestMemoryMmap,
    kind: DirtyTrackerKind,
    ring_entries: u32,
    manual_protect: bool,
    state: Mutex<State>,
    counters: Counters,
}

impl std::fmt::Debug for DirtyTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirtyTracker")
            .field("kind", &self.kind)
            .field("ring_entries", &self.ring_entries)
            .field("manual_protect", &self.manual_protect)
            .finish()
    }
}

impl DirtyTracker {
    /// Chooses the kind and, for the ring, enables it on `vm`. Must be called
    /// before the first vCPU is created. Tracking starts off.
    pub fn new(
        vm: &Vm,
        memory: &GuestMemoryMmap,
        config: DirtyTrackerConfig,
    ) -> Result<Arc<Self>, DirtyError> {
        let support = vm.dirty_ring_support();
        let use_ring = match config.mode {
            DirtyTrackingMode::Bitmap => false,
            DirtyTrackingMode::Ring => {
                support.ok_or(DirtyError::RingUnavailable)?;
                true
            }
            DirtyTrackingMode::Auto => support.is_some(),
        };
        let (kind, ring_entries, manual_protect) = match support {
            Some((cap, max_bytes)) if use_ring => {
                let max = (max_bytes / std::mem::size_of::<kvm_bindings::kvm_dirty_gfn>()) as u32;
                let entries = config.ring_entries;
                if entries < MIN_RING_ENTRIES || !entries.is_power_of_two() || entries > max {
                    return Err(DirtyError::RingSize {
                        entries,
                        min: MIN_RING_ENTRIES,
                        max,
                    });
                }
                vm.enable_dirty_ring(cap, entries)?;
                (DirtyTrackerKind::Ring, entries, false)
            }
            _ => (
                DirtyTrackerKind::Bitmap,
                0,
                vm.enable_manual_dirty_protect()?,
            ),
        };
        tracing::info!(
            kind = ?kind,
            ring_entries,
            manual_protect,
            "dirty tracker ready"
        );
        Ok(Arc::new(DirtyTracker {
            vm: vm.try_clone()?,
            memory: memory.clone(),
            kind,
            ring_entries,
            manual_protect,
            state: Mutex::new(State {
                rings: Vec::new(),
                tracking: None,
                reset_owed: false,
            }),
            counters: Counters::default(),
        }))
    }

    /// Ring or bitmap.
    pub fn kind(&self) -> DirtyTrackerKind {
        self.kind
    }

    /// Entries per vCPU ring (0 for the bitmap).
    pub fn ring_entries(&self) -> u32 {
        self.ring_entries
    }

    /// Whether the bitmap uses KVM_CLEAR_DIRTY_LOG (manual protection).
    pub fn manual_protect(&self) -> bool {
        self.manual_protect
    }

    /// Whether tracking is on.
    pub fn is_active(&self) -> bool {
        self.lock().tracking.is_some()
    }

    /// Counters since creation.
    pub fn stats(&self) -> DirtyStats {
        let c = &self.counters;
        DirtyStats {
            harvests: c.harvests.load(Ordering::Relaxed),
            pages: c.pages.load(Ordering::Relaxed),
            ring_entries: c.ring_entries.load(Ordering::Relaxed),
            ring_full: c.ring_full.load(Ordering::Relaxed),
            bad_entries: c.bad_entries.load(Ordering::Relaxed),
            vmm_pages: c.vmm_pages.load(Ordering::Relaxed),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Prepares `vcpu` (not yet started): maps its ring and makes its thread
    /// hand a full ring to this tracker. Nothing to do for the bitmap.
    pub fn attach_vcpu(self: &Arc<Self>, vcpu: &mut Vcpu) -> Result<(), DirtyError> {
        if self.kind != DirtyTrackerKind::Ring {
            return Ok(());
        }
        let index = vcpu.index();
        let ring = DirtyRing::map(
            std::os::fd::AsRawFd::as_raw_fd(vcpu.fd()),
            self.ring_entries,
        )?;
        {
            let mut state = self.lock();
            let i = usize::from(index);
            if state.rings.len() <= i {
                state.rings.resize_with(i + 1, || None);
            }
            if state.rings[i].is_some() {
                return Err(DirtyError::AlreadyAttached(index));
            }
            state.rings[i] = Some(ring);
        }
        // A strong reference: the ring must stay mapped and harvestable for
        // as long as the vCPU can exit with a full ring (a handler that could
        // no longer harvest would make the vCPU spin). No cycle: the tracker
        // holds no vCPU.
        let tracker = Arc::clone(self);
        vcpu.set_dirty_ring_full_handler(Arc::new(move |index| tracker.on_ring_full(index)));
        Ok(())
    }

    /// Turns tracking on: VMM writes are recorded, every slot logs dirty pages
    /// (KVM write-protects guest memory, O(memory) once). Stale entries from an
    /// earlier period are dropped first. No-op if already on.
    pub fn start(&self) -> Result<(), DirtyError> {
        let mut state = self.lock();
        if state.tracking.is_some() {
            return Ok(());
        }
        // Discard leftovers while nothing new can arrive (logging is off).
        self.drain_rings(&mut state, None)?;
        let _ = memory::harvest_vmm_dirty(&self.memory);
        let regions = self.vm.memory_slot_regions();
        let slots = SlotMap::new(
            regions
                .iter()
                .map(|r| (r.slot, r.guest_phys_addr, r.memory_size)),
        );
        let bitmap = (self.kind == DirtyTrackerKind::Bitmap).then(|| {
            BitmapLog::new(
                regions.iter().map(|r| (r.slot, r.memory_size / 4096)),
                self.manual_protect,
            )
        });
        memory::set_vmm_dirty_tracking(&self.memory, true);
        if let Err(e) = self.vm.set_dirty_logging(true) {
            memory::set_vmm_dirty_tracking(&self.memory, false);
            let _ = self.vm.set_dirty_logging(false);
            return Err(e.into());
        }
        let pages = slots.total_pages();
        state.tracking = Some(Tracking {
            slots,
            pending: PageSet::new(pages),
            bitmap,
            writable: PageSet::new(pages),
            fresh: PageSet::new(pages),
        });
        tracing::info!(kind = ?self.kind, pages, "dirty tracking started");
        Ok(())
    }

    /// Turns tracking off and forgets what was not harvested. No-op if off.
    pub fn stop(&self) -> Result<(), DirtyError> {
        let mut state = self.lock();
        if state.tracking.take().is_none() {
            return Ok(());
        }
        memory::set_vmm_dirty_tracking(&self.memory, false);
        let _ = memory::harvest_vmm_dirty(&self.memory);
        self.vm.set_dirty_logging(false)?;
        self.drain_rings(&mut state, None)?;
        tracing::info!(kind = ?self.kind, "dirty tracking stopped");
        Ok(())
    }

    /// Guest page frame numbers written since `start()` or the previous
    /// harvest, each once, by vCPUs and by the VMM. Empty if tracking is off.
    ///
    /// With the ring, entries a *running* vCPU has not yet pushed (hardware
    /// buffers like Intel's PML are flushed to the ring on VM exit) are not
    /// seen: use [`harvest_running`](Self::harvest_running) then, or pause
    /// the vCPUs first. The bitmap's KVM_GET_DIRTY_LOG flushes them itself.
    pub fn harvest(&self) -> Result<Vec<u64>, DirtyError> {
        let mut state = self.lock();
        if state.tracking.is_none() {
            return Ok(Vec::new());
        }
        match self.kind {
            DirtyTrackerKind::Ring => {
                self.drain_rings(&mut state, None)?;
            }
            DirtyTrackerKind::Bitmap => {
                let Some(t) = state.tracking.as_mut() else {
                    return Ok(Vec::new());
                };
                let Tracking {
                    slots,
                    pending,
                    bitmap,
                    ..
                } = t;
                if let Some(bitmap) = bitmap.as_mut() {
                    let mut bad = 0;
                    bitmap.harvest(&self.vm, |slot, page| {
                        match slots.dense_of_entry(slot, page) {
                            Some(d) => {
                                pending.insert(d);
                            }
                            None => bad += 1,
                        }
                    })?;
                    self.counters.bad_entries.fetch_add(bad, Ordering::Relaxed);
                }
            }
        }
        let Some(t) = state.tracking.as_mut() else {
            return Ok(Vec::new());
        };
        Ok(self.take_pending(t))
    }

    /// Like [`harvest`](Self::harvest), for frequent harvests of a guest that
    /// rewrites the same pages between them (fault tolerance: stack, socket
    /// buffers, ring entries). The pages the rings name stay *writable* —
    /// their entries are not reset — so the guest's next write to them costs
    /// no write-protection fault; such a write leaves no ring entry either,
    /// so every later harvest returns them as [`KeptHarvest::carried`]
    /// (written or not: the caller compares) until a reset re-protects
    /// them. The reset comes when more than `max_writable` pages would be
    /// kept so, or at any harvest that resets (a full ring,
    /// [`harvest`](Self::harvest)). With the bitmap this is
    /// [`harvest`](Self::harvest): nothing is carried.
    ///
    /// The vCPUs must be out of KVM_RUN (paused), as for a complete
    /// [`harvest`](Self::harvest) with the ring.
    pub fn harvest_paused_keep_writable(
        &self,
        max_writable: usize,
    ) -> Result<KeptHarvest, DirtyError> {
        if self.kind != DirtyTrackerKind::Ring {
            return Ok(KeptHarvest {
                dirty: self.harvest()?,
                ..KeptHarvest::default()
            });
        }
        let mut state = self.lock();
        if state.tracking.is_none() {
            return Ok(KeptHarvest::default());
        }
        self.read_rings(&mut state, None, RingTarget::Fresh);
        let reset = state
            .tracking
            .as_ref()
            .is_some_and(|t| t.writable.len() + t.fresh.len() > max_writable);
        if reset {
            // Writable until the reset succeeds (see drain_rings).
            if let Some(t) = state.tracking.as_mut() {
                for d in t.fresh.take() {
                    t.writable.insert(d);
                }
            }
            // Re-protects every page left writable; they are reported now.
            self.drain_rings(&mut state, None)?;
            let Some(t) = state.tracking.as_mut() else {
                return Ok(KeptHarvest::default());
            };
            return Ok(KeptHarvest {
                dirty: self.take_pending(t),
                ..KeptHarvest::default()
            });
        }
        let Some(t) = state.tracking.as_mut() else {
            return Ok(KeptHarvest::default());
        };
        self.add_vmm_pages(t);
        // Carried: writable before this harvest and not known to be dirty (a
        // writable page has a new ring entry where KVM emulated the write).
        let carried: Vec<u64> = t
            .writable
            .pages()
            .iter()
            .filter(|&&d| !t.pending.contains(d) && !t.fresh.contains(d))
            .filter_map(|&d| t.slots.pfn_of_dense(d))
            .collect();
        for d in t.fresh.take() {
            t.pending.insert(d);
            t.writable.insert(d);
        }
        let kept = t
            .writable
            .pages()
            .iter()
            .filter_map(|&d| t.slots.pfn_of_dense(d))
            .collect();
        Ok(KeptHarvest {
            dirty: self.take_pending(t),
            carried,
            kept,
        })
    }

    /// Moves the VMM's own writes into the pending set.
    fn add_vmm_pages(&self, t: &mut Tracking) {
        // VMM writes last: a page the VMM marked before this point is read by
        // the caller after its write (see vmm_pages.rs).
        let vmm = memory::harvest_vmm_dirty(&self.memory);
        self.counters
            .vmm_pages
            .fetch_add(vmm.len() as u64, Ordering::Relaxed);
        for pfn in vmm {
            if let Some(d) = t.slots.dense_of_pfn(pfn) {
                t.pending.insert(d);
            }
        }
    }

    /// Pages the tracker holds plus the VMM's own writes, as pfns, each once;
    /// empties the pending set.
    fn take_pending(&self, t: &mut Tracking) -> Vec<u64> {
        self.add_vmm_pages(t);
        let dense = t.pending.take();
        let pfns: Vec<u64> = dense
            .into_iter()
            .filter_map(|d| t.slots.pfn_of_dense(d))
            .collect();
        self.counters.harvests.fetch_add(1, Ordering::Relaxed);
        self.counters
            .pages
            .fetch_add(pfns.len() as u64, Ordering::Relaxed);
        tracing::trace!(pages = pfns.len(), "dirty harvest");
        pfns
    }

    /// A complete harvest while `vcpus` run: with the ring, each vCPU is first
    /// kicked out of KVM_RUN (and back) so that entries it buffered land in
    /// its ring. Costs one vCPU round trip each; paused vCPUs answer at once.
    pub fn harvest_running(&self, vcpus: &[VcpuHandle]) -> Result<Vec<u64>, DirtyError> {
        if self.kind == DirtyTrackerKind::Ring && self.is_active() {
            // Not under the state lock: a vCPU may be waiting for it in
            // `on_ring_full`.
            for v in vcpus {
                v.with_fd(|_| ())?;
            }
        }
        self.harvest()
    }

    /// On vCPU `index`'s thread after KVM_EXIT_DIRTY_RING_FULL: moves its
    /// entries into the pending set and resets the rings, so the vCPU can
    /// re-enter at once. Nothing is lost: the next harvest returns them.
    fn on_ring_full(&self, index: u8) {
        self.counters.ring_full.fetch_add(1, Ordering::Relaxed);
        let mut state = self.lock();
        if let Err(e) = self.drain_rings(&mut state, Some(usize::from(index))) {
            // The vCPU will exit again and we retry; say why.
            tracing::warn!(vcpu = index, error = %e, "dirty ring harvest failed");
        }
        tracing::debug!(vcpu = index, "dirty ring full: harvested");
    }

    /// Harvests the rings (all, or one) into the pending set (or discards the
    /// entries when tracking is off), then one KVM_RESET_DIRTY_RINGS. Pages
    /// left writable by an earlier keep-writable harvest are re-protected by
    /// that reset, so they move to the pending set: a write they took
    /// without a fault is reported by the next harvest.
    fn drain_rings(&self, state: &mut State, only: Option<usize>) -> Result<u32, DirtyError> {
        let total = self.read_rings(state, only, RingTarget::Pending);
        if total > 0 || state.reset_owed {
            self.vm.reset_dirty_rings()?;
            state.reset_owed = false;
            // Only once re-protected: a page KVM still lets the guest write
            // (the reset failed) must stay in the writable set, or a later
            // write to it would go unreported.
            if let Some(t) = state.tracking.as_mut() {
                for d in t.writable.take() {
                    t.pending.insert(d);
                }
            }
        }
        Ok(total)
    }

    /// Reads the rings' new entries (all rings, or one) into the pending or
    /// the fresh set (or discards them when tracking is off). No reset: the
    /// caller owes one.
    fn read_rings(&self, state: &mut State, only: Option<usize>, target: RingTarget) -> u32 {
        let State {
            rings,
            tracking,
            reset_owed,
        } = state;
        let mut total = 0;
        let mut bad = 0;
        for (i, ring) in rings.iter_mut().enumerate() {
            let Some(ring) = ring else { continue };
            if only.is_some_and(|o| o != i) {
                continue;
            }
            total += ring.harvest(|slot, offset| {
                if let Some(t) = tracking.as_mut() {
                    match t.slots.dense_of_entry(slot, offset) {
                        Some(d) if target == RingTarget::Fresh => {
                            t.fresh.insert(d);
                        }
                        Some(d) => {
                            t.pending.insert(d);
                        }
                        None => bad += 1,
                    }
                }
            });
        }
        *reset_owed |= total > 0;
        self.counters
            .ring_entries
            .fetch_add(u64::from(total), Ordering::Relaxed);
        if bad > 0 {
            self.counters.bad_entries.fetch_add(bad, Ordering::Relaxed);
            tracing::warn!(bad, "dirty ring entries outside every slot ignored");
        }
        total
    }

    /// Pages waiting in the pending set (harvested from full rings).
    pub fn pending(&self) -> usize {
        self.lock().tracking.as_ref().map_or(0, |t| t.pending.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_slots() -> SlotMap {
        // Like layout::ram_ranges for 5 GiB: [0, 3 GiB) and [4 GiB, 6 GiB),
        // given out of order.
        SlotMap::new([(1, 4 << 30, 2 << 30), (0, 0, 3 << 30)])
    }

    #[test]
    fn slot_offsets_translate_to_pfns() {
        let m = two_slots();
        assert_eq!(m.total_pages(), 5 << 18);
        let d = m.dense_of_entry(0, 5).unwrap();
        assert_eq!(m.pfn_of_dense(d), Some(5));
        let d = m.dense_of_entry(1, 7).unwrap();
        assert_eq!(d, (3 << 18) + 7);
        assert_eq!(m.pfn_of_dense(d), Some((4 << 18) + 7));
        assert_eq!(m.dense_of_pfn((4 << 18) + 7), Some(d));
        // Last page of each slot, and one past.
        assert!(m.dense_of_entry(0, (3 << 18) - 1).is_some());
        assert_eq!(m.dense_of_entry(0, 3 << 18), None);
        assert_eq!(m.dense_of_entry(1, 2 << 18), None);
        // The MMIO gap is in no slot.
        assert_eq!(m.dense_of_pfn(3 << 18), None);
        assert_eq!(m.pfn_of_dense(5 << 18), None);
    }

    #[test]
    fn foreign_address_space_and_unknown_slot_are_rejected() {
        let m = two_slots();
        assert_eq!(m.dense_of_entry(1 << 16, 0), None);
        assert_eq!(m.dense_of_entry(7, 0), None);
    }

    #[test]
    fn page_set_dedups_and_empties() {
        let mut s = PageSet::new(200);
        assert!(s.insert(5));
        assert!(s.insert(130));
        assert!(!s.insert(5));
        assert!(!s.insert(200), "out of range");
        assert_eq!(s.len(), 2);
        assert_eq!(s.take(), vec![5, 130]);
        assert!(s.take().is_empty());
        assert!(s.insert(5), "taken pages can come back");
    }

    #[test]
    fn ring_entries_dedup_into_pfns() {
        // A fake ring feeding the same path as the tracker: duplicates (the
        // page in flight at a full exit is reported twice) collapse.
        let m = two_slots();
        let mut ring = DirtyRing::fake(256);
        for (i, (slot, off)) in [(0u32, 9u64), (1, 0), (0, 9), (1, 0), (0, 10)]
            .into_iter()
            .enumerate()
        {
            ring.kernel_push(i as u32, slot, off);
        }
        let mut set = PageSet::new(m.total_pages());
        ring.harvest(|s, o| {
            set.insert(m.dense_of_entry(s, o).unwrap());
        });
        let pfns: Vec<u64> = set
            .take()
            .into_iter()
            .filter_map(|d| m.pfn_of_dense(d))
            .collect();
        assert_eq!(pfns, vec![9, 4 << 18, 10]);
    }

    #[test]
    fn config_defaults_to_auto_4096() {
        let c = DirtyTrackerConfig::default();
        assert_eq!(c.mode, DirtyTrackingMode::Auto);
        assert_eq!(c.ring_entries, 4096);
    }
}
