//! Handshake and option decoders.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nbd_client::protocol::*;

fuzz_target!(|data: &[u8]| {
    let _ = decode_handshake(data);
    if let Ok(h) = decode_option_header(data) {
        assert!(h.len <= MAX_OPTION_LEN);
    }
    let body = data.get(16..).unwrap_or(&[]);
    let _ = decode_info_request(body);
    let _ = decode_export_name(body);
    let _ = decode_name_prefixed(body, "fuzz");
    let _ = decode_option_reply_header(data, 1 << 20);
    let _ = decode_info(body);
    if let Ok(c) = AccessCounts::decode(body) {
        assert_eq!(AccessCounts::decode(&c.encode()), Ok(c));
    }
});
