//! Identity page tables, assembled at build time so the CPL0 bootstrap only
//! loads CR3 (no loop over memory at CPL0, where PVM emulates every
//! instruction).
//!
//! Every entry has the U bit (everything runs at CPL3) and the accessed and
//! dirty bits preset, so the CPU never writes to the tables. The first 4 GiB
//! (including the 3–4 GiB MMIO hole where virtio-mmio devices live) use
//! 2 MiB pages. Above 4 GiB the bootstrap picks one of two top-level tables:
//! - `pml4_1g`: 1 GiB pages up to 512 GiB, when CPUID 0x80000001 EDX bit 26
//!   says the CPU has them;
//! - `pml4_2m`: otherwise 2 MiB pages up to 16 GiB (16 page directories).

use core::arch::global_asm;

/// Memory mapped when the CPU has no 1 GiB pages.
pub const MAPPED_WITHOUT_1G_PAGES: u64 = 16 << 30;
/// Memory mapped with 1 GiB pages.
pub const MAPPED_WITH_1G_PAGES: u64 = 512 << 30;

global_asm!(
    r#"
    .pushsection .data.pagetables, "aw"
    .balign 4096
    /* Table flags: P, RW, U, A. Leaf flags: P, RW, U, A, D, PS. */
    .global pml4_1g
pml4_1g:
    .quad pdpt_1g + 0x27
    .fill 511, 8, 0
    .global pml4_2m
pml4_2m:
    .quad pdpt_2m + 0x27
    .fill 511, 8, 0
pdpt_1g:
    .quad pd_0 + 0x27
    .quad pd_0 + 0x1000 + 0x27
    .quad pd_0 + 0x2000 + 0x27
    .quad pd_0 + 0x3000 + 0x27
    .set gib, 4
    .rept 508
    .quad (gib << 30) | 0xe7
    .set gib, gib + 1
    .endr
pdpt_2m:
    .set n, 0
    .rept 16
    .quad pd_0 + (n << 12) + 0x27
    .set n, n + 1
    .endr
    .fill 496, 8, 0
pd_0:
    .set mib2, 0
    .rept 512 * 16
    .quad (mib2 << 21) | 0xe7
    .set mib2, mib2 + 1
    .endr
    .popsection
    "#,
    options(att_syntax)
);

/// Bytes of guest-physical memory the page tables map.
pub fn mapped_limit() -> u64 {
    // CPUID is unprivileged; this is the same test the bootstrap made.
    if crate::cpu::cpuid(0x8000_0000).eax >= 0x8000_0001
        && crate::cpu::cpuid(0x8000_0001).edx & (1 << 26) != 0
    {
        MAPPED_WITH_1G_PAGES
    } else {
        MAPPED_WITHOUT_1G_PAGES
    }
}
