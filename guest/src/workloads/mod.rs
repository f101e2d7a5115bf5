//! The workloads selected on the command line. Each one is polled from the
//! main loop and must return quickly, so they can run together.

pub mod counter;
pub mod dirty;
pub mod disk;
pub mod pmem;
