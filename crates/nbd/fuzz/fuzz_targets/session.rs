//! A whole server session (handshake, options, pipelined requests) fed
//! arbitrary client bytes over an in-memory stream.
#![no_main]
use std::sync::{Arc, OnceLock};

use kemari_nbd::backend::MemBackend;
use kemari_nbd::server::{run_session_on_bytes, Exports};
use libfuzzer_sys::fuzz_target;

fn exports() -> &'static Exports {
    static E: OnceLock<Exports> = OnceLock::new();
    E.get_or_init(|| {
        let mut e = Exports::new();
        e.add("a", Arc::new(MemBackend::new(1 << 16, false)));
        e.add("ro", Arc::new(MemBackend::new(4096, true)));
        e
    })
}

fuzz_target!(|data: &[u8]| {
    // Start from a valid prefix half of the time so requests get exercised.
    let mut input = Vec::new();
    if data.first().is_some_and(|b| b & 1 == 1) {
        input.extend_from_slice(&1u32.to_be_bytes());
        input.extend(nbd_client::protocol::encode_option(8, &[]));
        input.extend(nbd_client::protocol::encode_option(
            7,
            &nbd_client::protocol::encode_info_request("a", &[]),
        ));
    }
    input.extend_from_slice(data);
    let _ = run_session_on_bytes(&input, exports());
});
