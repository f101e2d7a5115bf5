//! Arbitrary bytes as a VM state file: the decoder must refuse or accept, never
//! panic, and whatever it accepts must survive validation without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::persist::format::decode;

fuzz_target!(|data: &[u8]| {
    if let Ok(state) = decode(data) {
        let _ = state.validate();
    }
});
