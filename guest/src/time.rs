//! Time from the TSC, read at CPL3 with RDTSC. Its rate comes from, in order:
//! kvmclock (registered by the bootstrap), CPUID 0x15, CPUID 0x40000010,
//! CPUID 0x16, or a calibration against the PIT (QEMU TCG has no kvmclock).

use core::ptr::{addr_of, read_volatile};
use core::sync::atomic::{fence, AtomicU64, Ordering};

use crate::cpu::{cpuid, inb, outb, rdtsc};

extern "C" {
    /// pvclock_vcpu_time_info, written by the hypervisor (boot.rs).
    static pvclock: [u8; 64];
    /// Set to 1 by the bootstrap when it registered `pvclock`.
    static kvmclock_enabled: u64;
}

/// TSC value at boot (time zero).
static TSC0: AtomicU64 = AtomicU64::new(0);
/// Nanoseconds per TSC tick, as a 32.32 fixed-point number.
static NS_PER_TICK_32: AtomicU64 = AtomicU64::new(1 << 32);
static TSC_KHZ: AtomicU64 = AtomicU64::new(1_000_000);

/// Where the TSC rate came from.
#[derive(Clone, Copy, Debug)]
pub enum Source {
    Kvmclock,
    Cpuid15,
    Cpuid40000010,
    Cpuid16,
    Pit,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Source::Kvmclock => "kvmclock",
            Source::Cpuid15 => "cpuid-0x15",
            Source::Cpuid40000010 => "cpuid-0x40000010",
            Source::Cpuid16 => "cpuid-0x16",
            Source::Pit => "pit",
        }
    }
}

/// Calibrates the clock; time zero is "now".
pub fn init() -> Source {
    TSC0.store(rdtsc(), Ordering::Relaxed);
    let (source, khz) = kvmclock_khz()
        .map(|k| (Source::Kvmclock, k))
        .or_else(|| cpuid15_khz().map(|k| (Source::Cpuid15, k)))
        .or_else(|| cpuid_hv_khz().map(|k| (Source::Cpuid40000010, k)))
        .or_else(|| cpuid16_khz().map(|k| (Source::Cpuid16, k)))
        .unwrap_or_else(|| (Source::Pit, pit_khz()));
    TSC_KHZ.store(khz, Ordering::Relaxed);
    NS_PER_TICK_32.store(
        ((1_000_000u128 << 32) / khz as u128) as u64,
        Ordering::Relaxed,
    );
    source
}

pub fn tsc_khz() -> u64 {
    TSC_KHZ.load(Ordering::Relaxed)
}

/// Nanoseconds since `init`.
pub fn now_ns() -> u64 {
    let ticks = rdtsc().wrapping_sub(TSC0.load(Ordering::Relaxed));
    ((ticks as u128 * NS_PER_TICK_32.load(Ordering::Relaxed) as u128) >> 32) as u64
}

pub fn now_ms() -> u64 {
    now_ns() / 1_000_000
}

pub fn now_us() -> u64 {
    now_ns() / 1_000
}

fn kvmclock_khz() -> Option<u64> {
    // SAFETY: both statics are defined in boot.rs's .bss; the hypervisor
    // updates `pvclock` (hence volatile reads, retried on odd versions).
    unsafe {
        if read_volatile(addr_of!(kvmclock_enabled)) != 1 {
            return None;
        }
        let p = addr_of!(pvclock) as *const u8;
        for _ in 0..1000 {
            let v1 = read_volatile(p as *const u32);
            fence(Ordering::Acquire);
            let mul = read_volatile(p.add(24) as *const u32);
            let shift = read_volatile(p.add(28) as *const i8);
            fence(Ordering::Acquire);
            let v2 = read_volatile(p as *const u32);
            if v1 != v2 || v1 & 1 == 1 {
                continue;
            }
            if mul == 0 {
                return None;
            }
            // ns = ((ticks << shift) * mul) >> 32, so
            // kHz = 1e6 * 2^32 / (mul << shift).
            let scaled = if shift >= 0 {
                (mul as u128) << shift
            } else {
                (mul as u128) >> (-shift)
            };
            return u64::try_from((1_000_000u128 << 32) / scaled.max(1)).ok();
        }
        None
    }
}

fn cpuid15_khz() -> Option<u64> {
    if cpuid(0).eax < 0x15 {
        return None;
    }
    let r = cpuid(0x15);
    if r.eax == 0 || r.ebx == 0 || r.ecx == 0 {
        return None;
    }
    Some(r.ecx as u64 * r.ebx as u64 / r.eax as u64 / 1000)
}

fn cpuid_hv_khz() -> Option<u64> {
    if cpuid(1).ecx & (1 << 31) == 0 || cpuid(0x4000_0000).eax < 0x4000_0010 {
        return None;
    }
    Some(cpuid(0x4000_0010).eax as u64).filter(|&k| k > 0)
}

fn cpuid16_khz() -> Option<u64> {
    if cpuid(0).eax < 0x16 {
        return None;
    }
    Some(cpuid(0x16).eax as u64 * 1000).filter(|&k| k > 0)
}

/// Counts TSC ticks while PIT channel 0 counts down 50 ms. Channel 0's gate
/// is always open (channel 2's needs port 0x61, which QEMU's microvm lacks);
/// interrupts are off, so its IRQ 0 goes nowhere.
fn pit_khz() -> u64 {
    const PIT_HZ: u64 = 1_193_182;
    const SPAN: u64 = 59_659; // 50 ms
    let read_count = || {
        outb(0x43, 0x00); // latch channel 0
        let lo = inb(0x40) as u64;
        let hi = inb(0x40) as u64;
        hi << 8 | lo
    };
    outb(0x43, 0x30); // channel 0, lobyte/hibyte, mode 0, binary
    outb(0x40, 0xff);
    outb(0x40, 0xff);
    // Sum the count's decrements (modulo 2^16, as mode 0 wraps) until 50 ms
    // of PIT time passed. Give up after ~2^34 TSC ticks (seconds on any
    // CPU) rather than hang when there is no PIT (the count never moves).
    let mut prev = read_count();
    let start = rdtsc();
    let mut elapsed = 0u64;
    let mut ticks = 0;
    while elapsed < SPAN && ticks < 1 << 34 {
        let now = read_count();
        elapsed += prev.wrapping_sub(now) & 0xffff;
        prev = now;
        ticks = rdtsc() - start;
    }
    if elapsed < SPAN {
        crate::say!("time: no PIT answered; assuming a 1 GHz TSC");
        return 1_000_000;
    }
    ticks * PIT_HZ / elapsed / 1000
}
