//! Leaving the guest: the exit port 0xf4 (kemari's, and QEMU's
//! isa-debug-exit), with fallbacks so the guest never spins or halts forever.

use core::arch::asm;

use crate::cpu::{outb, outl};

const EXIT_PORT: u16 = 0xf4;

/// Exit codes written to port 0xf4 (documented in docs/test-guest.md).
#[derive(Clone, Copy, Debug)]
#[repr(u32)]
pub enum ExitCode {
    Poweroff = 0,
    Fault = 1,
    CmdlineError = 2,
    VerifyFailed = 3,
    Panic = 4,
    DeviceError = 5,
}

/// Prints `poweroff` and exits cleanly.
pub fn poweroff() -> ! {
    crate::say!("poweroff");
    exit(ExitCode::Poweroff)
}

/// Prints `reboot` and asks for a reset: the i8042's pulse of the reset
/// line (command 0xfe on port 0x64), Linux's `reboot=k`. The VMM reboots
/// the guest or ends it; if nothing happens within ~4 s, the guest exits
/// with [`ExitCode::DeviceError`].
pub fn reboot() -> ! {
    crate::say!("reboot");
    outb(0x64, 0xfe);
    let start = crate::cpu::rdtsc();
    while crate::cpu::rdtsc() - start < 1 << 33 {
        core::hint::spin_loop();
    }
    crate::say!("reboot: the i8042 reset did nothing");
    exit(ExitCode::DeviceError)
}

pub fn exit(code: ExitCode) -> ! {
    outl(EXIT_PORT, code as u32);
    // The VMM may take a moment to stop the vCPU: wait ~0.5 s (by the TSC,
    // whatever its calibration) before the fallbacks.
    let start = crate::cpu::rdtsc();
    while crate::cpu::rdtsc() - start < 1 << 30 {
        core::hint::spin_loop();
    }
    // No exit device: try the i8042 reset line, then force a triple fault
    // (`hlt` at CPL3 raises #GP, whose stub triple-faults on it; idt.rs).
    outb(0x64, 0xfe);
    loop {
        // SAFETY: `hlt` at CPL3 only raises #GP; the stub never returns.
        unsafe { asm!("hlt", options(nomem, nostack)) }
    }
}
