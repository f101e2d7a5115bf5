//! A TAP network interface opened through `/dev/net/tun`, carrying Ethernet
//! frames prefixed with a 12-byte virtio-net header (IFF_VNET_HDR with
//! TUNSETVNETHDRSZ = 12), non-blocking.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use tracing::info;
use vmm_sys_util::ioctl::{ioctl_with_mut_ref, ioctl_with_ref, ioctl_with_val};

use crate::sys;

/// Size of the virtio-net header on frames read from and written to the TAP
/// (struct virtio_net_hdr_v1).
pub const VNET_HDR_LEN: usize = 12;

const TUN_PATH: &str = "/dev/net/tun";

/// Errors while opening or configuring a TAP device.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    /// The name does not fit IFNAMSIZ or has a NUL or '/'.
    #[error("invalid TAP interface name {name:?}: {reason}")]
    InvalidName {
        /// The name.
        name: String,
        /// Why.
        reason: &'static str,
    },
    /// /dev/net/tun cannot be opened.
    #[error("cannot open {TUN_PATH}")]
    OpenTun(#[source] io::Error),
    /// TUNSETIFF failed.
    #[error("cannot attach to TAP interface {name}: {hint}")]
    Attach {
        /// The name.
        name: String,
        /// What the error usually means.
        hint: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Another configuration ioctl failed.
    #[error("cannot configure TAP interface {name} ({what})")]
    Configure {
        /// The name.
        name: String,
        /// Which step.
        what: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// An open TAP queue.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
    created: bool,
}

fn ifreq_with_name(name: &str) -> libc::ifreq {
    // SAFETY: ifreq is plain old data for which all-zero bytes are a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.as_bytes()) {
        *dst = *src as libc::c_char;
    }
    req
}

fn interface_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

fn validate_name(name: &str) -> Result<(), TapError> {
    let reason = if name.is_empty() {
        "empty"
    } else if name.len() >= libc::IFNAMSIZ {
        "longer than 15 bytes"
    } else if name.contains(['\0', '/'])
        || name.chars().any(char::is_whitespace)
        || name == "."
        || name == ".."
    {
        "contains a NUL, '/' or whitespace"
    } else {
        return Ok(());
    };
    Err(TapError::InvalidName {
        name: name.to_owned(),
        reason,
    })
}

impl Tap {
    /// Opens the TAP interface `name`, creating it if it does not exist; a
    /// created interface is brought up when `bring_up` is set (an existing one is
    /// left as its owner configured it). A created interface disappears when the
    /// last fd to it is closed.
    pub fn open(name: &str, bring_up: bool) -> Result<Tap, TapError> {
        validate_name(name)?;
        let existed = interface_exists(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(TUN_PATH)
            .map_err(TapError::OpenTun)?;
        let mut req = ifreq_with_name(name);
        req.ifr_ifru.ifru_flags =
            (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
        // SAFETY: TUNSETIFF reads (and updates) the ifreq we pass, which lives for
        // the whole call; the fd is our open /dev/net/tun.
        let rc = unsafe { ioctl_with_mut_ref(&file, libc::TUNSETIFF as _, &mut req) };
        if rc < 0 {
            let source = io::Error::last_os_error();
            let hint = match source.raw_os_error() {
                Some(libc::EPERM) | Some(libc::EACCES) => {
                    "permission denied (needs CAP_NET_ADMIN or a TAP owned by this user)"
                }
                Some(libc::EBUSY) => "the interface is in use by another process",
                Some(libc::EINVAL) => {
                    "an interface of that name exists and is not a TAP device (or has other flags)"
                }
                _ => "TUNSETIFF failed",
            };
            return Err(TapError::Attach {
                name: name.to_owned(),
                hint,
                source,
            });
        }
        let tap = Tap {
            file,
            name: name.to_owned(),
            created: !existed,
        };
        let hdr_len: libc::c_int = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int from the reference, valid for the call.
        let rc = unsafe { ioctl_with_ref(&tap.file, libc::TUNSETVNETHDRSZ as _, &hdr_len) };
        if rc < 0 {
            return Err(tap.configure_error("TUNSETVNETHDRSZ"));
        }
        // No offloads: the guest is offered none either, so every frame is whole
        // and checksummed.
        // SAFETY: TUNSETOFFLOAD takes its argument by value; no memory is shared.
        let rc = unsafe { ioctl_with_val(&tap.file, libc::TUNSETOFFLOAD as _, 0) };
        if rc < 0 {
            return Err(tap.configure_error("TUNSETOFFLOAD"));
        }
        if tap.created {
            info!(tap = name, "created TAP interface");
            if bring_up {
                tap.set_up()?;
            }
        }
        Ok(tap)
    }

    /// Adopts an fd already attached to a TAP interface (received from another
    /// kemari process during a local migration): checks with TUNGETIFF that it
    /// is a TAP with a virtio-net header, and makes it non-blocking. The
    /// interface stays owned by whoever created it.
    pub fn from_file(file: File) -> Result<Tap, TapError> {
        // SAFETY: ifreq is plain old data for which all-zero bytes are valid.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        // SAFETY: TUNGETIFF fills the ifreq we pass, valid for the call.
        let rc = unsafe { ioctl_with_mut_ref(&file, libc::TUNGETIFF as _, &mut req) };
        if rc < 0 {
            return Err(TapError::Attach {
                name: "(passed fd)".into(),
                hint: "the fd is not attached to a TAP interface",
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: the kernel filled ifru_flags for TUNGETIFF.
        let flags = unsafe { req.ifr_ifru.ifru_flags } as libc::c_int;
        let name: String = req
            .ifr_name
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8 as char)
            .collect();
        if flags & libc::IFF_TAP == 0 || flags & libc::IFF_VNET_HDR == 0 {
            return Err(TapError::Attach {
                name,
                hint: "the fd is not a TAP with a virtio-net header",
                source: io::Error::from_raw_os_error(libc::EINVAL),
            });
        }
        let _ = sys::set_nonblocking(file.as_fd());
        Ok(Tap {
            file,
            name,
            created: false,
        })
    }

    fn configure_error(&self, what: &'static str) -> TapError {
        TapError::Configure {
            name: self.name.clone(),
            what,
            source: io::Error::last_os_error(),
        }
    }

    /// Sets IFF_UP on the interface.
    pub fn set_up(&self) -> Result<(), TapError> {
        let sock = sys::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0).map_err(
            |source| TapError::Configure {
                name: self.name.clone(),
                what: "socket for SIOCSIFFLAGS",
                source,
            },
        )?;
        let mut req = ifreq_with_name(&self.name);
        // SAFETY: SIOCGIFFLAGS fills the ifreq we pass, valid for the call.
        if unsafe { ioctl_with_mut_ref(&sock, libc::SIOCGIFFLAGS as _, &mut req) } < 0 {
            return Err(self.configure_error("SIOCGIFFLAGS"));
        }
        // SAFETY: the kernel filled ifru_flags for SIOCGIFFLAGS: reading that
        // union member is reading what was written.
        let flags = unsafe { req.ifr_ifru.ifru_flags };
        req.ifr_ifru.ifru_flags = flags | libc::IFF_UP as libc::c_short;
        // SAFETY: SIOCSIFFLAGS reads the ifreq we pass, valid for the call.
        if unsafe { ioctl_with_ref(&sock, libc::SIOCSIFFLAGS as _, &req) } < 0 {
            return Err(self.configure_error("SIOCSIFFLAGS"));
        }
        Ok(())
    }

    /// The interface name as the kernel knows it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether [`open`](Self::open) created the interface.
    pub fn created(&self) -> bool {
        self.created
    }

    /// Gives up the TAP queue: returns its fd (to hand over to the next VMM, or
    /// close) and leaves `/dev/null` in its place, so that a device paused for
    /// good stays harmless (reads see end of file, writes are discarded).
    pub fn take_file(&mut self) -> io::Result<File> {
        let null = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open("/dev/null")?;
        Ok(std::mem::replace(&mut self.file, null))
    }

    /// Reads one frame (virtio-net header + Ethernet frame) into `buf`; returns
    /// its length, or `WouldBlock` when none is queued. A frame longer than
    /// `buf` is truncated by the kernel.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&self.file).read(buf)
    }

    /// Writes one frame (virtio-net header + Ethernet frame).
    pub fn write(&self, frame: &[u8]) -> io::Result<usize> {
        (&self.file).write(frame)
    }

    /// The fd to watch for readable frames (register it edge-triggered).
    pub fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A uniquely named TAP interface for a test. Tests that make one carry
    /// `#[cfg_attr(no_tap, ignore = ...)]`: the build script probes for TAP
    /// devices (`kemari-test-probe`), so here one can always be made.
    pub(crate) fn test_tap(tag: &str) -> Tap {
        let name = format!("kt{tag}{}", std::process::id() % 1_000_000);
        let tap = Tap::open(&name, false).unwrap_or_else(|e| panic!("{e}"));
        // Keep the link quiet: no IPv6 autoconfiguration traffic on our TAP.
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1");
        tap.set_up().unwrap();
        tap
    }

    #[test]
    fn names_are_checked() {
        for bad in ["", "0123456789abcdef", "a/b", "a b"] {
            assert!(
                matches!(Tap::open(bad, false), Err(TapError::InvalidName { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    #[cfg_attr(no_tap, ignore = "needs TAP devices (root)")]
    fn open_create_and_reject_non_tap() {
        let tap = test_tap("o");
        assert!(tap.created());
        assert!(interface_exists(tap.name()));
        let mut buf = [0u8; 64];
        // Nothing queued (IPv6 is off): WouldBlock, not a hang.
        let e = loop {
            match tap.read(&mut buf) {
                Ok(_) => continue,
                Err(e) => break e,
            }
        };
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        // "lo" exists and is not a TAP.
        let err = Tap::open("lo", false).unwrap_err();
        assert!(err.to_string().contains("lo"), "{err}");
        let name = tap.name().to_owned();
        drop(tap);
        assert!(!interface_exists(&name), "created TAP is removed on close");
    }
}
