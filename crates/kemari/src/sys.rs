//! The process-level system calls of the kemari binary, each behind a safe
//! function: the reaper that destroys the KVM VM after the VMM exited, and
//! the idle priority the VMM ends at.
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
