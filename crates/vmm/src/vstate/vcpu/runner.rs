//! The vCPU thread: KVM_RUN in a loop, each exit dispatched to the port or
//! MMIO bus (or reported as a [`VmEvent`]), queued requests served between
//! two runs, and the I/O of the last exit completed before a pause.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_ioctls::{SyncReg, VcpuExit, VcpuFd};

use super::control::{spin_recv, RunnerWiring, VcpuRequest, SPIN_WAIT};
use super::flight::{ExitKind, ExitLog, ExitRecord, ExitRegs};
use super::kick::KICK_EXIT_FLAG;
use super::{DirtyRingFullHandler, PauseLength, Vcpu, VcpuExitCounters};
use crate::devices::bus::Bus;
use crate::vstate::{VmEvent, VmEventSink};

/// KVM_EXIT_DIRTY_RING_FULL (not decoded by kvm-ioctls 0.25).
const KVM_EXIT_DIRTY_RING_FULL: u32 = kvm_bindings::KVM_EXIT_DIRTY_RING_FULL;

impl Vcpu {
    pub(super) fn runner(
        self,
        wiring: RunnerWiring,
        io_bus: Arc<Bus>,
        mmio_bus: Arc<Bus>,
        events: VmEventSink,
    ) -> VcpuRunner {
        VcpuRunner {
            index: self.index,
            fd: self.fd,
            requests: wiring.requests,
            pending: wiring.pending,
            io_bus,
            mmio_bus,
            events,
            counters: wiring.counters,
            dirty_ring_full: self.dirty_ring_full,
            io_in_flight: false,
            sync_regs: self.sync_regs,
            resume_poll: SPIN_WAIT,
            exits: ExitLog::default(),
        }
    }
}

pub(super) struct VcpuRunner {
    index: u8,
    fd: VcpuFd,
    requests: Receiver<VcpuRequest>,
    pending: Arc<AtomicBool>,
    io_bus: Arc<Bus>,
    mmio_bus: Arc<Bus>,
    events: VmEventSink,
    counters: Arc<VcpuExitCounters>,
    dirty_ring_full: Option<DirtyRingFullHandler>,
    /// The last exit was port or MMIO I/O, which KVM completes (an IN's
    /// value into RAX, RIP past the instruction) only at the next KVM_RUN.
    io_in_flight: bool,
    /// KVM stores registers in `kvm_run` at every exit.
    sync_regs: bool,
    /// How long a paused thread polls for its next request before it
    /// sleeps: set by the last pause's [`PauseLength`].
    resume_poll: Duration,
    /// The last exits, for a crash report.
    exits: ExitLog,
}

/// Most KVM_RUN calls spent completing one I/O (a long string I/O exits once
/// per chunk).
const MAX_COMPLETION_RUNS: usize = 1024;

enum Flow {
    Continue,
    Stop,
}

impl VcpuRunner {
    pub(super) fn run(&mut self, start_paused: bool) {
        // Made (and, ahead, moved to its CPUs) already: from here on it
        // only runs its vCPU.
        crate::seccomp::confine_this_thread(crate::seccomp::ThreadFilter::Vcpu);
        crate::seccomp::make_a_forbidden_call_if_asked("vcpu");
        let flag: *mut u8 = &mut self.fd.get_kvm_run().immediate_exit;
        KICK_EXIT_FLAG.with(|f| f.set(flag));
        self.run_loop(start_paused);
        // The flag dies with the fd: a late kick must not write to it.
        KICK_EXIT_FLAG.with(|f| f.set(std::ptr::null_mut()));
    }

    /// The vCPU, back from its ended thread: an in-place reboot runs it
    /// again on a new thread (KVM keeps a vCPU for its VM's lifetime).
    pub(super) fn into_vcpu(self) -> Vcpu {
        Vcpu {
            index: self.index,
            fd: self.fd,
            dirty_ring_full: self.dirty_ring_full,
            in_place: None,
            sync_regs: self.sync_regs,
        }
    }

    fn run_loop(&mut self, start_paused: bool) {
        let mut paused = start_paused;
        loop {
            if paused || self.pending.swap(false, Ordering::SeqCst) {
                if let Flow::Stop = self.complete_io() {
                    paused = true;
                }
                match self.handle_requests(&mut paused) {
                    Flow::Continue => {}
                    Flow::Stop => return,
                }
                if paused {
                    continue;
                }
            }
            let flow = self.run_once();
            // A kick since the last look at `pending` made KVM_RUN return at
            // once (or cut it short); `pending` is looked at next.
            self.fd.set_kvm_immediate_exit(0);
            if let Flow::Stop = flow {
                // Park until told to exit, so the machine decides what happens.
                paused = true;
            }
        }
    }

    /// Serves queued requests. While paused, blocks for the next one.
    fn handle_requests(&mut self, paused: &mut bool) -> Flow {
        loop {
            let req = if *paused {
                // A synchronizer's pause lasts ~100 µs: poll for the resume
                // that long before sleeping (not through a long pause).
                match spin_recv(&self.requests, self.resume_poll)
                    .map_or_else(|| self.requests.recv(), Ok)
                {
                    Ok(r) => r,
                    Err(_) => return Flow::Stop,
                }
            } else {
                match self.requests.try_recv() {
                    Ok(r) => r,
                    Err(std::sync::mpsc::TryRecvError::Empty) => return Flow::Continue,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => return Flow::Stop,
                }
            };
            match req {
                VcpuRequest::Pause(ack, length) => {
                    *paused = true;
                    self.resume_poll = match length {
                        PauseLength::Brief => SPIN_WAIT,
                        PauseLength::Long => Duration::ZERO,
                    };
                    let _ = ack.send(());
                }
                VcpuRequest::Resume => *paused = false,
                VcpuRequest::Run(job) => {
                    job(&mut self.fd);
                    // A job may have set registers: the sync area is stale
                    // until the next exit.
                    REGS_SYNCED.with(|s| s.set(false));
                }
                VcpuRequest::Exit => return Flow::Stop,
            }
        }
    }

    /// Lets KVM finish the I/O of the last exit without running the guest
    /// (KVM_RUN with `immediate_exit`), so that a pause leaves the vCPU at an
    /// instruction boundary: registers saved now are complete, and a restored
    /// VM neither repeats the I/O (an OUT written twice, an IN that consumes a
    /// second byte) nor loses an IN's value. As Firecracker and Cloud
    /// Hypervisor do before saving a vCPU; one extra KVM_RUN, only when the
    /// pause came right after an I/O exit (a kicked vCPU has nothing pending).
    fn complete_io(&mut self) -> Flow {
        if !self.io_in_flight {
            return Flow::Continue;
        }
        self.fd.set_kvm_immediate_exit(1);
        let mut flow = Flow::Continue;
        for _ in 0..MAX_COMPLETION_RUNS {
            // A string I/O may need more chunks: each is served as usual.
            if let Flow::Stop = self.run_once() {
                flow = Flow::Stop;
                break;
            }
            if !self.io_in_flight {
                break;
            }
        }
        self.fd.set_kvm_immediate_exit(0);
        flow
    }

    /// One KVM_RUN and its exit, kept in the exit log.
    fn run_once(&mut self) -> Flow {
        let mut seen = Seen {
            at: Instant::now(),
            kind: ExitKind::Other,
            addr: 0,
        };
        let flow = self.run_and_dispatch(&mut seen);
        let regs = REGS_SYNCED.with(|s| s.get()).then(|| {
            // The area KVM stored at this exit (nothing ran since).
            let sync = self.fd.sync_regs();
            ExitRegs {
                rip: sync.regs.rip,
                rsp: sync.regs.rsp,
                rflags: sync.regs.rflags,
                cr3: sync.sregs.cr3,
                cs: sync.sregs.cs.selector,
            }
        });
        self.exits.push(ExitRecord {
            at: seen.at,
            kind: seen.kind,
            addr: seen.addr,
            regs,
        });
        flow
    }

    fn run_and_dispatch(&mut self, seen: &mut Seen) -> Flow {
        let c = &self.counters;
        self.io_in_flight = false;
        let exit = self.fd.run();
        seen.at = Instant::now();
        // KVM stores the sync area on the way out of a KVM_RUN that ran or
        // was interrupted (a kick); after any other failure, assume not.
        let stored = match &exit {
            Ok(_) => true,
            Err(e) => e.errno() == libc::EINTR,
        };
        REGS_SYNCED.with(|s| s.set(self.sync_regs && stored));
        match exit {
            Ok(VcpuExit::IoOut(port, data)) => {
                (seen.kind, seen.addr) = (ExitKind::IoOut, u64::from(port));
                c.io_out.fetch_add(1, Ordering::Relaxed);
                self.io_bus.write(u64::from(port), data);
                self.io_in_flight = true;
            }
            Ok(VcpuExit::IoIn(port, data)) => {
                (seen.kind, seen.addr) = (ExitKind::IoIn, u64::from(port));
                c.io_in.fetch_add(1, Ordering::Relaxed);
                self.io_bus.read(u64::from(port), data);
                self.io_in_flight = true;
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                (seen.kind, seen.addr) = (ExitKind::MmioRead, addr);
                c.mmio_read.fetch_add(1, Ordering::Relaxed);
                self.mmio_bus.read(addr, data);
                self.io_in_flight = true;
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                (seen.kind, seen.addr) = (ExitKind::MmioWrite, addr);
                c.mmio_write.fetch_add(1, Ordering::Relaxed);
                self.mmio_bus.write(addr, data);
                self.io_in_flight = true;
            }
            Ok(VcpuExit::Hlt) => {
                seen.kind = ExitKind::Hlt;
                c.other.fetch_add(1, Ordering::Relaxed);
            }
            Ok(VcpuExit::Shutdown) => {
                c.other.fetch_add(1, Ordering::Relaxed);
                self.log_crash();
                self.events.send(VmEvent::Crashed {
                    vcpu: self.index,
                    reason: "triple fault".into(),
                });
                return Flow::Stop;
            }
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                c.other.fetch_add(1, Ordering::Relaxed);
                let event = match kind {
                    kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => VmEvent::Poweroff { code: 0 },
                    kvm_bindings::KVM_SYSTEM_EVENT_RESET => VmEvent::Reset,
                    other => VmEvent::Error(format!("vCPU {}: system event {other}", self.index)),
                };
                self.events.send(event);
                return Flow::Stop;
            }
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                self.events.send(VmEvent::Error(format!(
                    "vCPU {}: KVM entry failed (reason {reason:#x}, cpu {cpu})",
                    self.index
                )));
                return Flow::Stop;
            }
            Ok(VcpuExit::InternalError) => {
                let rip = self.fd.get_regs().map(|r| r.rip).unwrap_or(0);
                self.events.send(VmEvent::Error(format!(
                    "vCPU {}: KVM internal error (emulation failure?) at rip {rip:#x}",
                    self.index
                )));
                return Flow::Stop;
            }
            Ok(VcpuExit::Unsupported(KVM_EXIT_DIRTY_RING_FULL)) => {
                seen.kind = ExitKind::DirtyRingFull;
                c.dirty_ring_full.fetch_add(1, Ordering::Relaxed);
                let Some(handler) = &self.dirty_ring_full else {
                    self.events.send(VmEvent::Error(format!(
                        "vCPU {}: dirty ring full and nobody harvests it",
                        self.index
                    )));
                    return Flow::Stop;
                };
                // Harvest + KVM_RESET_DIRTY_RINGS, then re-enter.
                handler(self.index);
            }
            Ok(VcpuExit::Intr) => {
                seen.kind = ExitKind::Interrupted;
                c.interrupted.fetch_add(1, Ordering::Relaxed);
            }
            Ok(other) => {
                c.other.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(vcpu = self.index, exit = ?other, "unhandled vCPU exit");
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                seen.kind = ExitKind::Interrupted;
                c.interrupted.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.events.send(VmEvent::Error(format!(
                    "vCPU {}: KVM_RUN failed: {e}",
                    self.index
                )));
                return Flow::Stop;
            }
        }
        Flow::Continue
    }
}

/// What [`VcpuRunner::run_and_dispatch`] saw of its exit, for the exit log.
struct Seen {
    at: Instant,
    kind: ExitKind,
    addr: u64,
}

impl VcpuRunner {
    /// Logs, as an ERROR, the registers of this vCPU as it crashed (read
    /// here, on its thread, before anything else can change them): where it
    /// was (RIP, RSP, CS, SS, RFLAGS) and in which mode (CR0, CR3, CR4,
    /// EFER), which is what telling a kernel bug from a VMM bug needs first.
    /// Where KVM resets the vCPU before reporting the crash (AMD-V), those
    /// are the reset vector's: the last exits before it (their registers
    /// as KVM stored them) follow in a second ERROR line.
    fn log_crash(&self) {
        self.log_registers_at_crash();
        tracing::error!(
            vcpu = self.index,
            exits = %self.exits.report(Instant::now()),
            "the vCPU's last exits before the crash (oldest first, time before the crash)"
        );
    }

    fn log_registers_at_crash(&self) {
        let (regs, sregs) = match synced_registers(&self.fd) {
            Some(sync) => (Ok(sync.regs), Ok(sync.sregs)),
            None => (self.fd.get_regs(), self.fd.get_sregs()),
        };
        let (Ok(r), Ok(s)) = (regs, sregs) else {
            tracing::error!(
                vcpu = self.index,
                "guest crashed: triple fault (its registers cannot be read)"
            );
            return;
        };
        tracing::error!(
            vcpu = self.index,
            rip = format_args!("{:#x}", r.rip),
            rsp = format_args!("{:#x}", r.rsp),
            rflags = format_args!("{:#x}", r.rflags),
            cs = format_args!("{:#x}", s.cs.selector),
            ss = format_args!("{:#x}", s.ss.selector),
            cr0 = format_args!("{:#x}", s.cr0),
            cr3 = format_args!("{:#x}", s.cr3),
            cr4 = format_args!("{:#x}", s.cr4),
            efer = format_args!("{:#x}", s.efer),
            "guest crashed: triple fault"
        );
    }
}

thread_local! {
    /// The sync area of this thread's vCPU's `kvm_run` holds its current
    /// registers (see [`synced_registers`]).
    static REGS_SYNCED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// What KVM_RUN asks KVM to store in `kvm_run` at every exit
/// (KVM_CAP_SYNC_REGS): general and special registers. Not the pending
/// events: an NMI can be queued for a vCPU after its exit (another vCPU's
/// IPI), and only KVM_GET_VCPU_EVENTS, which folds queued NMIs in, sees it.
pub(super) const SYNC_REGS_WANTED: u64 = SyncReg::Register as u64 | SyncReg::SystemRegister as u64;

/// The registers and special registers of `fd` (in the returned
/// `kvm_sync_regs`, whose `events` are not kept up to date), as KVM stored
/// them in its `kvm_run` at the vCPU's last exit — if the caller is that
/// vCPU's thread, no job has run since that exit, and KVM supports it;
/// `None` otherwise (the caller then reads them with KVM_GET_REGS and
/// KVM_GET_SREGS). Nothing but an ioctl changes them while the vCPU is out
/// of KVM_RUN. Spares a save two ioctls (~6 µs each on this PVM host), which
/// a fault-tolerance sync pays at every output.
pub fn synced_registers(fd: &VcpuFd) -> Option<kvm_bindings::kvm_sync_regs> {
    REGS_SYNCED.with(|s| s.get()).then(|| fd.sync_regs())
}
