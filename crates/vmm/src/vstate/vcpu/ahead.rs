//! [`VcpuThreadAhead`]: a vCPU thread started before the vCPU it will run
//! is restored, which also makes that vCPU's first KVM_RUN (with
//! `immediate_exit`) so that KVM's per-thread set-up is done before the
//! guest's pause.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::control::{spin_recv, VcpuControl, VcpuHandle};
use super::kick::install_kick_handler;
use super::runner::VcpuRunner;
use super::{Vcpu, VcpuError};
use crate::devices::bus::Bus;
use crate::sys;
use crate::vstate::VmEventSink;

/// How long a thread made ahead polls for its vCPU once told to get ready
/// ([`VcpuThreadAhead::get_ready`]) before it sleeps again: longer than a
/// restore (0.2-0.4 ms here).
const READY_SPIN: Duration = Duration::from_millis(2);

enum AheadRequest {
    /// Make the vCPU's first KVM_RUN (see [`VcpuThreadAhead::first_run`]).
    FirstRun(FirstRun),
    /// Poll for the start for up to [`READY_SPIN`], away from the CPU of
    /// the thread that restores.
    GetReady,
    /// Run this vCPU.
    Start(Box<(VcpuRunner, bool)>),
}

/// KVM_RUN's request number: `_IO(KVMIO, 0x80)` (include/uapi/linux/kvm.h).
const KVM_RUN: libc::c_ulong = ((kvm_bindings::KVMIO as libc::c_ulong) << 8) | 0x80;

/// A vCPU's first KVM_RUN, made by its thread ahead of the restore.
struct FirstRun {
    /// The vCPU's fd.
    fd: std::os::fd::RawFd,
    /// `immediate_exit` in the vCPU's `kvm_run`.
    immediate_exit: *mut u8,
    /// Answered once the KVM_RUN has returned: its errno (EINTR expected).
    done: Sender<i32>,
}

// SAFETY: `fd` and `immediate_exit` belong to a vCPU whose owner waits for
// `done` (or for the thread's end) before it can drop or use the vCPU again
// (`VcpuThreadAhead::first_run`), so they are valid while the thread uses
// them.
unsafe impl Send for FirstRun {}

/// A vCPU thread started before the vCPU it will run is restored (a live
/// migration's destination makes it while memory is still being copied).
/// It sleeps until [`get_ready`](Self::get_ready), then polls for its
/// [`start`](Self::start) on a CPU other than the restoring thread's, and
/// runs the restored vCPU as soon as that comes. A restore then neither
/// spawns a thread nor
/// wakes a sleeping one (each 0.05-0.25 ms on this host when the other CPU
/// is idle), and the polling never takes the restoring thread's CPU (on two
/// cores a poller woken there held it for a whole time slice, 1.6 ms, with
/// the other CPU idle). (Writing the registers on this thread, in parallel
/// with the devices' set-up, was measured slower here: both took longer.)
/// Dropped unstarted, the thread ends.
pub struct VcpuThreadAhead {
    index: u8,
    requests: Sender<AheadRequest>,
    /// The thread's kernel id, once it has run (0 before).
    tid: Arc<std::sync::atomic::AtomicI32>,
    thread: JoinHandle<Option<Vcpu>>,
}

impl VcpuThreadAhead {
    /// Starts the thread for vCPU `index`; it sleeps until told more.
    pub fn spawn(index: u8) -> Result<Self, VcpuError> {
        install_kick_handler()?;
        let (tx, rx) = channel::<AheadRequest>();
        let tid = Arc::new(std::sync::atomic::AtomicI32::new(0));
        let my_tid = tid.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || thread_ahead(&rx, &my_tid))
            .map_err(|source| VcpuError::Spawn { index, source })?;
        Ok(VcpuThreadAhead {
            index,
            requests: tx,
            tid,
            thread,
        })
    }

    /// The vCPU index the thread is for.
    pub fn index(&self) -> u8 {
        self.index
    }

    /// Makes `vcpu`'s first KVM_RUN on this thread, with `immediate_exit`
    /// set so that the guest runs nothing (KVM returns EINTR before any
    /// entry), and returns once it has. KVM does per-thread set-up at a
    /// vCPU's first KVM_RUN from a new thread (the vCPU's pid; for the
    /// VM's first, its NX huge page recovery worker): made here, while
    /// memory is still being copied, it is not in the restored guest's
    /// first entry. KVM answers EINTR; any other answer is an error.
    pub fn first_run(&self, vcpu: &mut Vcpu) -> Result<(), VcpuError> {
        if vcpu.index != self.index {
            return Err(VcpuError::WrongThread {
                vcpu: vcpu.index,
                thread: self.index,
            });
        }
        let (done, ran) = channel();
        let request = FirstRun {
            fd: std::os::fd::AsRawFd::as_raw_fd(&vcpu.fd),
            immediate_exit: &mut vcpu.fd.get_kvm_run().immediate_exit,
            done,
        };
        self.requests
            .send(AheadRequest::FirstRun(request))
            .map_err(|_| VcpuError::Gone(self.index))?;
        // Until it has run, `vcpu` stays borrowed here (see FirstRun). An
        // error means the thread is gone, and with it the request.
        match ran.recv().map_err(|_| VcpuError::Gone(self.index))? {
            libc::EINTR => Ok(()),
            errno => Err(VcpuError::Kvm {
                index: self.index,
                what: "KVM_RUN (first, ahead, with immediate_exit)",
                source: kvm_ioctls::Error::new(errno),
            }),
        }
    }

    /// Its vCPU comes soon: poll rather than sleep, away from the caller's
    /// CPU (if the caller may use another).
    pub fn get_ready(&self) {
        let tid = self.tid.load(Ordering::Acquire);
        if tid != 0 {
            affinity::keep_off_callers_cpu(tid);
        }
        let _ = self.requests.send(AheadRequest::GetReady);
    }

    /// Runs `vcpu` (of this thread's index, restored) on the thread,
    /// paused if `start_paused`, as [`Vcpu::start`] would on a new one.
    pub fn start(
        self,
        vcpu: Vcpu,
        io_bus: Arc<Bus>,
        mmio_bus: Arc<Bus>,
        events: VmEventSink,
        start_paused: bool,
    ) -> Result<VcpuHandle, VcpuError> {
        if vcpu.index != self.index {
            return Err(VcpuError::WrongThread {
                vcpu: vcpu.index,
                thread: self.index,
            });
        }
        let (control, wiring) = VcpuControl::new(self.index);
        let runner = vcpu.runner(wiring, io_bus, mmio_bus, events);
        self.requests
            .send(AheadRequest::Start(Box::new((runner, start_paused))))
            .map_err(|_| VcpuError::Gone(self.index))?;
        Ok(control.handle(self.thread))
    }
}

/// The body of a [`VcpuThreadAhead`].
fn thread_ahead(rx: &Receiver<AheadRequest>, tid: &std::sync::atomic::AtomicI32) -> Option<Vcpu> {
    // The CPUs it may use, before get_ready narrows them.
    let allowed = affinity::current();
    tid.store(sys::gettid(), Ordering::Release);
    // Its filter now, not inside the pause (the runner's is then a no-op).
    crate::seccomp::confine_this_thread(crate::seccomp::ThreadFilter::Vcpu);
    let mut ready = false;
    loop {
        let next = if ready {
            spin_recv(rx, READY_SPIN).or_else(|| rx.recv().ok())
        } else {
            rx.recv().ok()
        };
        match next {
            None => return None,
            Some(AheadRequest::FirstRun(r)) => {
                // SAFETY: see FirstRun: the fd and the kvm_run mapping are
                // the live vCPU's, whose owner waits for `done`. KVM_RUN
                // takes no argument; with immediate_exit set it returns
                // EINTR without entering the guest.
                let errno = unsafe {
                    std::ptr::write_volatile(r.immediate_exit, 1);
                    let ret = libc::ioctl(r.fd, KVM_RUN, 0);
                    let errno = std::io::Error::last_os_error().raw_os_error();
                    std::ptr::write_volatile(r.immediate_exit, 0);
                    if ret == 0 {
                        0
                    } else {
                        errno.unwrap_or(0)
                    }
                };
                let _ = r.done.send(errno);
            }
            Some(AheadRequest::GetReady) => ready = true,
            Some(AheadRequest::Start(b)) => {
                if ready {
                    if let Some(set) = &allowed {
                        affinity::set(0, set);
                    }
                }
                let (mut runner, start_paused) = *b;
                runner.run(start_paused);
                return Some(runner.into_vcpu());
            }
        }
    }
}

/// CPU affinity, for [`VcpuThreadAhead`].
mod affinity {
    use crate::sys::{self, CpuSet};

    /// The calling thread's allowed CPUs.
    pub(super) fn current() -> Option<CpuSet> {
        sys::thread_affinity(0).ok()
    }

    /// Sets thread `tid`'s (0: the caller's) allowed CPUs; best effort.
    pub(super) fn set(tid: libc::pid_t, set: &CpuSet) -> bool {
        sys::set_thread_affinity(tid, set).is_ok()
    }

    /// Lets thread `tid` use the caller's allowed CPUs but the one the
    /// caller runs on, if that leaves any; best effort. Returns the CPU
    /// kept off.
    pub(super) fn keep_off_callers_cpu(tid: libc::pid_t) -> Option<usize> {
        let cpu = sys::current_cpu().ok()?;
        let mut others = current()?;
        others.remove(cpu);
        if others.count() == 0 {
            return None;
        }
        set(tid, &others).then_some(cpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn wait_for_tid(t: &VcpuThreadAhead) -> libc::pid_t {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let tid = t.tid.load(Ordering::Acquire);
            if tid != 0 {
                return tid;
            }
            assert!(std::time::Instant::now() < deadline, "the thread never ran");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_thread_ahead_polls_off_the_callers_cpu_and_ends_unstarted() {
        let t = VcpuThreadAhead::spawn(3).unwrap();
        assert_eq!(t.index(), 3);
        let tid = wait_for_tid(&t);
        let before = sys::thread_affinity(tid).unwrap();
        let cpus = before.count();
        let kept_off = affinity::keep_off_callers_cpu(tid);
        if cpus >= 2 {
            let cpu = kept_off.expect("two CPUs allowed, one kept off");
            let after = sys::thread_affinity(tid).unwrap();
            assert!(before.contains(cpu));
            assert!(!after.contains(cpu));
            assert_eq!(after.count(), cpus - 1);
        } else {
            assert_eq!(kept_off, None, "the only CPU cannot be kept off");
        }
        t.get_ready();
        // Dropped unstarted: the thread ends (after its poll at most).
        drop(t);
        let task = format!("/proc/self/task/{tid}");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while Path::new(&task).exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "the thread did not end"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
