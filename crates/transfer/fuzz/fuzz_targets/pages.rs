//! A page batch from the other end: the decoder and the RAM check must
//! refuse anything malformed, never panic, and never call back for a page
//! past the payload.
#![no_main]

use libfuzzer_sys::fuzz_target;
use transfer::pages::{check_batch, decode_pages, PAGE};

fuzz_target!(|data: &[u8]| {
    let _ = decode_pages(data, |_, page| {
        assert!(page.is_none_or(|p| p.len() == PAGE));
        Ok(())
    });
    let _ = check_batch(1 << 30, data);
});
