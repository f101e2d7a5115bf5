//! The dirty tracker against real KVM, with a real-mode guest program that
//! dirties a known set of pages per round ([`PageWriter`]): both kinds
//! report exactly those pages, VMM writes are merged in, and a tiny ring that
//! fills up many times per round loses nothing and never hangs the vCPU.

use std::collections::BTreeSet;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vm_memory::{Bytes, GuestAddress};
use vmm::devices::bus::{Bus, BusDevice};
use vmm::dirty::page_writer::PageWriter;
use vmm::dirty::{DirtyTracker, DirtyTrackerConfig, DirtyTrackerKind, DirtyTrackingMode};
use vmm::memory::{GuestMemoryFile, GuestMemoryMmap, MemoryBacking};
use vmm::vstate::vcpu::Vcpu;
use vmm::vstate::vm::Vm;
use vmm::vstate::VmEventSink;

const PORT: u16 = 0x510;

struct Rig {
    _file: GuestMemoryFile,
    mem: GuestMemoryMmap,
    vm: Vm,
    tracker: Arc<DirtyTracker>,
    vcpu: Vcpu,
}

/// A VM of `mib` MiB with one vCPU running `writer`, tracked by `config`
/// (the tests that ask for the ring carry the probe's `no_kvm_dirty_ring`).
fn rig(mib: u64, config: DirtyTrackerConfig, writer: &PageWriter) -> Rig {
    let file = GuestMemoryFile::create(mib << 20, &MemoryBacking::Memfd).unwrap();
    let mem = file.map().unwrap();
    let vm = Vm::new().unwrap();
    let tracker = DirtyTracker::new(&vm, &mem, config).unwrap_or_else(|e| panic!("tracker: {e}"));
    vm.register_memory(&mem).unwrap();
    let mut vcpu = Vcpu::new(vm.fd(), 0).unwrap();
    tracker.attach_vcpu(&mut vcpu).unwrap();
    writer.install(&mem, &mut vcpu).unwrap();
    Rig {
        _file: file,
        mem,
        vm,
        tracker,
        vcpu,
    }
}

/// Runs the vCPU on this thread until the writer's next `out`.
fn run_round(vcpu: &mut Vcpu) {
    PageWriter::new(16, 1, PORT)
        .unwrap()
        .run_round(vcpu)
        .unwrap();
}

fn exactly(mode: DirtyTrackingMode, kind: DirtyTrackerKind) {
    let writer = PageWriter::new(16, 16, PORT).unwrap();
    let config = DirtyTrackerConfig {
        mode,
        ..Default::default()
    };
    let mut r = rig(256, config, &writer);
    assert_eq!(r.tracker.kind(), kind);
    // Not started: nothing.
    run_round(&mut r.vcpu);
    assert!(r.tracker.harvest().unwrap().is_empty());
    r.tracker.start().unwrap();
    let want: BTreeSet<u64> = writer.pfns().collect();
    for round in 0..10 {
        run_round(&mut r.vcpu);
        let got = r.tracker.harvest().unwrap();
        assert_eq!(got.len(), want.len(), "round {round}: duplicates? {got:?}");
        assert_eq!(
            got.into_iter().collect::<BTreeSet<_>>(),
            want,
            "round {round}"
        );
        // No vCPU ran since: nothing more.
        assert!(r.tracker.harvest().unwrap().is_empty(), "round {round}");
    }
    // A VMM write (device emulation) lands in the same harvest, once, even
    // when the guest wrote the same page.
    r.mem.write_obj(7u64, GuestAddress(16 << 12)).unwrap();
    r.mem.write_obj(7u64, GuestAddress(1000 << 12)).unwrap();
    run_round(&mut r.vcpu);
    let got: BTreeSet<u64> = r.tracker.harvest().unwrap().into_iter().collect();
    let mut want_vmm = want.clone();
    want_vmm.insert(1000);
    assert_eq!(got, want_vmm);
    assert_eq!(r.tracker.stats().vmm_pages, 2);
    // Stopped: nothing, and the writer runs on untracked.
    r.tracker.stop().unwrap();
    run_round(&mut r.vcpu);
    assert!(r.tracker.harvest().unwrap().is_empty());
    // Restarted: only what is written after the restart.
    r.tracker.start().unwrap();
    assert!(r.tracker.harvest().unwrap().is_empty());
    run_round(&mut r.vcpu);
    assert_eq!(r.tracker.harvest().unwrap().len(), 16);
    let _ = &r.vm;
}

#[test]
#[cfg_attr(
    no_kvm_dirty_ring,
    ignore = "needs a usable /dev/kvm with the dirty ring"
)]
fn ring_reports_exactly_the_pages_written() {
    exactly(DirtyTrackingMode::Ring, DirtyTrackerKind::Ring);
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn bitmap_reports_exactly_the_pages_written() {
    exactly(DirtyTrackingMode::Bitmap, DirtyTrackerKind::Bitmap);
}

#[test]
#[cfg_attr(
    no_kvm_dirty_ring,
    ignore = "needs a usable /dev/kvm with the dirty ring"
)]
fn ring_keep_writable_carries_rewritten_pages_without_new_entries() {
    let writer = PageWriter::new(16, 16, PORT).unwrap();
    let config = DirtyTrackerConfig {
        mode: DirtyTrackingMode::Ring,
        ..Default::default()
    };
    let mut r = rig(256, config, &writer);
    let set = |v: &[u64]| v.iter().copied().collect::<BTreeSet<u64>>();
    let want: BTreeSet<u64> = writer.pfns().collect();
    r.tracker.start().unwrap();

    // First round: the pages are reported dirty and left writable.
    run_round(&mut r.vcpu);
    let h = r.tracker.harvest_paused_keep_writable(64).unwrap();
    assert_eq!(set(&h.dirty), want);
    assert!(h.carried.is_empty());
    assert_eq!(set(&h.kept), want);

    // Rewritten: natively a writable page takes no write-protection fault,
    // so it leaves no ring entry and comes back as carried (the caller
    // compares). Where KVM emulates the guest's instructions (PVM runs this
    // real-mode writer that way) each write is recorded anyway and the page
    // is dirty instead. Either way every page is in exactly one list.
    for _ in 0..3 {
        run_round(&mut r.vcpu);
        let h = r.tracker.harvest_paused_keep_writable(64).unwrap();
        assert!(set(&h.dirty).is_disjoint(&set(&h.carried)));
        assert_eq!(&set(&h.dirty) | &set(&h.carried), want);
        assert_eq!(set(&h.kept), want);
    }

    // A VMM write to a kept page makes it dirty, not carried; a VMM write
    // elsewhere is dirty and not kept (the VMM's writes are always queued).
    r.mem.write_obj(7u64, GuestAddress(16 << 12)).unwrap();
    r.mem.write_obj(7u64, GuestAddress(1000 << 12)).unwrap();
    let h = r.tracker.harvest_paused_keep_writable(64).unwrap();
    assert_eq!(set(&h.dirty), BTreeSet::from([16, 1000]));
    assert_eq!(h.carried.len(), 15);
    assert!(!h.carried.contains(&16));
    assert_eq!(set(&h.kept), want);

    // A reset (limit 0) reports every writable page and re-protects it: the
    // next round faults again and is reported dirty.
    run_round(&mut r.vcpu);
    let h = r.tracker.harvest_paused_keep_writable(0).unwrap();
    assert_eq!(set(&h.dirty), want);
    assert!(h.carried.is_empty() && h.kept.is_empty());
    run_round(&mut r.vcpu);
    let h = r.tracker.harvest_paused_keep_writable(8).unwrap();
    assert_eq!(set(&h.dirty), want, "re-protected pages fault again");
    assert!(
        h.kept.is_empty(),
        "16 new pages exceed a limit of 8: reset at once"
    );

    // A plain harvest after a keep-writable one also reports (and
    // re-protects) the kept pages.
    run_round(&mut r.vcpu);
    let h = r.tracker.harvest_paused_keep_writable(64).unwrap();
    assert_eq!(set(&h.kept), want);
    run_round(&mut r.vcpu);
    assert_eq!(set(&r.tracker.harvest().unwrap()), want);
    run_round(&mut r.vcpu);
    assert_eq!(set(&r.tracker.harvest().unwrap()), want);
    r.tracker.stop().unwrap();
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn auto_prefers_the_ring() {
    let writer = PageWriter::new(16, 16, PORT).unwrap();
    let r = rig(64, DirtyTrackerConfig::default(), &writer);
    let ring = r.vm.dirty_ring_support().is_some();
    assert_eq!(
        r.tracker.kind(),
        if ring {
            DirtyTrackerKind::Ring
        } else {
            DirtyTrackerKind::Bitmap
        }
    );
}

#[test]
#[cfg_attr(
    no_kvm_dirty_ring,
    ignore = "needs a usable /dev/kvm with the dirty ring"
)]
fn ring_size_is_validated() {
    let file = GuestMemoryFile::create(64 << 20, &MemoryBacking::Memfd).unwrap();
    let mem = file.map().unwrap();
    let vm = Vm::new().unwrap();
    assert!(
        vm.dirty_ring_support().is_some(),
        "the probe saw a dirty ring"
    );
    for entries in [64, 1000, 1 << 30] {
        let e = DirtyTracker::new(
            &vm,
            &mem,
            DirtyTrackerConfig {
                mode: DirtyTrackingMode::Ring,
                ring_entries: entries,
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("dirty ring of"), "{e}");
    }
}

/// The port device of the ring-full test: tells the test a round is done,
/// then holds the vCPU (outside KVM_RUN) until the test lets it go.
struct Gate {
    done: Sender<()>,
    go: Receiver<()>,
}

impl BusDevice for Gate {
    fn read(&mut self, _: u64, _: &mut [u8]) {}
    fn write(&mut self, _: u64, _: &[u8]) {
        let _ = self.done.send(());
        // Returns at once when the test has gone (sender dropped).
        let _ = self.go.recv();
    }
}

#[test]
#[cfg_attr(
    no_kvm_dirty_ring,
    ignore = "needs a usable /dev/kvm with the dirty ring"
)]
fn tiny_ring_fills_many_times_per_round_and_loses_nothing() {
    // 240 pages per round through a 256-entry ring (KVM asks for a harvest
    // after 192 entries), run by the real vCPU thread.
    let writer = PageWriter::new(16, 240, PORT).unwrap();
    let config = DirtyTrackerConfig {
        mode: DirtyTrackingMode::Ring,
        ring_entries: 256,
    };
    let r = rig(64, config, &writer);
    let (done_tx, done_rx) = channel();
    let (go_tx, go_rx) = channel();
    let mut io = Bus::new();
    io.insert(
        Arc::new(Mutex::new(Gate {
            done: done_tx,
            go: go_rx,
        })),
        u64::from(PORT),
        1,
    )
    .unwrap();
    let Rig {
        _file,
        mem: _mem,
        vm: _vm,
        tracker,
        vcpu,
    } = r;
    let handle = vcpu
        .start(
            Arc::new(io),
            Arc::new(Bus::new()),
            VmEventSink::new(|e| panic!("VM event {e:?}")),
            false,
        )
        .unwrap();
    // Dropped before `handle`, even when an assertion unwinds: the gate then
    // lets the vCPU go and it can exit.
    let go_tx = go_tx;
    let wait = |what: &str| {
        done_rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("vCPU hung ({what})"))
    };
    // Round 0 untracked; track from round 1.
    wait("round 0");
    tracker.start().unwrap();
    let want: BTreeSet<u64> = writer.pfns().collect();
    for round in 1..=5 {
        go_tx.send(()).unwrap();
        wait("round");
        // The vCPU waits in the gate, out of KVM_RUN: no kick needed.
        let got = tracker.harvest().unwrap();
        let set: BTreeSet<u64> = got.iter().copied().collect();
        assert_eq!(set.len(), got.len(), "round {round}: duplicates");
        assert_eq!(set, want, "round {round}: pages lost or extra");
    }
    let stats = tracker.stats();
    // KVM raises the soft-full request at 192 entries and exits at its next
    // entry check, which may come after a few more writes (64 entries are
    // reserved for that): at least one full exit, and every entry accounted.
    assert!(stats.ring_full >= 1, "the ring never filled: {stats:?}");
    assert!(stats.ring_entries >= 5 * 240, "{stats:?}");
    assert_eq!(
        handle
            .counters()
            .dirty_ring_full
            .load(std::sync::atomic::Ordering::Relaxed),
        stats.ring_full
    );
    drop(go_tx);
    drop(handle);
}

#[test]
#[cfg_attr(
    no_kvm_dirty_ring,
    ignore = "needs a usable /dev/kvm with the dirty ring"
)]
fn rings_of_several_vcpus_are_merged_and_deduplicated() {
    let file = GuestMemoryFile::create(64 << 20, &MemoryBacking::Memfd).unwrap();
    let mem = file.map().unwrap();
    let vm = Vm::new().unwrap();
    let config = DirtyTrackerConfig {
        mode: DirtyTrackingMode::Ring,
        ..Default::default()
    };
    let tracker = DirtyTracker::new(&vm, &mem, config).unwrap_or_else(|e| panic!("tracker: {e}"));
    vm.register_memory(&mem).unwrap();
    // vCPU 0 writes pages 16..48, vCPU 1 pages 32..64: 32..48 from both.
    let w0 = PageWriter::new(16, 32, PORT).unwrap();
    let w1 = PageWriter::new(32, 32, PORT).unwrap();
    let mut v0 = Vcpu::new(vm.fd(), 0).unwrap();
    let mut v1 = Vcpu::new(vm.fd(), 1).unwrap();
    tracker.attach_vcpu(&mut v0).unwrap();
    tracker.attach_vcpu(&mut v1).unwrap();
    assert!(tracker.attach_vcpu(&mut v1).is_err(), "attached twice");
    w0.install_at(&mem, &mut v0, 0x1000).unwrap();
    w1.install_at(&mem, &mut v1, 0x2000).unwrap();
    tracker.start().unwrap();
    let want: BTreeSet<u64> = (16..64).collect();
    for round in 0..5 {
        w0.run_round(&mut v0).unwrap();
        w1.run_round(&mut v1).unwrap();
        let before = tracker.stats().ring_entries;
        let got = tracker.harvest().unwrap();
        assert_eq!(got.len(), 48, "round {round}: {got:?}");
        assert_eq!(got.into_iter().collect::<BTreeSet<_>>(), want);
        assert_eq!(tracker.stats().ring_entries - before, 64, "both rings read");
    }
}
