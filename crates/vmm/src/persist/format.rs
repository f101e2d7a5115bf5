//! The state file: a fixed header (magic, format version, payload length,
//! CRC-32 of the payload) followed by the payload.
//! Anything else — another magic, an unknown version, a wrong length or
//! checksum, a payload over the size limit — is refused with a clear error
//! before any of it is used.
//!
//! ```text
//! offset  size  field
//!      0     8  magic "KEMARIVM"
//!      8     4  format version (u32 LE): 3 is written, 1 and 3 are read
//!     12     4  flags (u32 LE, 0)
//!     16     8  payload length (u64 LE)
//!     24     4  CRC-32 (IEEE) of the payload (u32 LE)
//!     28     4  reserved (0)
//!     32     …  payload
//! ```
//!
//! Payload of version 3 (binary; postcard: varint integers, no trailing
//! bytes): a JSON string holding the small, descriptive part (kemari
//! version, save time, configuration, memory), then the in-kernel devices,
//! the vCPUs, the serial port and the virtio devices. KVM's structures are
//! kept as their raw bytes, so encoding one VM's ~12 KB costs a few µs —
//! fault tolerance does it at every sync. Version 1 (read only, the first
//! snapshots) is the whole [`VmState`] as JSON. Version 2 (the same payload
//! in bincode 1, which is unmaintained) is refused with the kemari version
//! that wrote it, read from the payload's first field without decoding the
//! rest: resume such a state with that kemari, then save it again with
//! this one (docs/state.md).

use serde::{Deserialize, Serialize};

use super::{KvmVmState, MemoryState, SerialStateData, VcpuState, VirtioState, VmState};
use crate::config::MachineConfig;

/// File magic.
pub const MAGIC: &[u8; 8] = b"KEMARIVM";
/// Format version written.
pub const FORMAT_VERSION: u32 = 3;
/// The JSON format of the first snapshots, still read.
pub const FORMAT_VERSION_JSON: u32 = 1;
/// The bincode format (kemari until 2026-11-25), no longer read.
pub const FORMAT_VERSION_BINCODE: u32 = 2;
/// Header size.
pub const HEADER_LEN: usize = 32;
/// Largest payload accepted.
pub const MAX_PAYLOAD: u64 = 64 << 20;

/// Why a state file was refused.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// Shorter than the header.
    #[error("state is truncated: {0} bytes, the header alone is {HEADER_LEN}")]
    Truncated(usize),
    /// Not a kemari state file.
    #[error("not a kemari VM state (bad magic)")]
    BadMagic,
    /// Written by an incompatible version.
    #[error("state format version {found} is not supported (this kemari reads versions {FORMAT_VERSION_JSON} and {FORMAT_VERSION})")]
    Version {
        /// Version in the file.
        found: u32,
    },
    /// Written in the retired bincode format (version 2).
    #[error("state format version {FORMAT_VERSION_BINCODE} (bincode), written by kemari {written_by}, is no longer read (this kemari reads versions {FORMAT_VERSION_JSON} and {FORMAT_VERSION}): resume the VM with the kemari build that wrote it (version {written_by}, built before 2026-11-26), then save it again with this one")]
    Retired {
        /// The kemari version named in the payload ("an earlier version"
        /// if the payload does not say).
        written_by: String,
    },
    /// Payload length out of bounds or not matching the data.
    #[error("state payload length {declared} does not match the {actual} bytes present (limit {MAX_PAYLOAD})")]
    Length {
        /// Length in the header.
        declared: u64,
        /// Bytes after the header.
        actual: usize,
    },
    /// Checksum mismatch.
    #[error("state is corrupt: checksum {found:#010x}, expected {expected:#010x}")]
    Checksum {
        /// Checksum of the data.
        found: u32,
        /// Checksum in the header.
        expected: u32,
    },
    /// The payload does not parse.
    #[error("state payload is malformed: {0}")]
    Payload(String),
}

/// The descriptive part of a version-3 payload (JSON: the configuration's
/// enums are tagged, which a binary encoding cannot carry).
#[derive(Serialize)]
struct HeadOut<'a> {
    kemari_version: &'a str,
    saved_at_ms: u64,
    guest_uptime_ms: Option<u64>,
    config: &'a MachineConfig,
    memory: &'a MemoryState,
}

#[derive(Deserialize)]
struct HeadIn {
    kemari_version: String,
    saved_at_ms: u64,
    /// Absent in states written before it was carried; older kemari
    /// builds ignore it (no format change).
    #[serde(default)]
    guest_uptime_ms: Option<u64>,
    config: MachineConfig,
    memory: MemoryState,
}

/// A version-3 payload as written (fields in this order).
#[derive(Serialize)]
struct BinaryOut<'a> {
    head: String,
    kvm: &'a KvmVmState,
    vcpus: &'a [VcpuState],
    serial: &'a SerialStateData,
    virtio: &'a [VirtioState],
}

/// A version-3 payload as read.
#[derive(Deserialize)]
struct BinaryIn {
    head: String,
    kvm: KvmVmState,
    vcpus: Vec<VcpuState>,
    serial: SerialStateData,
    virtio: Vec<VirtioState>,
}

/// Encodes `state` with header and checksum (format version 3).
pub fn encode(state: &VmState) -> Result<Vec<u8>, FormatError> {
    let head = serde_json::to_string(&HeadOut {
        kemari_version: &state.kemari_version,
        saved_at_ms: state.saved_at_ms,
        guest_uptime_ms: state.guest_uptime_ms,
        config: &state.config,
        memory: &state.memory,
    })
    .map_err(|e| FormatError::Payload(e.to_string()))?;
    let body = BinaryOut {
        head,
        kvm: &state.kvm,
        vcpus: &state.vcpus,
        serial: &state.serial,
        virtio: &state.virtio,
    };
    // ~12 KB per vCPU (XSAVE, LAPIC, MSRs), ~2 KB for the rest.
    let mut out = Vec::with_capacity(HEADER_LEN + 2048 + 12_800 * state.vcpus.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes()); // length, below
    out.extend_from_slice(&0u32.to_le_bytes()); // CRC, below
    out.extend_from_slice(&0u32.to_le_bytes());
    let mut out = postcard::serialize_with_flavor(&body, Append(out))
        .map_err(|e| FormatError::Payload(e.to_string()))?;
    let len = (out.len() - HEADER_LEN) as u64;
    if len > MAX_PAYLOAD {
        return Err(FormatError::Length {
            declared: len,
            actual: out.len() - HEADER_LEN,
        });
    }
    out[16..24].copy_from_slice(&len.to_le_bytes());
    let crc = crc32fast::hash(&out[HEADER_LEN..]);
    out[24..28].copy_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// postcard's output into a `Vec` with `extend_from_slice` (its
/// `ExtendFlavor` goes through `Extend`, which may copy KVM's byte arrays
/// a byte at a time).
struct Append(Vec<u8>);

impl postcard::ser_flavors::Flavor for Append {
    type Output = Vec<u8>;

    fn try_push(&mut self, byte: u8) -> postcard::Result<()> {
        self.0.push(byte);
        Ok(())
    }

    fn try_extend(&mut self, bytes: &[u8]) -> postcard::Result<()> {
        self.0.extend_from_slice(bytes);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<Vec<u8>> {
        Ok(self.0)
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Checks and decodes a state file.
pub fn decode(bytes: &[u8]) -> Result<VmState, FormatError> {
    let payload = verify(bytes)?;
    let malformed = |e: &dyn std::fmt::Display| FormatError::Payload(e.to_string());
    if u32_at(bytes, 8) == FORMAT_VERSION_JSON {
        return serde_json::from_slice(payload).map_err(|e| malformed(&e));
    }
    let (body, rest): (BinaryIn, _) =
        postcard::take_from_bytes(payload).map_err(|e| malformed(&e))?;
    if !rest.is_empty() {
        return Err(FormatError::Payload(format!(
            "{} bytes after the state",
            rest.len()
        )));
    }
    let head: HeadIn = serde_json::from_str(&body.head).map_err(|e| malformed(&e))?;
    Ok(VmState {
        kemari_version: head.kemari_version,
        saved_at_ms: head.saved_at_ms,
        guest_uptime_ms: head.guest_uptime_ms,
        config: head.config,
        memory: head.memory,
        kvm: body.kvm,
        vcpus: body.vcpus,
        serial: body.serial,
        virtio: body.virtio,
    })
}

/// Who wrote a version-2 payload: its first field is the JSON head, as a
/// string behind bincode's varint length (one byte below 251; 251 and 252:
/// a u16 or u32 follows, little-endian).
fn bincode_writer(payload: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Writer {
        kemari_version: String,
    }
    let (&first, rest) = payload.split_first()?;
    let (len, rest) = match first {
        0..=250 => (usize::from(first), rest),
        251 => (
            usize::from(u16::from_le_bytes(rest.get(..2)?.try_into().ok()?)),
            rest.get(2..)?,
        ),
        252 => (
            u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize,
            rest.get(4..)?,
        ),
        _ => return None,
    };
    let head: Writer = serde_json::from_slice(rest.get(..len)?).ok()?;
    Some(head.kemari_version).filter(|v| !v.is_empty())
}

/// Checks the header, length and checksum without parsing the payload (cheap:
/// a fault-tolerance standby checks every epoch's state this way and parses
/// only the one it fails over to). Returns the payload.
pub fn verify(bytes: &[u8]) -> Result<&[u8], FormatError> {
    if bytes.len() < HEADER_LEN {
        return Err(FormatError::Truncated(bytes.len()));
    }
    if &bytes[..8] != MAGIC {
        return Err(FormatError::BadMagic);
    }
    let version = u32_at(bytes, 8);
    if version != FORMAT_VERSION
        && version != FORMAT_VERSION_JSON
        && version != FORMAT_VERSION_BINCODE
    {
        return Err(FormatError::Version { found: version });
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&bytes[16..24]);
    let declared = u64::from_le_bytes(len);
    let payload = &bytes[HEADER_LEN..];
    if declared > MAX_PAYLOAD || declared != payload.len() as u64 {
        return Err(FormatError::Length {
            declared,
            actual: payload.len(),
        });
    }
    let expected = u32_at(bytes, 24);
    let found = crc32fast::hash(payload);
    if found != expected {
        return Err(FormatError::Checksum { found, expected });
    }
    if version == FORMAT_VERSION_BINCODE {
        return Err(FormatError::Retired {
            written_by: bincode_writer(payload).unwrap_or_else(|| "an earlier version".into()),
        });
    }
    Ok(payload)
}

/// A state of one vCPU and no device, for [`warm_up`].
fn placeholder() -> VmState {
    use crate::config::SerialConfig;
    use crate::memory::MemoryBacking;
    VmState {
        kemari_version: String::new(),
        saved_at_ms: 0,
        guest_uptime_ms: None,
        config: MachineConfig {
            vcpus: 1,
            memory_bytes: 1 << 20,
            memory_backing: MemoryBacking::Memfd,
            kernel: "/".into(),
            initramfs: None,
            cmdline: String::new(),
            serial: SerialConfig::Null,
            disks: vec![],
            nets: vec![],
            pmem: Vec::new(),
            id: None,
            name: None,
        },
        memory: MemoryState {
            size: 1 << 20,
            backing: MemoryBacking::Memfd,
        },
        kvm: KvmVmState {
            irqchips: vec![Default::default(); 3],
            pit: Default::default(),
            clock: Default::default(),
        },
        vcpus: vec![VcpuState {
            index: 0,
            cpuid: vec![Default::default(); 8],
            regs: Default::default(),
            sregs: Default::default(),
            xsave: Default::default(),
            xcrs: Default::default(),
            lapic: Default::default(),
            events: Default::default(),
            debugregs: Default::default(),
            mp_state: Default::default(),
            msrs: vec![Default::default(); 8],
            tsc_khz: None,
        }],
        serial: SerialStateData::default(),
        virtio: vec![],
    }
}

/// Encodes and decodes a placeholder state once: the first encode or decode
/// of a process costs ~50 µs here against ~10 after, and a migration's only
/// ones are inside the guest's pause. Sources and destinations call this
/// while they wait.
pub fn warm_up() {
    if let Ok(bytes) = encode(&placeholder()) {
        let _ = decode(&bytes);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The warm-up placeholder, with values a round trip must keep.
    pub(crate) fn sample_state() -> VmState {
        let mut state = placeholder();
        state.kemari_version = "test".into();
        state.saved_at_ms = 1;
        state.config.memory_bytes = 64 << 20;
        state.config.kernel = "/k".into();
        state.config.cmdline = "counter=1".into();
        state.memory.size = 64 << 20;
        let vcpu = &mut state.vcpus[0];
        vcpu.cpuid = vec![];
        vcpu.regs.rip = 0x1234_5678;
        vcpu.msrs = vec![kvm_bindings::kvm_msr_entry {
            index: 0x10,
            data: 42,
            ..Default::default()
        }];
        vcpu.tsc_khz = Some(2_000_000);
        state
    }

    #[test]
    fn the_warm_up_placeholder_survives_a_round_trip() {
        // Otherwise warm_up would stop short of the decoder it warms.
        let back = decode(&encode(&placeholder()).unwrap()).unwrap();
        assert_eq!(back.vcpus.len(), 1);
        assert_eq!(back.kvm.irqchips.len(), 3);
        warm_up();
    }

    #[test]
    fn round_trip() {
        let bytes = encode(&sample_state()).unwrap();
        let back = decode(&bytes).unwrap();
        assert_eq!(back.vcpus[0].regs.rip, 0x1234_5678);
        assert_eq!(back.vcpus[0].msrs[0].data, 42);
        assert!(back.validate().is_ok());
    }

    #[test]
    fn refuses_damage() {
        let good = encode(&sample_state()).unwrap();
        assert!(matches!(
            decode(&good[..10]),
            Err(FormatError::Truncated(10))
        ));
        let mut b = good.clone();
        b[0] = b'X';
        assert!(matches!(decode(&b), Err(FormatError::BadMagic)));
        let mut b = good.clone();
        b[8] = 4;
        assert!(matches!(decode(&b), Err(FormatError::Version { found: 4 })));
        assert!(matches!(
            decode(&good[..good.len() - 1]),
            Err(FormatError::Length { .. })
        ));
        let mut b = good.clone();
        let last = b.len() - 1;
        b[last] ^= 1;
        assert!(matches!(decode(&b), Err(FormatError::Checksum { .. })));
        // A huge declared length is refused before anything is allocated.
        let mut b = good.clone();
        b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(decode(&b), Err(FormatError::Length { .. })));
        // Valid containers, payloads not a VmState, in either format.
        for version in [FORMAT_VERSION_JSON, FORMAT_VERSION] {
            let b = container(version, b"{\"nope\":1}");
            assert!(matches!(decode(&b), Err(FormatError::Payload(_))));
        }
        // A binary payload with a huge sequence length: refused, not allocated.
        let mut payload = vec![0u8]; // empty head string
        payload.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]);
        let b = container(FORMAT_VERSION, &payload);
        assert!(matches!(decode(&b), Err(FormatError::Payload(_))));
        // Trailing bytes after a valid payload.
        let mut b = good.clone();
        b.push(0);
        let payload = b[HEADER_LEN..].to_vec();
        assert!(matches!(
            decode(&container(FORMAT_VERSION, &payload)),
            Err(FormatError::Payload(_))
        ));
    }

    fn container(version: u32, payload: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&version.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        b.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(payload);
        b
    }

    #[test]
    fn refuses_the_bincode_format_of_version_2_naming_its_writer() {
        // A version-2 payload starts with the JSON head behind bincode's
        // varint length; the rest is not looked at.
        let head = br#"{"kemari_version":"0.1.0-old","saved_at_ms":1,"config":{}}"#;
        for (name, long) in [("short", false), ("long", true)] {
            let mut payload = Vec::new();
            if long {
                let padded = [&head[..head.len() - 1], &[b' '; 300][..], b"}"].concat();
                payload.push(251);
                payload.extend_from_slice(&(padded.len() as u16).to_le_bytes());
                payload.extend_from_slice(&padded);
            } else {
                payload.push(head.len() as u8);
                payload.extend_from_slice(head);
            }
            payload.extend_from_slice(&[0xfd; 64]);
            let err = decode(&container(FORMAT_VERSION_BINCODE, &payload)).unwrap_err();
            assert!(
                matches!(&err, FormatError::Retired { written_by } if written_by == "0.1.0-old"),
                "{name}: {err:?}"
            );
            let text = err.to_string();
            assert!(text.contains("version 2"), "{text}");
            assert!(text.contains("written by kemari 0.1.0-old"), "{text}");
            assert!(
                text.contains(
                    "resume the VM with the kemari build that wrote it (version 0.1.0-old"
                ),
                "{text}"
            );
        }
        // A payload that does not name its writer still gets the advice.
        let err = decode(&container(FORMAT_VERSION_BINCODE, &[7, 1, 2])).unwrap_err();
        assert!(
            err.to_string()
                .contains("written by kemari an earlier version"),
            "{err}"
        );
        // The checksum still comes first: a damaged old file is "corrupt".
        let mut b = container(FORMAT_VERSION_BINCODE, &[7, 1, 2]);
        b[HEADER_LEN] ^= 1;
        assert!(matches!(decode(&b), Err(FormatError::Checksum { .. })));
    }

    #[test]
    fn refuses_a_real_version_2_file() {
        // Written by kemari at commit fb18863 (`kemarictl snapshot`, the
        // test guest, 128M): bincode's varint head as it really was.
        let old = include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/state-v2.bin"
        ));
        let err = decode(old).unwrap_err();
        assert!(
            matches!(&err, FormatError::Retired { written_by } if written_by == "0.1.0"),
            "{err:?}"
        );
    }

    #[test]
    fn reads_the_json_format_of_version_1() {
        let state = sample_state();
        let b = container(FORMAT_VERSION_JSON, &serde_json::to_vec(&state).unwrap());
        let back = decode(&b).unwrap();
        assert_eq!(back.vcpus[0].regs.rip, 0x1234_5678);
        assert_eq!(back.config, state.config);
    }

    #[test]
    fn the_guest_uptime_travels_and_a_state_without_it_still_reads() {
        let mut state = sample_state();
        state.guest_uptime_ms = Some(86_400_123);
        let back = decode(&encode(&state).unwrap()).unwrap();
        assert_eq!(back.guest_uptime_ms, Some(86_400_123));
        // A head written before the field existed.
        let mut head = serde_json::to_value(HeadOut {
            kemari_version: "0.1.0",
            saved_at_ms: 1,
            guest_uptime_ms: Some(5),
            config: &state.config,
            memory: &state.memory,
        })
        .unwrap();
        head.as_object_mut().unwrap().remove("guest_uptime_ms");
        let old: HeadIn = serde_json::from_value(head).unwrap();
        assert_eq!(old.guest_uptime_ms, None);
    }

    #[test]
    fn binary_round_trip_keeps_every_part() {
        let mut state = sample_state();
        state.vcpus[0].lapic.regs[0x20] = 7;
        state.vcpus[0].xsave.region[3] = 0xdead_beef;
        state.kvm.clock.clock = 123_456;
        state.serial.in_buffer = vec![1, 2, 3];
        let bytes = encode(&state).unwrap();
        let back = decode(&bytes).unwrap();
        assert_eq!(back.kemari_version, state.kemari_version);
        assert_eq!(back.config, state.config);
        assert_eq!(back.memory, state.memory);
        assert_eq!(back.vcpus[0].lapic.regs[0x20], 7);
        assert_eq!(back.vcpus[0].xsave.region[3], 0xdead_beef);
        assert_eq!(back.kvm.clock.clock, 123_456);
        assert_eq!(back.serial, state.serial);
        // The same state encodes to the same bytes (fault tolerance sends
        // deltas against the previous encoding).
        assert_eq!(encode(&back).unwrap()[28..], bytes[28..]);
    }

    #[test]
    fn validation_catches_inconsistent_state() {
        let mut s = sample_state();
        s.memory.size = 128 << 20;
        assert!(s.validate().is_err());
        let mut s = sample_state();
        s.vcpus.clear();
        assert!(s.validate().is_err());
        let mut s = sample_state();
        s.kvm.irqchips.pop();
        assert!(s.validate().is_err());
    }
}
