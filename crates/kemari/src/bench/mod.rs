//! Side-by-side benchmarks behind `kemari-bench`: the pieces that drive VMM
//! processes (kemari and QEMU) and measure what a guest sees.
//!
//! - [`availability`]: whole-VM operations (reboot, snapshot/restore, warm
//!   restart, zero-copy migration) against QEMU's closest equivalents;
//! - [`ops`]: one measurement of one operation;
//! - [`console`]: guest console lines timestamped on the host, downtime;
//! - [`procs`]: child processes and scratch files, cleaned up on drop;
//! - [`qmp`]: a small QMP client for QEMU.

pub mod availability;
pub mod console;
pub mod ft;
pub mod ops;
pub mod procs;
pub mod qmp;
