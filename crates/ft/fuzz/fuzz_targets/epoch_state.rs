//! A packed epoch state from a primary, against a dictionary (the previous
//! epoch's state): unpacking must refuse oversized or malformed input
//! without panicking or allocating beyond its limit.
#![no_main]

use ft::epoch::unpack_state;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let split = data.first().map_or(0, |&b| usize::from(b)).min(data.len());
    let (dict, rest) = data.split_at(split);
    let _ = unpack_state(rest, dict);
});
