//! What the VMM gives up once it has started, before its first thread: all
//! capabilities but the one it may still need, new privileges, and every
//! system call its threads do not make (seccomp, `vmm::seccomp`).
//!
//! **Capabilities kept.** `CAP_NET_ADMIN` alone, and only by a VMM that may
//! still open a TAP by name: a boot with network devices (opened after the
//! API runs), a `--restore` from a directory, a live-migration destination
//! and a fault-tolerance standby (they open this host's TAPs when the VM
//! arrives or fails over). A zero-copy destination and a warm-restart
//! successor are handed the TAP fds and keep nothing; nor does a VM
//! without network devices. Every other capability goes — the API socket
//! is bound (and given its group, `CAP_CHOWN`) before — which means files
//! the VMM opens later (disks on a restore, snapshot and state
//! directories, memory files) must be open to its uid without
//! `CAP_DAC_OVERRIDE`, and a migration or standby port below 1024 cannot be
//! bound. Capabilities belong to each thread and cannot be dropped for a
//! whole process later, so `CAP_NET_ADMIN` stays for the VMM's life; the
//! vCPU and device filters keep TUN ioctls and sockets from the threads
//! the guest drives.

use vmm::seccomp::{self, SeccompError};

use crate::cli::Args;
use crate::sys;

/// Why the VMM could not confine itself.
#[derive(Debug, thiserror::Error)]
pub enum HardeningError {
    /// The capability sets could not be reduced.
    #[error("cannot drop capabilities")]
    Capabilities(#[source] std::io::Error),
    /// PR_SET_NO_NEW_PRIVS failed.
    #[error("cannot set no_new_privs")]
    NoNewPrivileges(#[source] std::io::Error),
    /// The seccomp filters could not be built or installed.
    #[error(transparent)]
    Seccomp(#[from] SeccompError),
}

/// Gives up what `args`' VMM does not need, on the calling thread — the
/// process's only one: every thread made afterwards inherits it.
pub fn harden(args: &Args) -> Result<(), HardeningError> {
    let keep: &[u32] = if may_open_taps(args) {
        &[sys::CAP_NET_ADMIN]
    } else {
        &[]
    };
    sys::keep_only_capabilities(keep).map_err(HardeningError::Capabilities)?;
    sys::no_new_privileges().map_err(HardeningError::NoNewPrivileges)?;
    seccomp::install_process_filter(args.seccomp.into())?;
    tracing::debug!(seccomp = ?args.seccomp, net_admin = !keep.is_empty(), "VMM confined");
    Ok(())
}

/// Whether this VMM may open a TAP by name after start-up.
fn may_open_taps(args: &Args) -> bool {
    if args.incoming_local.is_some() || (args.restore.is_some() && args.await_state) {
        return false;
    }
    if args.restore.is_some() || args.incoming.is_some() || args.ft_standby.is_some() {
        return true;
    }
    // A boot: its network devices (a bad configuration fails later anyway).
    args.machine_config()
        .map_or(true, |(config, _)| !config.nets.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn only_a_vmm_that_may_open_a_tap_keeps_net_admin() {
        let may = |argv: &[&str]| may_open_taps(&Args::parse_from(argv));
        assert!(!may(&["kemari", "--kernel", "/k", "--memory", "64M"]));
        assert!(may(&[
            "kemari", "--kernel", "/k", "--memory", "64M", "--net", "tap=t0"
        ]));
        assert!(may(&["kemari", "--restore", "/d"]));
        assert!(!may(&["kemari", "--restore", "/d", "--await-state"]));
        assert!(!may(&["kemari", "--incoming-local", "/s"]));
        assert!(may(&["kemari", "--incoming", "h:1"]));
        assert!(may(&["kemari", "--ft-standby", "h:1"]));
    }
}
