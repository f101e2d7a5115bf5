//! The VMM's seccomp filters: which system calls each kind of thread of a
//! kemari process may make (rust-vmm's `seccompiler`, as Firecracker and
//! Cloud Hypervisor do).
//!
//! ```text
//!  main thread ── Process filter (installed before any other thread exists)
//!   │  inherited by every thread it, or a thread it made, makes:
//!   ├─ signals, workers (op-N), follow-N, vm-prepare, heartbeat, console,
//!   │  serial-accept, NBD receivers, ahead threads before they run ... Process
//!   ├─ api event loop ── + Api filter; its handler and stream threads inherit both
//!   ├─ devices ───────── + Devices filter, once its loop runs
//!   └─ vcpuN ─────────── + Vcpu filter, once it runs its vCPU
//! ```
//!
//! A thread's filters stack: a call must pass every one, so a thread's own
//! filter only has to say what that thread does, and the process filter
//! bounds everything. Each is an allow-list; a call outside it kills the
//! process (`SECCOMP_RET_KILL_PROCESS`, the exit is SIGSYS), or with
//! [`SeccompMode::Log`] is allowed and logged by the kernel (`dmesg`:
//! `audit: type=1326 … syscall=N`), to learn what a new workload needs.
//! ioctl is allowed by request type only: KVM's (0xAE) on the process,
//! device and vCPU lists, TUN/tty/FIO ones (`'T'`) on all but the vCPU's,
//! socket-interface ones (0x89) on the process's alone. Whoever owns the
//! process chooses the mode once ([`install_process_filter`]); the threads
//! this crate starts then add their own ([`confine_this_thread`]). Without
//! it (a library user, a unit test) nothing is filtered.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

/// What a call outside a thread's filter does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeccompMode {
    /// Nothing is filtered.
    Off,
    /// Allowed, and logged by the kernel.
    Log,
    /// The process is killed (SIGSYS).
    Kill,
}

/// The kinds of thread with a filter of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadFilter {
    /// Every thread: what the whole VMM does (the main loop, workers,
    /// hand-overs, fault tolerance, the reaper it forks).
    Process,
    /// The API's event loop and its handler and stream threads.
    Api,
    /// The device event loop (virtio queues, disk and TAP I/O, the output
    /// gate, and what fault tolerance does from there).
    Devices,
    /// A vCPU thread: KVM_RUN and the exits it serves.
    Vcpu,
}

/// Why a filter could not be built or installed.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// seccompiler refused the rules (a bug here).
    #[error("seccomp filter {0:?} cannot be built")]
    Build(ThreadFilter, #[source] seccompiler::BackendError),
    /// The kernel refused the filter.
    #[error("seccomp filter {0:?} cannot be installed")]
    Install(ThreadFilter, #[source] seccompiler::Error),
    /// The process filter was already installed.
    #[error("the process's seccomp filter is already installed")]
    Twice,
}

/// The mode and the compiled filters, once the process chose.
struct Policy {
    mode: SeccompMode,
    api: BpfProgram,
    devices: BpfProgram,
    vcpu: BpfProgram,
}

static POLICY: OnceLock<Policy> = OnceLock::new();

thread_local! {
    /// This thread may not start threads (its filter forbids clone).
    static NO_THREADS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The filter this thread added (installing one costs 0.2–0.3 ms: the
    /// kernel checks, JIT-compiles and pre-evaluates it for every system
    /// call number; threads made ahead of a hand-over pay it there).
    static CONFINED: std::cell::Cell<Option<ThreadFilter>> = const { std::cell::Cell::new(None) };
}

/// Installs the process filter on the calling thread — call it before any
/// other thread exists, so that every thread inherits it — and makes
/// [`confine_this_thread`] install the others. Sets `PR_SET_NO_NEW_PRIVS`
/// (the kernel requires it of an unprivileged filter, and nothing here
/// executes a program). With [`SeccompMode::Off`] only records the choice.
pub fn install_process_filter(mode: SeccompMode) -> Result<(), SeccompError> {
    let policy = Policy {
        mode,
        api: compile(ThreadFilter::Api, mode)?,
        devices: compile(ThreadFilter::Devices, mode)?,
        vcpu: compile(ThreadFilter::Vcpu, mode)?,
    };
    let process = compile(ThreadFilter::Process, mode)?;
    POLICY.set(policy).map_err(|_| SeccompError::Twice)?;
    if mode != SeccompMode::Off {
        seccompiler::apply_filter(&process)
            .map_err(|e| SeccompError::Install(ThreadFilter::Process, e))?;
    }
    Ok(())
}

/// The mode the process chose ([`SeccompMode::Off`] if none).
pub fn mode() -> SeccompMode {
    POLICY.get().map_or(SeccompMode::Off, |p| p.mode)
}

/// Adds `kind`'s filter to the calling thread (nothing if the process chose
/// none, for [`ThreadFilter::Process`], which it inherited, or if the thread
/// already added it: a thread made ahead of a hand-over confines itself
/// when made, so that the 0.2–0.3 ms the kernel takes to install a filter
/// is not in the guest's pause). A failure is logged: the thread then runs
/// under the process filter alone.
pub fn confine_this_thread(kind: ThreadFilter) {
    let Some(policy) = POLICY.get() else {
        return;
    };
    if CONFINED.with(|c| c.get()) == Some(kind) {
        return;
    }
    let program = match kind {
        ThreadFilter::Process => return,
        ThreadFilter::Api => &policy.api,
        ThreadFilter::Devices => &policy.devices,
        ThreadFilter::Vcpu => &policy.vcpu,
    };
    if policy.mode == SeccompMode::Off {
        return;
    }
    match seccompiler::apply_filter(program) {
        Ok(()) => {
            CONFINED.with(|c| c.set(Some(kind)));
            if kind != ThreadFilter::Api {
                NO_THREADS.with(|t| t.set(true));
            }
        }
        Err(e) => tracing::error!(
            error = %SeccompError::Install(kind, e),
            "this thread runs without its own seccomp filter"
        ),
    }
}

/// Whether the calling thread may start a thread (a vCPU or the device
/// thread under its filter may not: see the console's flusher).
pub fn this_thread_may_spawn() -> bool {
    !NO_THREADS.with(|t| t.get())
}

fn compile(kind: ThreadFilter, mode: SeccompMode) -> Result<BpfProgram, SeccompError> {
    let mismatch = match mode {
        SeccompMode::Log => SeccompAction::Log,
        _ => SeccompAction::KillProcess,
    };
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e| SeccompError::Build(kind, e))?;
    let filter = SeccompFilter::new(rules(kind), mismatch, SeccompAction::Allow, arch)
        .map_err(|e| SeccompError::Build(kind, e))?;
    filter.try_into().map_err(|e| SeccompError::Build(kind, e))
}

/// ioctl request types (bits 8..16 of the request number).
const IOCTL_KVM: u64 = 0xae;
/// `'T'`: TUN (TUNSETIFF …), terminal (TCGETS) and FIO* (FIONBIO, FIOCLEX).
const IOCTL_TTY_TUN: u64 = b'T' as u64;
/// Socket interface ioctls (SIOCGIFFLAGS, SIOCGIFINDEX …).
const IOCTL_SOCKET: u64 = 0x89;

/// An ioctl rule per allowed request type.
fn ioctl_types(types: &[u64]) -> Vec<SeccompRule> {
    types
        .iter()
        .map(|&t| {
            let cond = SeccompCondition::new(
                1,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(0xff00),
                t << 8,
            )
            .expect("a valid ioctl condition");
            SeccompRule::new(vec![cond]).expect("a valid ioctl rule")
        })
        .collect()
}

/// What every thread does: memory, futexes, time, signals, its own end.
const COMMON: &[libc::c_long] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_futex,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_mremap,
    libc::SYS_brk,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigprocmask,
    libc::SYS_sigaltstack,
    libc::SYS_restart_syscall,
    libc::SYS_exit,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_setaffinity,
    libc::SYS_getcpu,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_gettimeofday,
    libc::SYS_getrandom,
    libc::SYS_gettid,
    libc::SYS_getpid,
    // Kicking a vCPU, an abort.
    libc::SYS_tgkill,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
    // Debug builds look at a descriptor (F_GETFD) before closing it.
    libc::SYS_fcntl,
];

/// Starting a thread (pthread_create: the stack, clone3, then in the new
/// thread its robust list, rseq, name and signal stack).
const THREADS: &[libc::c_long] = &[
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_prctl,
];

/// Socket and poll I/O on descriptors already open.
const STREAMS: &[libc::c_long] = &[
    libc::SYS_readv,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_ctl,
    libc::SYS_fcntl,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    libc::SYS_shutdown,
    libc::SYS_getrusage,
];

/// Block I/O on open files.
const FILE_IO: &[libc::c_long] = &[
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_preadv2,
    libc::SYS_pwritev2,
    libc::SYS_lseek,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_fallocate,
    libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
];

/// The API's event loop: new clients.
const API: &[libc::c_long] = &[libc::SYS_accept4, libc::SYS_accept];

/// Only the process filter: opening and making things, processes and
/// sockets, the process's end.
const PROCESS: &[libc::c_long] = &[
    // Files and directories (state, snapshots, memory files, sockets).
    libc::SYS_openat,
    libc::SYS_open,
    libc::SYS_newfstatat,
    libc::SYS_fstat,
    libc::SYS_stat,
    libc::SYS_lstat,
    libc::SYS_statx,
    libc::SYS_statfs,
    libc::SYS_fstatfs,
    libc::SYS_access,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_getdents64,
    libc::SYS_getcwd,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_link,
    libc::SYS_linkat,
    // Sockets bound by path are given their mode and group before they
    // appear (kemari-unix-socket: chmod, chown, rmdir of its private dir).
    libc::SYS_chmod,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    libc::SYS_chown,
    libc::SYS_lchown,
    libc::SYS_fchown,
    libc::SYS_fchownat,
    libc::SYS_rmdir,
    libc::SYS_ftruncate,
    libc::SYS_flock,
    libc::SYS_memfd_create,
    libc::SYS_msync,
    libc::SYS_mincore,
    // A pmem backing's stale cached pages dropped when it is opened.
    libc::SYS_fadvise64,
    // Descriptors.
    libc::SYS_dup,
    libc::SYS_dup2,
    libc::SYS_dup3,
    libc::SYS_close_range,
    libc::SYS_pipe2,
    libc::SYS_eventfd2,
    libc::SYS_timerfd_create,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_pwait2,
    // Sockets: the API, migration and fault-tolerance links, NBD, TAP set-up.
    libc::SYS_socket,
    libc::SYS_socketpair,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_recvmmsg,
    libc::SYS_sendmmsg,
    // The process: signals, scheduling, the reaper (fork, its death signal,
    // close_range, pause), the filters the threads add.
    libc::SYS_rt_sigaction,
    libc::SYS_sched_setscheduler,
    libc::SYS_sched_getscheduler,
    libc::SYS_sched_getparam,
    libc::SYS_set_tid_address,
    libc::SYS_getppid,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_getrlimit,
    libc::SYS_prlimit64,
    libc::SYS_uname,
    libc::SYS_sysinfo,
    libc::SYS_pause,
    libc::SYS_wait4,
    libc::SYS_waitid,
    libc::SYS_seccomp,
    libc::SYS_exit_group,
];

fn rules(kind: ThreadFilter) -> BTreeMap<i64, Vec<SeccompRule>> {
    let (lists, ioctls): (&[&[libc::c_long]], &[u64]) = match kind {
        ThreadFilter::Process => (
            &[COMMON, THREADS, STREAMS, FILE_IO, PROCESS],
            &[IOCTL_KVM, IOCTL_TTY_TUN, IOCTL_SOCKET],
        ),
        ThreadFilter::Api => (&[COMMON, THREADS, STREAMS, API], &[IOCTL_TTY_TUN]),
        // The output gate may pause and save the machine and synchronize
        // it with a standby from this thread (fault tolerance).
        ThreadFilter::Devices => (&[COMMON, STREAMS, FILE_IO], &[IOCTL_KVM, IOCTL_TTY_TUN]),
        ThreadFilter::Vcpu => (&[COMMON], &[IOCTL_KVM]),
    };
    let mut map: BTreeMap<i64, Vec<SeccompRule>> = lists
        .iter()
        .flat_map(|l| l.iter())
        .map(|&nr| (nr, Vec::new()))
        .collect();
    map.insert(libc::SYS_ioctl, ioctl_types(ioctls));
    if kind != ThreadFilter::Process {
        // glibc opens a /proc file read-only on its own, once per process,
        // on whichever thread first gives memory of a thread arena back
        // (malloc's heap shrinking reads /proc/sys/vm/overcommit_memory):
        // seen from an API stream thread, and from the device thread after
        // an in-place reboot or a failover freed the old VM's buffers (the
        // lab's kemari died of SIGSYS, dmesg: comm="devices" syscall=257).
        // Any thread that frees memory may be first. Reading, never
        // creating or writing.
        map.insert(libc::SYS_openat, vec![read_only_open()]);
    }
    map
}

/// openat whose flags neither write nor create (O_RDONLY, no O_CREAT,
/// O_TRUNC or O_TMPFILE).
fn read_only_open() -> SeccompRule {
    let forbidden = (libc::O_ACCMODE | libc::O_CREAT | libc::O_TRUNC | libc::O_TMPFILE) as u64;
    let cond = SeccompCondition::new(
        2,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(forbidden),
        0,
    )
    .expect("a valid open condition");
    SeccompRule::new(vec![cond]).expect("a valid open rule")
}

/// Test builds only (feature `fault-injection`): if
/// `KEMARI_FAULT_FORBIDDEN_SYSCALL` names this kind of thread (`vcpu`), the
/// thread makes a call its filter forbids — opening a socket — so that a
/// test sees the process die of SIGSYS.
/// And if `KEMARI_FAULT_GLIBC_OPEN` names it (comma-separated kinds:
/// `vcpu`, `devices`), the thread opens `/proc/sys/vm/overcommit_memory`
/// read-only as glibc's malloc does on its own: the process must live on.
#[cfg(feature = "fault-injection")]
pub fn make_a_forbidden_call_if_asked(kind: &str) {
    if std::env::var("KEMARI_FAULT_FORBIDDEN_SYSCALL").is_ok_and(|v| v == kind) {
        tracing::warn!(thread = kind, "fault injection: a forbidden system call");
        let _ = crate::sys::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
    }
    if std::env::var("KEMARI_FAULT_GLIBC_OPEN").is_ok_and(|v| v.split(',').any(|k| k == kind)) {
        let opened = std::fs::File::open("/proc/sys/vm/overcommit_memory").is_ok();
        tracing::warn!(
            thread = kind,
            opened,
            "fault injection: glibc's read-only open of /proc/sys/vm/overcommit_memory"
        );
    }
}

/// Without the feature: nothing.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn make_a_forbidden_call_if_asked(kind: &str) {
    let _ = kind;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_filter_compiles_in_both_modes() {
        for kind in [
            ThreadFilter::Process,
            ThreadFilter::Api,
            ThreadFilter::Devices,
            ThreadFilter::Vcpu,
        ] {
            for mode in [SeccompMode::Kill, SeccompMode::Log] {
                assert!(!compile(kind, mode).unwrap().is_empty());
            }
        }
    }

    #[test]
    fn a_vcpu_may_run_kvm_but_not_open_or_make_anything() {
        let vcpu = rules(ThreadFilter::Vcpu);
        assert!(vcpu.contains_key(&libc::SYS_ioctl));
        // openat only read-only (every_confined_thread_may_only_read_a_file).
        assert_eq!(vcpu[&libc::SYS_openat].len(), 1);
        for nr in [
            libc::SYS_open,
            libc::SYS_socket,
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_execve,
            libc::SYS_memfd_create,
        ] {
            assert!(!vcpu.contains_key(&nr), "syscall {nr}");
        }
        // No thread may execute a program.
        for kind in [
            ThreadFilter::Process,
            ThreadFilter::Api,
            ThreadFilter::Devices,
        ] {
            assert!(!rules(kind).contains_key(&libc::SYS_execve));
        }
    }

    /// Runs `job` on a thread under `kind`'s rules, where a call outside
    /// them fails with EPERM rather than killing the test (the kill is the
    /// process's mode; here the refusal is what is looked at).
    fn confined<T: Send + 'static>(
        kind: ThreadFilter,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        let filter = SeccompFilter::new(
            rules(kind),
            SeccompAction::Errno(libc::EPERM as u32),
            SeccompAction::Allow,
            std::env::consts::ARCH.try_into().unwrap(),
        )
        .unwrap();
        let program: BpfProgram = filter.try_into().unwrap();
        std::thread::spawn(move || {
            seccompiler::apply_filter(&program).unwrap();
            job()
        })
        .join()
        .unwrap()
    }

    #[test]
    fn every_confined_thread_may_only_read_a_file() {
        for kind in [ThreadFilter::Api, ThreadFilter::Devices, ThreadFilter::Vcpu] {
            let scratch = std::env::temp_dir()
                .join(format!("kemari-seccomp-{}-{kind:?}", std::process::id()));
            let path = scratch.clone();
            let (read, created, written) = confined(kind, move || {
                // What glibc's malloc opens when a thread arena first shrinks.
                let read = std::fs::File::open("/proc/sys/vm/overcommit_memory").is_ok();
                let created = std::fs::File::create(&path).map_err(|e| e.raw_os_error());
                let written = std::fs::OpenOptions::new()
                    .write(true)
                    .open("/proc/self/comm")
                    .map_err(|e| e.raw_os_error());
                (read, created.map(drop), written.map(drop))
            });
            assert!(read, "{kind:?} may read");
            assert_eq!(created, Err(Some(libc::EPERM)), "{kind:?} may not create");
            assert_eq!(written, Err(Some(libc::EPERM)), "{kind:?} may not write");
            assert!(!scratch.exists());
        }
    }

    #[test]
    fn a_confined_thread_is_refused_what_its_filter_lacks() {
        let socket = confined(ThreadFilter::Vcpu, || {
            let refused = crate::sys::socket(libc::AF_INET, libc::SOCK_STREAM, 0).unwrap_err();
            // Time, memory and futexes still work.
            let _ = std::time::Instant::now();
            let v = vec![0u8; 1 << 20];
            (refused.raw_os_error(), v.len())
        });
        assert_eq!(socket, (Some(libc::EPERM), 1 << 20));
    }
}
