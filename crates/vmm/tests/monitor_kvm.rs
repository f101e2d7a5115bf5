//! `MachineMonitor` answers on its own thread while another thread owns the
//! machine and pauses it (the API serving `GET /vm` while a worker migrates
//! the machine).

mod common;

use std::path::PathBuf;
use std::time::Duration;

use vmm::config::{MachineConfig, SerialConfig};
use vmm::machine::{Machine, RunState};
use vmm::vstate::VmEventSink;

use common::halting_kernel;

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
        pmem: Vec::new(),
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
