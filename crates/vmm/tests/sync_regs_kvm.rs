//! Registers from `kvm_run`'s sync area (KVM_CAP_SYNC_REGS) against real
//! KVM: after an exit they are the ones KVM_GET_REGS and KVM_GET_SREGS
//! return, a save on the vCPU's thread right after a pause takes them from
//! there, and nobody else does.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmm::devices::bus::{Bus, BusDevice};
use vmm::dirty::page_writer::PageWriter;
use vmm::memory::{GuestMemoryFile, GuestMemoryMmap, MemoryBacking};
use vmm::vstate::vcpu::{synced_registers, PauseLength, Vcpu};
use vmm::vstate::vm::Vm;
use vmm::vstate::VmEventSink;

const PORT: u16 = 0x510;

/// A 16 MiB VM whose one vCPU runs a [`PageWriter`] (an `out` to [`PORT`]
/// per round). The tests carry the probe's `no_kvm_sync_regs`.
struct Rig {
    _file: GuestMemoryFile,
    /// The mapping KVM's memory slot points into.
    _mem: GuestMemoryMmap,
    _vm: Vm,
    vcpu: Vcpu,
    writer: PageWriter,
}

fn rig() -> Rig {
    let file = GuestMemoryFile::create(16 << 20, &MemoryBacking::Memfd).unwrap();
    let mem = file.map().unwrap();
    let vm = Vm::new().unwrap();
    let mask = vm.fd().check_extension_int(kvm_ioctls::Cap::SyncRegs);
    assert_eq!(mask & 3, 3, "KVM_CAP_SYNC_REGS is {mask} here");
    vm.register_memory(&mem).unwrap();
    let mut vcpu = Vcpu::new(vm.fd(), 0).unwrap();
    let writer = PageWriter::new(16, 4, PORT).unwrap();
    writer.install(&mem, &mut vcpu).unwrap();
    Rig {
        _file: file,
        _mem: mem,
        _vm: vm,
        vcpu,
        writer,
    }
}

#[test]
#[cfg_attr(
    no_kvm_sync_regs,
    ignore = "needs a usable /dev/kvm with KVM_CAP_SYNC_REGS"
)]
fn the_sync_area_holds_what_the_ioctls_return() {
    // Every part bound (a `..` would drop the memory mapping at once).
    let Rig {
        _file,
        _mem,
        _vm,
        mut vcpu,
        writer,
    } = rig();
    for round in 0..3 {
        writer.run_round(&mut vcpu).unwrap();
        let fd = vcpu.fd();
        let synced = fd.sync_regs();
        assert_eq!(synced.regs, fd.get_regs().unwrap(), "round {round}");
        assert_eq!(synced.sregs, fd.get_sregs().unwrap(), "round {round}");
        // This thread ran KVM_RUN itself, not as a vCPU thread: a save here
        // must not trust the area.
        assert!(synced_registers(fd).is_none());
    }
}

/// Counts the writer's rounds; never holds the vCPU.
struct Rounds(Sender<()>);

impl BusDevice for Rounds {
    fn read(&mut self, _: u64, _: &mut [u8]) {}
    fn write(&mut self, _: u64, _: &[u8]) {
        let _ = self.0.send(());
    }
}

type Registers = (
    Option<kvm_bindings::kvm_sync_regs>,
    kvm_bindings::kvm_regs,
    kvm_bindings::kvm_sregs,
);

fn read_both(fd: &mut kvm_ioctls::VcpuFd) -> Registers {
    (
        synced_registers(fd),
        fd.get_regs().unwrap(),
        fd.get_sregs().unwrap(),
    )
}

#[test]
#[cfg_attr(
    no_kvm_sync_regs,
    ignore = "needs a usable /dev/kvm with KVM_CAP_SYNC_REGS"
)]
fn a_paused_vcpu_thread_saves_from_the_sync_area_once() {
    let Rig {
        _file,
        _mem,
        _vm,
        vcpu,
        writer: _writer,
    } = rig();
    let (tx, rounds): (Sender<()>, Receiver<()>) = channel();
    let mut io = Bus::new();
    io.insert(Arc::new(Mutex::new(Rounds(tx))), u64::from(PORT), 1)
        .unwrap();
    let handle = vcpu
        .start(
            Arc::new(io),
            Arc::new(Bus::new()),
            VmEventSink::new(|e| panic!("VM event {e:?}")),
            false,
        )
        .unwrap();
    for pause in 0..5 {
        // Let it run some rounds (new ones: rounds from before the last pause
        // may still be queued), then stop it and read its registers both
        // ways in its first job after the stop.
        while rounds.try_recv().is_ok() {}
        for _ in 0..3 {
            rounds.recv_timeout(Duration::from_secs(30)).unwrap();
        }
        let rx = handle
            .start_pause_with(PauseLength::Long, read_both)
            .unwrap();
        let (synced, regs, sregs) = handle.wait_job(&rx).unwrap();
        let synced = synced.unwrap_or_else(|| panic!("pause {pause}: no synced registers"));
        assert_eq!(synced.regs, regs, "pause {pause}");
        assert_eq!(synced.sregs, sregs, "pause {pause}");
        // A job may have changed them: the next job, with no exit in
        // between, reads them with the ioctls.
        let (again, regs_again, ..) = handle.with_fd(read_both).unwrap();
        assert!(
            again.is_none(),
            "pause {pause}: a stale sync area was trusted"
        );
        assert_eq!(regs_again, regs, "pause {pause}");
        handle.resume().unwrap();
    }
    drop(handle);
}
