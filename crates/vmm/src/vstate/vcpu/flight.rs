//! A vCPU's last exits, kept for a crash report.
//!
//! When a guest triple-faults, KVM on AMD-V resets the vCPU before it
//! reports the shutdown (the VMCB is undefined after a shutdown intercept),
//! so the registers read at that exit are the reset vector's and say
//! nothing about the crash. What the vCPU did just before still can: each
//! exit's kind, address and the registers KVM stored in `kvm_run` on the
//! way out (KVM_CAP_SYNC_REGS, already asked for) go into a small ring, and
//! the crash report prints it — where the guest was, in which address
//! space, and how long before the crash.

use std::fmt;
use std::time::Instant;

/// How many exits are kept.
pub const KEPT: usize = 16;

/// What a vCPU exited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitKind {
    /// Port input (`addr` is the port).
    IoIn,
    /// Port output (`addr` is the port).
    IoOut,
    /// MMIO read (`addr` is the guest-physical address).
    MmioRead,
    /// MMIO write (`addr` is the guest-physical address).
    MmioWrite,
    /// HLT with no in-kernel LAPIC to wait in.
    Hlt,
    /// Interrupted by a kick or a signal.
    Interrupted,
    /// The dirty ring filled up.
    DirtyRingFull,
    /// Any other exit.
    Other,
}

impl ExitKind {
    fn name(self) -> &'static str {
        match self {
            ExitKind::IoIn => "in",
            ExitKind::IoOut => "out",
            ExitKind::MmioRead => "mmio-read",
            ExitKind::MmioWrite => "mmio-write",
            ExitKind::Hlt => "hlt",
            ExitKind::Interrupted => "interrupted",
            ExitKind::DirtyRingFull => "dirty-ring-full",
            ExitKind::Other => "other",
        }
    }

    fn has_addr(self) -> bool {
        matches!(
            self,
            ExitKind::IoIn | ExitKind::IoOut | ExitKind::MmioRead | ExitKind::MmioWrite
        )
    }
}

/// The registers of an exit that place the guest: where it ran, on which
/// stack, in which address space and mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExitRegs {
    /// Instruction pointer.
    pub rip: u64,
    /// Stack pointer.
    pub rsp: u64,
    /// Flags.
    pub rflags: u64,
    /// Page-table root.
    pub cr3: u64,
    /// Code segment selector (its low two bits: the privilege level).
    pub cs: u16,
}

/// One exit.
#[derive(Debug, Clone, Copy)]
pub struct ExitRecord {
    /// When KVM_RUN returned.
    pub at: Instant,
    /// Why.
    pub kind: ExitKind,
    /// The port or guest-physical address, for I/O.
    pub addr: u64,
    /// The registers at the exit, if KVM stored them.
    pub regs: Option<ExitRegs>,
}

/// The last [`KEPT`] exits of one vCPU (a ring: no allocation per exit).
#[derive(Debug)]
pub struct ExitLog {
    ring: [Option<ExitRecord>; KEPT],
    next: usize,
}

impl Default for ExitLog {
    fn default() -> Self {
        ExitLog {
            ring: [None; KEPT],
            next: 0,
        }
    }
}

impl ExitLog {
    /// Keeps `record`, forgetting the oldest one if the ring is full.
    pub fn push(&mut self, record: ExitRecord) {
        self.ring[self.next] = Some(record);
        self.next = (self.next + 1) % KEPT;
    }

    /// The kept exits, oldest first.
    pub fn records(&self) -> impl Iterator<Item = &ExitRecord> {
        let (newer, older) = self.ring.split_at(self.next);
        older.iter().chain(newer).flatten()
    }

    /// The kept exits, oldest first, each with how long before `now` it
    /// was, for a log line.
    pub fn report(&self, now: Instant) -> Report<'_> {
        Report { log: self, now }
    }
}

/// [`ExitLog::report`]'s display.
pub struct Report<'a> {
    log: &'a ExitLog,
    now: Instant,
}

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for r in self.log.records() {
            if !first {
                f.write_str("; ")?;
            }
            first = false;
            let before = self.now.saturating_duration_since(r.at);
            write!(f, "-{:.6}s {}", before.as_secs_f64(), r.kind.name())?;
            if r.kind.has_addr() {
                write!(f, " {:#x}", r.addr)?;
            }
            if let Some(g) = r.regs {
                write!(
                    f,
                    " rip={:#x} rsp={:#x} rflags={:#x} cr3={:#x} cpl={}",
                    g.rip,
                    g.rsp,
                    g.rflags,
                    g.cr3,
                    g.cs & 3
                )?;
            }
        }
        if first {
            f.write_str("none")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn record(at: Instant, rip: u64) -> ExitRecord {
        ExitRecord {
            at,
            kind: ExitKind::MmioRead,
            addr: 0xd000_0060,
            regs: Some(ExitRegs {
                rip,
                rsp: 0xffff_c900_0000_3e80,
                rflags: 0x246,
                cr3: 0x1234_5000,
                cs: 0x10,
            }),
        }
    }

    #[test]
    fn keeps_the_last_exits_oldest_first() {
        let t0 = Instant::now();
        let mut log = ExitLog::default();
        assert_eq!(log.records().count(), 0);
        assert_eq!(log.report(t0).to_string(), "none");
        for i in 0..(KEPT as u64 + 3) {
            log.push(record(t0 + Duration::from_millis(i), i));
        }
        let rips: Vec<u64> = log.records().map(|r| r.regs.unwrap().rip).collect();
        let want: Vec<u64> = (3..KEPT as u64 + 3).collect();
        assert_eq!(rips, want);
    }

    #[test]
    fn the_report_says_when_what_where_and_which_mode() {
        let t0 = Instant::now();
        let mut log = ExitLog::default();
        log.push(record(t0, 0xffff_ffff_8100_0000));
        log.push(ExitRecord {
            at: t0 + Duration::from_millis(500),
            kind: ExitKind::Interrupted,
            addr: 0,
            regs: None,
        });
        let text = log.report(t0 + Duration::from_secs(1)).to_string();
        assert_eq!(
            text,
            "-1.000000s mmio-read 0xd0000060 rip=0xffffffff81000000 rsp=0xffffc90000003e80 \
             rflags=0x246 cr3=0x12345000 cpl=0; -0.500000s interrupted"
        );
    }
}
