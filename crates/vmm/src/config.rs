//! What a machine is made of: plain, serde-friendly configuration, from a config
//! file or from the command line. Validation happens here, before any resource
//! is created, so a bad configuration is a clear error and nothing else.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::layout;
use crate::memory::MemoryBacking;

/// Errors in a machine configuration.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// vCPU count out of range.
    #[error("vcpus must be between 1 and {max}, got {got}")]
    Vcpus {
        /// Requested count.
        got: u32,
        /// Largest allowed.
        max: u32,
    },
    /// Memory size unparsable or out of range.
    #[error("memory {value}: {reason}")]
    Memory {
        /// The size as written (or, from a saved configuration, in the
        /// largest unit that divides it).
        value: String,
        /// What is wrong with it.
        reason: SizeError,
    },
    /// Too many virtio devices.
    #[error("at most {max} disks, network and pmem devices in all, got {got}")]
    TooManyDevices {
        /// Requested.
        got: usize,
        /// Largest allowed.
        max: usize,
    },
    /// A MAC address that does not parse.
    #[error("invalid MAC address {0:?} (expected six hex bytes like 52:54:00:12:34:56)")]
    Mac(String),
    /// A device option that does not parse.
    #[error("invalid {kind} option {value:?}: {reason}")]
    DeviceOption {
        /// "disk" or "net".
        kind: &'static str,
        /// The option text.
        value: String,
        /// What is wrong.
        reason: String,
    },
}

/// What is wrong with a guest memory size.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum SizeError {
    /// Not a number with an optional unit.
    #[error("not a size: write it like 256M or 4G (16M to 1T, a multiple of 2M)")]
    Unparsable,
    /// Below the minimum.
    #[error("must be at least 16M (try 16M)")]
    TooSmall,
    /// Above the maximum.
    #[error("must be at most 1T")]
    TooLarge,
    /// Not a whole number of 2 MiB pages.
    #[error("must be a multiple of 2M (try {suggestion})")]
    NotMultiple {
        /// The next size that is.
        suggestion: String,
    },
}

/// The alignment of guest memory sizes (a huge page).
const MEMORY_ALIGN: u64 = 2 << 20;

/// `bytes` in the largest unit that divides it exactly: `256M`, `4G`, `3000K`.
pub fn format_size(bytes: u64) -> String {
    for (shift, unit) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if bytes != 0 && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// Checks a guest memory size: 16 MiB to 1 TiB, a multiple of 2 MiB.
pub fn check_memory_size(bytes: u64) -> Result<(), SizeError> {
    if bytes < layout::MIN_MEMORY {
        return Err(SizeError::TooSmall);
    }
    if bytes > layout::MAX_MEMORY {
        return Err(SizeError::TooLarge);
    }
    if !bytes.is_multiple_of(MEMORY_ALIGN) {
        let next = bytes.div_ceil(MEMORY_ALIGN) * MEMORY_ALIGN;
        return Err(SizeError::NotMultiple {
            suggestion: format_size(next),
        });
    }
    Ok(())
}

/// Parses and checks a guest memory size as the user wrote it (`256M`,
/// `4GiB`, a byte count).
pub fn parse_memory_size(text: &str) -> Result<u64, SizeError> {
    let bytes = parse_size(text).map_err(|_| SizeError::Unparsable)?;
    check_memory_size(bytes)?;
    Ok(bytes)
}

/// Most vCPUs a machine may have.
pub const MAX_VCPUS: u8 = 8;

/// Where the serial console goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SerialConfig {
    /// Discard.
    Null,
    /// Standard output.
    #[default]
    Stdout,
    /// Append to a file.
    File(PathBuf),
    /// Serve on a Unix socket.
    Socket(PathBuf),
}

/// A virtio-blk disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskConfig {
    /// Raw image file.
    pub path: PathBuf,
    /// Refuse guest writes (they complete with an I/O error).
    #[serde(default)]
    pub read_only: bool,
    /// Size of the disk's warm read cache in bytes (NBD disks only; off
    /// when absent): see `devices::cached_backend`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_bytes: Option<u64>,
}

/// Smallest warm disk cache (`cache=`): one 2 MiB run of blocks.
pub const MIN_DISK_CACHE: u64 = 2 << 20;

/// A virtio-pmem device (docs/warm-cache.md, "virtio-pmem"): a file or
/// block device mapped into guest-physical memory, which a Linux guest
/// sees as /dev/pmemN and can mount with `-o dax`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PmemConfig {
    /// The file or block device (its size a non-zero multiple of 2 MiB).
    pub path: PathBuf,
}

/// A virtio-net device on a TAP interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetConfig {
    /// TAP interface name (opened if it exists, created otherwise).
    pub tap: String,
    /// Guest MAC address; derived from the TAP name if absent.
    #[serde(default)]
    pub mac: Option<String>,
}

impl NetConfig {
    /// The MAC address the guest sees: the configured one, or one derived
    /// from the TAP name.
    pub fn mac_address(&self) -> [u8; 6] {
        self.mac
            .as_deref()
            .and_then(|m| parse_mac(m).ok())
            .unwrap_or_else(|| default_mac(&self.tap))
    }
}

/// Everything needed to build a machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineConfig {
    /// Number of vCPUs.
    #[serde(default = "default_vcpus")]
    pub vcpus: u8,
    /// Guest memory in bytes.
    pub memory_bytes: u64,
    /// Where guest memory lives.
    #[serde(default)]
    pub memory_backing: MemoryBacking,
    /// Kernel image (PVH ELF).
    pub kernel: PathBuf,
    /// Optional initramfs.
    #[serde(default)]
    pub initramfs: Option<PathBuf>,
    /// Kernel command line (device parameters are appended).
    #[serde(default)]
    pub cmdline: String,
    /// Serial console.
    #[serde(default)]
    pub serial: SerialConfig,
    /// Disks, in order (the guest sees them in this order).
    #[serde(default)]
    pub disks: Vec<DiskConfig>,
    /// Network devices, in order.
    #[serde(default)]
    pub nets: Vec<NetConfig>,
    /// virtio-pmem devices, in order (after the disks and network devices).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pmem: Vec<PmemConfig>,
    /// The VM's id (kemari gives one at first boot), kept wherever the VM
    /// is restored, migrated or failed over; absent in older states.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The VM's name, a label (kept like the id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

fn default_vcpus() -> u8 {
    1
}

impl MachineConfig {
    /// Checks ranges and formats.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            return Err(ConfigError::Vcpus {
                got: u32::from(self.vcpus),
                max: u32::from(MAX_VCPUS),
            });
        }
        check_memory_size(self.memory_bytes).map_err(|reason| ConfigError::Memory {
            value: format_size(self.memory_bytes),
            reason,
        })?;
        let devices = self.disks.len() + self.nets.len() + self.pmem.len();
        if devices > layout::VIRTIO_MAX_DEVICES {
            return Err(ConfigError::TooManyDevices {
                got: devices,
                max: layout::VIRTIO_MAX_DEVICES,
            });
        }
        for n in &self.nets {
            if let Some(mac) = &n.mac {
                parse_mac(mac)?;
            }
        }
        for d in &self.disks {
            let Some(cache) = d.cache_bytes else { continue };
            let path = d.path.to_string_lossy();
            let reason = if !crate::devices::block_backend::is_nbd_url(&path) {
                "cache= is for NBD disks (nbd://…); an image file is cached by the host's page cache"
            } else if cache < MIN_DISK_CACHE {
                "cache= must be at least 2M"
            } else {
                continue;
            };
            return Err(ConfigError::DeviceOption {
                kind: "disk",
                value: format!("{path},cache={}", format_size(cache)),
                reason: reason.into(),
            });
        }
        Ok(())
    }
}

impl MachineConfig {
    /// Writes each network device's MAC into the configuration (the one
    /// derived from its TAP name where none was given). The MAC is part of
    /// what the guest sees, so it travels with the saved configuration: a
    /// restored, migrated, failed-over or successor VM keeps it whatever
    /// its TAP is called there, and announces it.
    pub fn pin_macs(&mut self) {
        for n in &mut self.nets {
            n.mac = Some(format_mac(n.mac_address()));
        }
    }
}

/// Parses a size like `256M`, `4G`, `512MiB` or a byte count.
pub fn parse_size(s: &str) -> Result<u64, ConfigError> {
    let t = s.trim();
    let bad = || ConfigError::Memory {
        value: s.to_owned(),
        reason: SizeError::Unparsable,
    };
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num.parse().map_err(|_| bad())?;
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift).ok_or_else(bad)
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Result<[u8; 6], ConfigError> {
    let parts: Vec<_> = s.split(':').collect();
    if parts.len() != 6 {
        return Err(ConfigError::Mac(s.to_owned()));
    }
    let mut mac = [0u8; 6];
    for (b, p) in mac.iter_mut().zip(parts) {
        if p.len() != 2 {
            return Err(ConfigError::Mac(s.to_owned()));
        }
        *b = u8::from_str_radix(p, 16).map_err(|_| ConfigError::Mac(s.to_owned()))?;
    }
    Ok(mac)
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// A stable, locally administered MAC derived from a TAP name.
pub fn default_mac(tap: &str) -> [u8; 6] {
    // FNV-1a over the name: stable across runs and processes.
    let mut h: u32 = 0x811c_9dc5;
    for b in tap.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    let b = h.to_be_bytes();
    [0x52, 0x54, b[0], b[1], b[2], b[3]]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> MachineConfig {
        MachineConfig {
            vcpus: 1,
            memory_bytes: 256 << 20,
            memory_backing: MemoryBacking::Memfd,
            kernel: "k".into(),
            initramfs: None,
            cmdline: String::new(),
            serial: SerialConfig::Stdout,
            disks: vec![],
            nets: vec![],
            pmem: Vec::new(),
            id: None,
            name: None,
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("256M").unwrap(), 256 << 20);
        assert_eq!(parse_size("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_size("1048576").unwrap(), 1 << 20);
        for bad in ["", "M", "12Q", "-1G", "99999999999999999999G", "1.5G"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn memory_sizes_are_checked_with_a_suggestion() {
        assert_eq!(parse_memory_size("256M"), Ok(256 << 20));
        assert_eq!(
            parse_memory_size("255M"),
            Err(SizeError::NotMultiple {
                suggestion: "256M".into()
            })
        );
        assert_eq!(
            parse_memory_size("3073M").unwrap_err().to_string(),
            "must be a multiple of 2M (try 3074M)"
        );
        assert_eq!(parse_memory_size("8M"), Err(SizeError::TooSmall));
        assert_eq!(parse_memory_size("2T"), Err(SizeError::TooLarge));
        assert_eq!(parse_memory_size("lots"), Err(SizeError::Unparsable));
        assert_eq!(format_size(4 << 30), "4G");
        assert_eq!(format_size(3 << 10), "3K");
        assert_eq!(format_size(1000), "1000");
    }

    #[test]
    fn macs() {
        assert_eq!(
            parse_mac("52:54:00:ab:cd:EF").unwrap(),
            [0x52, 0x54, 0, 0xab, 0xcd, 0xef]
        );
        for bad in [
            "52:54:00:ab:cd",
            "52:54:00:ab:cd:ef:01",
            "5:54:00:ab:cd:ef",
            "zz:54:00:ab:cd:ef",
        ] {
            assert!(parse_mac(bad).is_err(), "{bad}");
        }
        assert_eq!(default_mac("tap0"), default_mac("tap0"));
        assert_ne!(default_mac("tap0"), default_mac("tap1"));
        assert_eq!(default_mac("tap0")[0] & 1, 0, "unicast");
        assert_eq!(
            parse_mac(&format_mac(default_mac("tap0"))).unwrap(),
            default_mac("tap0")
        );
    }

    #[test]
    fn pinned_macs_survive_a_tap_rename() {
        let mut c = base();
        c.nets = vec![
            NetConfig {
                tap: "tap-a".into(),
                mac: None,
            },
            NetConfig {
                tap: "tap-b".into(),
                mac: Some("52:54:00:00:00:09".into()),
            },
        ];
        c.pin_macs();
        let derived = format_mac(default_mac("tap-a"));
        assert_eq!(c.nets[0].mac.as_deref(), Some(derived.as_str()));
        assert_eq!(c.nets[1].mac.as_deref(), Some("52:54:00:00:00:09"));
        c.nets[0].tap = "tap-elsewhere".into();
        assert_eq!(c.nets[0].mac_address(), default_mac("tap-a"));
    }

    #[test]
    fn a_disk_cache_is_for_nbd_disks_and_at_least_2m() {
        let with = |path: &str, cache: u64| MachineConfig {
            disks: vec![DiskConfig {
                path: path.into(),
                read_only: false,
                cache_bytes: Some(cache),
            }],
            ..base()
        };
        assert!(with("nbd://h/d", 512 << 20).validate().is_ok());
        let err = with("/a.img", 512 << 20)
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("cache= is for NBD disks"), "{err}");
        let err = with("nbd://h/d", 1 << 20)
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("at least 2M"), "{err}");
        // Absent from saved configurations that have none (older kemari).
        let mut none = with("nbd://h/d", 0).disks.remove(0);
        none.cache_bytes = None;
        assert!(!serde_json::to_string(&none).unwrap().contains("cache"));
        let d: DiskConfig = serde_json::from_str(r#"{"path":"/a"}"#).unwrap();
        assert_eq!(d.cache_bytes, None);
    }

    #[test]
    fn validation() {
        assert!(base().validate().is_ok());
        let mut c = base();
        c.vcpus = 0;
        assert!(matches!(c.validate(), Err(ConfigError::Vcpus { .. })));
        c.vcpus = 9;
        assert!(c.validate().is_err());
        let mut c = base();
        c.memory_bytes = 8 << 20;
        assert!(matches!(c.validate(), Err(ConfigError::Memory { .. })));
        c.memory_bytes = 255 << 20;
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "memory 255M: must be a multiple of 2M (try 256M)"
        );
        let mut c = base();
        c.nets = vec![NetConfig {
            tap: "t".into(),
            mac: Some("nope".into()),
        }];
        assert!(matches!(c.validate(), Err(ConfigError::Mac(_))));
    }

    #[test]
    fn json_round_trip_and_unknown_fields() {
        let c = base();
        let s = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<MachineConfig>(&s).unwrap(), c);
        assert!(serde_json::from_str::<MachineConfig>(
            r#"{"memory_bytes":1,"kernel":"k","bogus":1}"#
        )
        .is_err());
    }
}
