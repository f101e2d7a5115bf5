//! Transmission-phase decoders: request headers and reply headers.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nbd_client::protocol::{decode_reply_header, Request};

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = Request::decode(data) {
        assert_eq!(Request::decode(&r.encode()), Ok(r));
    }
    let _ = decode_reply_header(data);
});
