//! A helper process forked at start-up, before the VMM confines itself,
//! for the fences that need what a confined VMM may not do (run a program,
//! talk to etcd with an async runtime). It serves requests on one end of a
//! socket pair and dies with the VMM (`PR_SET_PDEATHSIG`).

use std::os::unix::net::UnixStream;

/// Forks a helper that runs `serve` on its end of a new socket pair, then
/// exits; returns the VMM's end. Call it while the process has one thread:
/// the child runs Rust code after the fork.
pub fn fork_helper(serve: impl FnOnce(UnixStream)) -> std::io::Result<UnixStream> {
    let (ours, theirs) = UnixStream::pair()?;
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the caller has one thread, so the child's copy of the address
    // space holds no lock another thread took; the child never returns from
    // this function (it ends in _exit).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if pid == 0 {
        drop(ours);
        // SAFETY: prctl and getppid take no memory of ours.
        let orphan = unsafe {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            libc::getppid() != parent
        };
        if !orphan {
            serve(theirs);
        }
        // SAFETY: ends the helper without running the parent's exit code.
        unsafe { libc::_exit(0) };
    }
    Ok(ours)
}
