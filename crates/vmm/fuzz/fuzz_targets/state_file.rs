//! Arbitrary bytes as a VM state file: the decoder must refuse or accept, never
//! panic, and whatever it accepts must survive validation without panicking.
//! Half the inputs are taken as a payload and wrapped in a valid header (the
//! first byte picks the format version), so the payload decoders are reached
//! past the checksum.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::persist::format::{decode, FORMAT_VERSION, FORMAT_VERSION_JSON, MAGIC};

fn container(version: u32, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(32 + payload.len());
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    b.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(payload);
    b
}

fuzz_target!(|data: &[u8]| {
    let wrapped;
    let input = match data.split_first() {
        Some((&pick, payload)) if pick & 1 == 1 => {
            let version = if pick & 2 == 2 { FORMAT_VERSION } else { FORMAT_VERSION_JSON };
            wrapped = container(version, payload);
            &wrapped[..]
        }
        _ => data,
    };
    if let Ok(state) = decode(input) {
        let _ = state.validate();
    }
});
