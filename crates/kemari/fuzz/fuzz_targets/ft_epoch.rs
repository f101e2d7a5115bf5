//! The standby's decoders of what a primary sends: control messages, packed
//! epoch states (against a dictionary) and page batches. None may panic or
//! allocate beyond their limits, whatever the bytes.
#![no_main]

use kemari::ft::protocol::{unpack_state, FtMessage};
use kemari::migration::wire::decode_pages;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let split = data.first().map_or(0, |&b| usize::from(b)).min(data.len());
    let (dict, rest) = data.split_at(split);
    let _ = serde_json::from_slice::<FtMessage>(rest);
    let _ = unpack_state(rest, dict);
    let _ = decode_pages(rest, |_, _| Ok(()));
});
