//! Kicking a vCPU thread out of KVM_RUN: a real-time signal whose handler
//! sets the thread's own `kvm_run.immediate_exit`, so that a kick landing
//! just before KVM_RUN makes that KVM_RUN return at once instead of being
//! lost until the next exit.

use std::sync::Once;

use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

use super::VcpuError;

/// Signal used to kick vCPUs out of KVM_RUN.
pub(super) fn kick_signal() -> i32 {
    SIGRTMIN()
}

thread_local! {
    /// The `immediate_exit` byte of the `kvm_run` of the vCPU this thread
    /// runs (null on other threads).
    pub(super) static KICK_EXIT_FLAG: std::cell::Cell<*mut u8> = const { std::cell::Cell::new(std::ptr::null_mut()) };
}

/// A kick that lands while its vCPU thread is outside KVM_RUN — between its
/// look at the request queue and the ioctl — would otherwise be lost until
/// the next exit: setting `immediate_exit` makes that KVM_RUN return at once
/// (KVM's race-free way of kicking, as in Cloud Hypervisor).
extern "C" fn kick_handler(_: i32, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // `try_with`: nothing to do on a thread being torn down.
    let _ = KICK_EXIT_FLAG.try_with(|f| {
        let flag = f.get();
        if !flag.is_null() {
            // SAFETY: the vCPU thread points the flag at its own kvm_run
            // (mapped as long as its VcpuFd lives) and nulls it before the fd
            // is dropped; a handler runs on that same thread, so the mapping
            // is live. A volatile byte store is async-signal-safe.
            unsafe { std::ptr::write_volatile(flag, 1) };
        }
    });
}

pub(super) fn install_kick_handler() -> Result<(), VcpuError> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = register_signal_handler(kick_signal(), kick_handler).map_err(VcpuError::Signal);
    });
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kick_sets_the_immediate_exit_flag_of_its_own_thread_only() {
        install_kick_handler().unwrap();
        let mut flag = 0u8;
        KICK_EXIT_FLAG.with(|f| f.set(&mut flag));
        // Another thread's kick (no flag registered there) changes nothing.
        std::thread::spawn(|| {
            // SAFETY: raise() sends the kick signal to this thread; its
            // handler is installed above.
            unsafe { libc::raise(kick_signal()) };
        })
        .join()
        .unwrap();
        // SAFETY: `flag` is a live local; the handler writes it only on this
        // thread.
        assert_eq!(unsafe { std::ptr::read_volatile(&flag) }, 0);
        // SAFETY: as above, on this thread.
        unsafe { libc::raise(kick_signal()) };
        // SAFETY: as above.
        assert_eq!(unsafe { std::ptr::read_volatile(&flag) }, 1);
        KICK_EXIT_FLAG.with(|f| f.set(std::ptr::null_mut()));
    }
}
