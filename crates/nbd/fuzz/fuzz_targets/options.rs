//! Handshake and option decoders, metadata context requests and replies,
//! block status payloads.
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
    if let Ok(m) = decode_meta_context_request(body) {
        let queries: Vec<&str> = m.queries.iter().map(String::as_str).collect();
        let again = encode_meta_context_request(&m.export, &queries);
        assert_eq!(decode_meta_context_request(&again), Ok(m));
    }
    if let Ok((id, name)) = decode_meta_context_reply(body) {
        assert_eq!(
            decode_meta_context_reply(&encode_meta_context_reply(id, &name)),
            Ok((id, name))
        );
    }
    if let Ok((id, d)) = decode_block_status(body) {
        assert_eq!(
            decode_block_status(&encode_block_status(id, &d)),
            Ok((id, d))
        );
    }
});
