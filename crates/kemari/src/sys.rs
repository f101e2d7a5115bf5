//! The process-level system calls of the kemari binary, each behind a safe
//! function: the reaper that destroys the KVM VM after the VMM exited, the
//! idle priority the VMM ends at, and the capabilities and privileges it
//! gives up at start-up.
//!
//! **The reaper.**
//! When the last reference to a KVM VM goes, the kernel destroys it
//! (`kvm_destroy_vm`: shadow pages, memory slots, SRCU grace periods): 15–17
//! ms on this PVM host, paid by whichever process drops that reference — at
//! exit, the VMM itself. A warm restart, a snapshot with `--exit`, a
//! supervisor restarting kemari all wait for that exit. So just before it
//! ends the VM, the VMM forks a reaper: a child that closes every file
//! descriptor (no TAP, disk, socket or pipe is kept open by it), keeps only
//! its copy of the address space — whose mappings of the vCPUs' shared pages
//! hold the VM — and dies with its parent. The VM's destruction then runs in
//! the reaper's exit, after the VMM has exited.

/// Forks the reaper. Best effort: on failure the VMM simply pays the
/// destruction itself.
pub fn fork_reaper() {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: fork in a multi-threaded process: the child runs only
    // async-signal-safe system calls (prctl, getppid, close_range, pause,
    // _exit) and never returns into Rust code.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: raw system calls on no memory of ours; the child ends in
        // _exit or SIGKILL.
        unsafe {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            // Without close_range (Linux < 5.9) it would keep TAPs and
            // sockets open: no reaper then.
            if libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32) != 0
                || libc::getppid() != parent
            {
                libc::_exit(0);
            }
            loop {
                libc::pause();
            }
        }
    }
    if pid < 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "no reaper: the VM is destroyed in this process");
    }
}

/// Every thread of this process to `SCHED_IDLE` (best effort: a thread that
/// ended since, or a refusal, is only logged).
pub fn all_threads_at_idle_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    let threads: Vec<libc::pid_t> = std::fs::read_dir("/proc/self/task")
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        // At least this thread (pid 0 = the caller).
        .unwrap_or_else(|_| vec![0]);
    for tid in threads {
        // SAFETY: sched_setscheduler only reads `param`; `tid` is a thread
        // of this process (one that ended since is refused with ESRCH).
        if unsafe { libc::sched_setscheduler(tid, libc::SCHED_IDLE, &param) } != 0 {
            tracing::debug!(
                tid,
                error = %std::io::Error::last_os_error(),
                "cannot lower a thread's priority for the exit"
            );
        }
    }
}

/// `CAP_NET_ADMIN` (linux/capability.h): opening or creating a TAP.
pub const CAP_NET_ADMIN: u32 = 12;

/// capget/capset's header, version 3 (two 32-bit words per set).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_VERSION_3: u32 = 0x2008_0522;

/// Keeps only the capabilities in `keep` (of those the process has): the
/// others leave the permitted, effective and inheritable sets and the
/// bounding set, and the ambient set is cleared, so that nothing this
/// process does later, nor a program it could start, gets them back.
/// Capabilities belong to a thread and a new thread copies its creator's:
/// call it while the process has one thread. An unprivileged process (no
/// `CAP_SETPCAP`) keeps its bounding set, which gives it nothing.
pub fn keep_only_capabilities(keep: &[u32]) -> std::io::Result<()> {
    let mut header = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget writes two CapData (version 3) and reads the header.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: prctl with integer arguments only; a kernel without ambient
    // capabilities refuses it (EINVAL), which leaves none to clear.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    for cap in 0..64u32 {
        // SAFETY: as above; a capability beyond the kernel's last is EINVAL.
        if unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap, 0, 0, 0) } < 0 {
            break;
        }
        if keep.contains(&cap) {
            continue;
        }
        // SAFETY: as above.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EPERM) {
                return Err(e);
            }
            break;
        }
    }
    let mask = |word: usize| {
        keep.iter()
            .filter(|&&c| c as usize / 32 == word)
            .fold(0u32, |m, &c| m | 1 << (c % 32))
    };
    for (word, d) in data.iter_mut().enumerate() {
        let kept = mask(word) & d.permitted;
        *d = CapData {
            effective: kept,
            permitted: kept,
            inheritable: 0,
        };
    }
    // SAFETY: capset reads the header and two CapData (version 3).
    if unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `PR_SET_NO_NEW_PRIVS`: no program this process starts gains privileges
/// (setuid bits, file capabilities).
pub fn no_new_privileges() -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
