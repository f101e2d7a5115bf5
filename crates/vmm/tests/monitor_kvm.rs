//! `MachineMonitor` answers on its own thread while another thread owns the
//! machine and pauses it (the API serving `GET /vm` while a worker migrates
//! the machine).

use std::path::{Path, PathBuf};
use std::time::Duration;

use vmm::config::{MachineConfig, SerialConfig};
use vmm::machine::{Machine, RunState};
use vmm::vstate::VmEventSink;

/// Where the kernel is loaded and entered (PVH, 32-bit protected mode).
const ENTRY: u32 = 0x10_0000;

/// A PVH ELF kernel whose code is `hlt; jmp .-1`: it sleeps in KVM_RUN,
/// and a kick takes it out.
fn halting_kernel(path: &Path) {
    let code: &[u8] = &[0xf4, 0xeb, 0xfd];
    // The note: namesz, descsz, type XEN_ELFNOTE_PHYS32_ENTRY, "Xen\0", the entry.
    let mut note = Vec::new();
    for v in [4u32, 4, 18] {
        note.extend_from_slice(&v.to_le_bytes());
    }
    note.extend_from_slice(b"Xen\0");
    note.extend_from_slice(&ENTRY.to_le_bytes());
    let (note_at, code_at) = (0x100u64, 0x200u64);

    let mut elf = Vec::new();
    elf.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0]);
    elf.extend_from_slice(&[0; 8]);
    elf.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    elf.extend_from_slice(&0x3eu16.to_le_bytes()); // x86-64
    elf.extend_from_slice(&1u32.to_le_bytes());
    elf.extend_from_slice(&u64::from(ENTRY).to_le_bytes());
    elf.extend_from_slice(&64u64.to_le_bytes()); // program headers
    elf.extend_from_slice(&0u64.to_le_bytes()); // no section headers
    elf.extend_from_slice(&0u32.to_le_bytes());
    for v in [64u16, 56, 2, 64, 0, 0] {
        elf.extend_from_slice(&v.to_le_bytes());
    }
    // type, flags, offset, vaddr, paddr, filesz, memsz, align
    let phdr = |elf: &mut Vec<u8>, kind: u32, flags: u32, at: u64, addr: u64, len: u64| {
        elf.extend_from_slice(&kind.to_le_bytes());
        elf.extend_from_slice(&flags.to_le_bytes());
        for v in [at, addr, addr, len, len, 4] {
            elf.extend_from_slice(&v.to_le_bytes());
        }
    };
    phdr(&mut elf, 1, 5, code_at, u64::from(ENTRY), code.len() as u64); // PT_LOAD, R+X
    phdr(&mut elf, 4, 4, note_at, 0, note.len() as u64); // PT_NOTE
    elf.resize(note_at as usize, 0);
    elf.extend_from_slice(&note);
    elf.resize(code_at as usize, 0);
    elf.extend_from_slice(code);
    std::fs::write(path, elf).unwrap();
}

fn config(kernel: PathBuf) -> MachineConfig {
    MachineConfig {
        vcpus: 2,
        memory_bytes: 32 << 20,
        memory_backing: Default::default(),
        kernel,
        initramfs: None,
        cmdline: String::new(),
        serial: SerialConfig::Null,
        disks: Vec::new(),
        nets: Vec::new(),
        id: None,
        name: None,
    }
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn the_monitor_sees_a_pause_made_on_the_thread_that_owns_the_machine() {
    let kernel = std::env::temp_dir().join(format!("kemari-monitor-{}.elf", std::process::id()));
    halting_kernel(&kernel);
    let mut machine = Machine::build(config(kernel.clone()), VmEventSink::new(|_| {}), false)
        .expect("building a machine around the halting kernel");
    std::fs::remove_file(&kernel).unwrap();
    let monitor = machine.monitor();
    assert_eq!(monitor.state(), RunState::Running);
    assert_eq!(monitor.config().vcpus, 2);
    assert_eq!(monitor.devices(), machine.devices());

    // The machine goes to a worker, which pauses it and keeps it until told.
    let (paused_tx, paused_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let worker = std::thread::spawn(move || {
        machine.pause().unwrap();
        paused_tx.send(()).unwrap();
        done_rx.recv().unwrap();
        machine
    });
    paused_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    // Answered here, while the worker holds the machine.
    assert_eq!(monitor.state(), RunState::Paused);
    let metrics = monitor.metrics();
    assert_eq!(metrics.pauses, 1);
    assert_eq!(metrics.memory_bytes, 32 << 20);
    assert_eq!(metrics.devices.len(), 1, "the serial console only");
    assert_eq!(monitor.devices()[0].name, "serial0");
    let clone = monitor.clone();
    assert_eq!(
        std::thread::spawn(move || clone.state()).join().unwrap(),
        RunState::Paused
    );
    done_tx.send(()).unwrap();

    let mut machine = worker.join().unwrap();
    assert_eq!(machine.state(), monitor.state());
    assert_eq!(machine.metrics().pauses, monitor.metrics().pauses);
    assert!(monitor.uptime() >= Duration::ZERO);
    machine.resume().unwrap();
    assert_eq!(monitor.state(), RunState::Running);

    // Without the machine: no devices, nothing kept alive.
    drop(machine);
    assert!(monitor.devices().is_empty());
    assert_eq!(monitor.metrics().pauses, 1);
    assert!(monitor.metrics().exits.is_empty());
}
