//! Unprivileged CPU instructions the guest uses at CPL3: CPUID, RDTSC and
//! port I/O (allowed by IOPL=3; each access is a VM exit).

use core::arch::asm;

#[derive(Clone, Copy, Debug)]
pub struct CpuidResult {
    pub eax: u32,
    pub ebx: u32,
    pub ecx: u32,
    pub edx: u32,
}

pub fn cpuid(leaf: u32) -> CpuidResult {
    cpuid_sub(leaf, 0)
}

pub fn cpuid_sub(leaf: u32, subleaf: u32) -> CpuidResult {
    let r = core::arch::x86_64::__cpuid_count(leaf, subleaf);
    CpuidResult {
        eax: r.eax,
        ebx: r.ebx,
        ecx: r.ecx,
        edx: r.edx,
    }
}

pub fn rdtsc() -> u64 {
    // SAFETY: RDTSC only reads the time-stamp counter (CR4.TSD is clear, so
    // it is allowed at CPL3).
    unsafe { core::arch::x86_64::_rdtsc() }
}

pub fn outb(port: u16, value: u8) {
    // SAFETY: port I/O touches no guest memory; IOPL=3 permits it at CPL3.
    unsafe { asm!("out dx, al", in("dx") port, in("al") value, options(nomem, nostack)) }
}

pub fn outl(port: u16, value: u32) {
    // SAFETY: as in `outb`.
    unsafe { asm!("out dx, eax", in("dx") port, in("eax") value, options(nomem, nostack)) }
}

/// Writes `bytes` to `port` with one `rep outsb`: one string I/O exit for
/// the lot where the VMM supports it.
pub fn outsb(port: u16, bytes: &[u8]) {
    // SAFETY: reads `bytes.len()` bytes at `bytes.as_ptr()`, which the
    // slice owns; touches no other memory. Direction flag is clear (the
    // bootstrap's `cld`; Rust code keeps it clear).
    unsafe {
        asm!(
            "rep outsb",
            in("dx") port,
            inout("rsi") bytes.as_ptr() => _,
            inout("rcx") bytes.len() => _,
            options(nostack, readonly)
        )
    }
}

pub fn inb(port: u16) -> u8 {
    let value: u8;
    // SAFETY: as in `outb`.
    unsafe { asm!("in al, dx", out("al") value, in("dx") port, options(nomem, nostack)) }
    value
}
