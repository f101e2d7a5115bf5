//! Arbitrary bytes as a VM state file: the decoder must refuse or accept, never
//! panic, and whatever it accepts must survive validation without panicking.
//! Half the inputs are taken as a payload and wrapped in a valid header (the
//! first byte picks the format version), so the payload decoders are reached
//! past the checksum. The same bytes go to the memory image's index decoder,
//! as they are and (first byte & 4) as extents behind a valid header and
//! trailer, so that its extent checks are reached past its checksum.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::persist::format::{
    decode, FORMAT_VERSION, FORMAT_VERSION_BINCODE, FORMAT_VERSION_JSON, MAGIC,
};
use vmm::persist::image_index;

/// A memory image index of 1 GiB of memory whose extents are `entries`.
fn index(entries: &[u8]) -> Vec<u8> {
    let entries = &entries[..entries.len() / 16 * 16];
    let mut b = Vec::with_capacity(36 + entries.len());
    b.extend_from_slice(image_index::MAGIC);
    b.extend_from_slice(&image_index::VERSION.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&(1u64 << 30).to_le_bytes());
    b.extend_from_slice(&((entries.len() / 16) as u64).to_le_bytes());
    b.extend_from_slice(entries);
    let crc = crc32fast::hash(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

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
            let version = match (pick & 2 == 2, pick & 8 == 8) {
                (true, _) => FORMAT_VERSION,
                (false, false) => FORMAT_VERSION_JSON,
                (false, true) => FORMAT_VERSION_BINCODE,
            };
            wrapped = container(version, payload);
            &wrapped[..]
        }
        _ => data,
    };
    if let Ok(state) = decode(input) {
        let _ = state.validate();
    }
    let _ = image_index::decode(data, 1 << 30);
    if let Some((&pick, entries)) = data.split_first() {
        if pick & 4 == 4 {
            let _ = image_index::decode(&index(entries), 1 << 30);
        }
    }
});
