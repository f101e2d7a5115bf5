//! The state file: a fixed header (magic, format version, payload length,
//! CRC-32 of the payload) followed by the payload (JSON of [`VmState`]).
//! Anything else — another magic, a newer version, a wrong length or checksum,
//! a payload over the size limit — is refused with a clear error before any of
//! it is used.
//!
//! ```text
//! offset  size  field
//!      0     8  magic "KEMARIVM"
//!      8     4  format version (u32 LE)
//!     12     4  flags (u32 LE, 0)
//!     16     8  payload length (u64 LE)
//!     24     4  CRC-32 (IEEE) of the payload (u32 LE)
//!     28     4  reserved (0)
//!     32     …  payload: VmState as JSON
//! ```

use super::VmState;

/// File magic.
pub const MAGIC: &[u8; 8] = b"KEMARIVM";
/// Current format version.
pub const FORMAT_VERSION: u32 = 1;
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
    #[error("state format version {found} is not supported (this kemari reads version {FORMAT_VERSION})")]
    Version {
        /// Version in the file.
        found: u32,
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

/// Encodes `state` with header and checksum.
pub fn encode(state: &VmState) -> Result<Vec<u8>, FormatError> {
    let payload = serde_json::to_vec(state).map_err(|e| FormatError::Payload(e.to_string()))?;
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Checks and decodes a state file.
pub fn decode(bytes: &[u8]) -> Result<VmState, FormatError> {
    let payload = verify(bytes)?;
    serde_json::from_slice(payload).map_err(|e| FormatError::Payload(e.to_string()))
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
    if version != FORMAT_VERSION {
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
    Ok(payload)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::{MachineConfig, SerialConfig};
    use crate::memory::MemoryBacking;
    use crate::persist::{KvmVmState, MemoryState, SerialStateData, VcpuState};

    pub(crate) fn sample_state() -> VmState {
        let config = MachineConfig {
            vcpus: 1,
            memory_bytes: 64 << 20,
            memory_backing: MemoryBacking::Memfd,
            kernel: "/k".into(),
            initramfs: None,
            cmdline: "counter=1".into(),
            serial: SerialConfig::Null,
            disks: vec![],
            nets: vec![],
        };
        let regs = kvm_bindings::kvm_regs {
            rip: 0x1234_5678,
            ..Default::default()
        };
        VmState {
            kemari_version: "test".into(),
            saved_at_ms: 1,
            config,
            memory: MemoryState {
                size: 64 << 20,
                backing: MemoryBacking::Memfd,
            },
            kvm: KvmVmState {
                irqchips: vec![Default::default(); 3],
                pit: Default::default(),
                clock: Default::default(),
            },
            vcpus: vec![VcpuState {
                index: 0,
                cpuid: vec![],
                regs,
                sregs: Default::default(),
                xsave: Default::default(),
                xcrs: Default::default(),
                lapic: Default::default(),
                events: Default::default(),
                debugregs: Default::default(),
                mp_state: Default::default(),
                msrs: vec![kvm_bindings::kvm_msr_entry {
                    index: 0x10,
                    data: 42,
                    ..Default::default()
                }],
                tsc_khz: Some(2_000_000),
            }],
            serial: SerialStateData::default(),
            virtio: vec![],
        }
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
        b[8] = 2;
        assert!(matches!(decode(&b), Err(FormatError::Version { found: 2 })));
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
        // Valid container, payload not a VmState.
        let payload = b"{\"nope\":1}";
        let mut b = Vec::new();
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        b.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(payload);
        assert!(matches!(decode(&b), Err(FormatError::Payload(_))));
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
