//! Side-by-side benchmarks behind `kemari-bench`: the pieces that drive VMM
//! processes (kemari and QEMU) and measure what a guest sees.
//!
//! - [`availability`]: whole-VM operations (reboot, snapshot/restore, warm
//!   restart, zero-copy migration) against QEMU's closest equivalents;
//! - [`ops`]: one measurement of one operation;
//! - [`floor`]: what this host charges every fault-tolerance sync;
//! - [`memory_image`]: a memory image restored with and without its checks;
//! - [`console`]: guest console lines timestamped on the host, downtime;
//! - [`procs`]: child processes and scratch files, cleaned up on drop;
//! - [`qmp`]: a small QMP client for QEMU;
//! - [`report`]: the `--json` results every bench can write;
//! - [`state_codec`]: encode and decode of a saved VM state.

/// QEMU's `-cpu` for the side-by-side runs: the host CPU without
/// ARCH_CAPABILITIES. This host's KVM (PVM, kernel 6.18) lists that MSR in
/// CPUID but refuses QEMU's write of it, and QEMU 7.2 aborts at start
/// ("failed to set MSR 0x10a"); kemari and the test guest never use it.
pub const QEMU_CPU: &str = "host,-arch-capabilities";

pub mod api;
pub mod availability;
pub mod console;
pub mod cpu;
pub mod floor;
pub mod ft;
pub mod memory_image;
pub mod ops;
pub mod procs;
pub mod qmp;
pub mod report;
pub mod state_codec;
