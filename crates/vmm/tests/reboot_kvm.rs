//! `Machine::reboot` with real KVM: the same KVM VM (and vCPUs), memory
//! and device models. Guest memory reads zeroes again but for what the boot
//! loads (the kernel, at its address); the disk stays open (its file is
//! unlinked before the reboot, which needs no path); the devices keep their
//! windows and lines; a paused machine comes back paused.

mod common;

use std::path::PathBuf;

use vm_memory::{Bytes, GuestAddress};
use vmm::config::{DiskConfig, MachineConfig, SerialConfig};
use vmm::machine::{Machine, RunState};
use vmm::vstate::VmEventSink;

use common::{halting_kernel, ENTRY};

fn config(kernel: PathBuf, disk: PathBuf) -> MachineConfig {
    MachineConfig {
        vcpus: 2,
        memory_bytes: 32 << 20,
        memory_backing: Default::default(),
        kernel,
        initramfs: None,
        cmdline: String::new(),
        serial: SerialConfig::Null,
        disks: vec![DiskConfig {
            path: disk,
            read_only: false,
            cache_bytes: None,
        }],
        nets: Vec::new(),
        pmem: Vec::new(),
        id: None,
        name: None,
    }
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_reboot_zeroes_memory_in_place_reloads_the_kernel_and_keeps_the_disk_open() {
    let dir = std::env::temp_dir().join(format!("kemari-reboot-kvm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kernel = dir.join("halt.elf");
    halting_kernel(&kernel);
    let disk = dir.join("disk.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let machine = Machine::build(
        config(kernel, disk.clone()),
        VmEventSink::new(|_| {}),
        false,
    )
    .expect("building a machine around the halting kernel");
    let devices = machine.devices();
    let vm = machine.vm_id();
    // The process's fence (an etcd lease, a lock) outlives the boot.
    assert!(machine.fence_outputs(std::sync::Arc::new(Holding)));
    // What the guest left in memory, far from anything the boot loads.
    let marker = GuestAddress(24 << 20);
    machine
        .guest_memory()
        .write_obj(0x6b65_6d61_7269u64, marker)
        .unwrap();
    // Recording of the VMM's writes left on (a tracking the caller did not
    // stop): it must not go on into the next boot's kept mapping.
    vmm::memory::set_vmm_dirty_tracking(machine.guest_memory(), true);
    // Reopening the disk by its path would fail now.
    std::fs::remove_file(&disk).unwrap();
    let mut machine = machine
        .reboot(VmEventSink::new(|_| {}))
        .expect("the reboot");
    assert_eq!(machine.state(), RunState::Running);
    // The same KVM VM: its mappings of guest memory stay.
    assert_eq!(machine.vm_id(), vm, "the reboot made a new KVM VM");
    // Cleared in place: the page the guest had touched is still the file's,
    // so the next boot does not fault in a fresh one. Looked at before the
    // marker is read: reading a hole through the mapping fills it.
    let file = machine.memory_file().file();
    assert!(
        vmm::sys::data_extents(file, 32 << 20)
            .iter()
            .any(|&(start, end)| start <= marker.0 && marker.0 + 8 <= end),
        "the touched page was given back: {:?}",
        vmm::sys::data_extents(file, 32 << 20)
    );
    let mem = machine.guest_memory();
    assert_eq!(
        mem.read_obj::<u64>(marker).unwrap(),
        0,
        "memory not cleared"
    );
    mem.write_obj(1u64, marker).unwrap();
    assert!(
        vmm::memory::harvest_vmm_dirty(mem).is_empty(),
        "the VMM's writes are still recorded after the reboot"
    );
    let mut code = [0u8; 3];
    mem.read_slice(&mut code, GuestAddress(u64::from(ENTRY)))
        .unwrap();
    assert_eq!(code, [0xf4, 0xeb, 0xfd], "the kernel was not loaded again");
    assert!(
        !machine.fence_outputs(std::sync::Arc::new(Holding)),
        "the rebooted machine lost its fence"
    );
    let again = machine.devices();
    assert_eq!(again.len(), devices.len());
    for (before, after) in devices.iter().zip(&again) {
        assert_eq!(
            (
                &before.name,
                &before.kind,
                before.address,
                before.gsi,
                &before.backend
            ),
            (
                &after.name,
                &after.kind,
                after.address,
                after.gsi,
                &after.backend
            )
        );
    }
    // A paused machine reboots paused.
    machine.pause().unwrap();
    let machine = machine
        .reboot(VmEventSink::new(|_| {}))
        .expect("the second reboot");
    assert_eq!(machine.state(), RunState::Paused);
    assert_eq!(machine.vm_id(), vm);
    assert_eq!(machine.metrics().devices.len(), devices.len());
    drop(machine);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A fence that always holds.
#[derive(Debug)]
struct Holding;

impl vmm::output::OutputFence for Holding {
    fn holds(&self) -> bool {
        true
    }
}
