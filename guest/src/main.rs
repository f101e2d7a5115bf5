//! kemari's test guest: a PVH ELF whose tiny CPL0 bootstrap (`boot.rs`)
//! drops to CPL3, where everything else runs and polls: serial console,
//! virtio-mmio block, net and pmem drivers, a smoltcp TCP/IP stack with echo
//! and HTTP services, and the `counter`, `dirty`, `disk` and `pmem` workloads.
//! See docs/test-guest.md.
//!
//! Only `x86_64-unknown-none` builds the guest; on any other target the
//! binary is a stub, so `cargo build --workspace` and friends still work.
#![cfg_attr(target_os = "none", no_std)]
#![cfg_attr(target_os = "none", no_main)]

#[cfg(not(target_os = "none"))]
fn main() {
    eprintln!(
        "the test guest runs only as a VM: \
         cargo build -p guest --target x86_64-unknown-none --release"
    );
    std::process::exit(2);
}

#[cfg(target_os = "none")]
extern crate alloc;

#[cfg(target_os = "none")]
mod boot;
#[cfg(target_os = "none")]
mod cpu;
#[cfg(target_os = "none")]
mod entry;
#[cfg(target_os = "none")]
mod exit;
#[cfg(target_os = "none")]
mod idt;
#[cfg(target_os = "none")]
mod mem;
#[cfg(target_os = "none")]
mod net;
#[cfg(target_os = "none")]
mod paging;
#[cfg(target_os = "none")]
mod serial;
#[cfg(target_os = "none")]
mod start_info;
#[cfg(target_os = "none")]
mod time;
#[cfg(target_os = "none")]
mod virtio;
#[cfg(target_os = "none")]
mod workloads;
