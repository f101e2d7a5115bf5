//! A whole server session (handshake, options, pipelined requests) fed
//! arbitrary client bytes over an in-memory stream. The first byte picks
//! the valid prefix (none, or structured replies and GO, with
//! `base:allocation` selected or not) and the TLS policy (off, on, require:
//! the options refused before STARTTLS); its top bit picks the export: 64 KiB
//! in memory, or a 1 MiB file, whose large reads are answered from the page
//! cache on the connection's thread.
#![no_main]
use std::sync::{Arc, OnceLock};

use kemari_nbd::backend::{FileBackend, MemBackend};
use kemari_nbd::server::{run_session_on_bytes, Exports, ServerConfig, Tls, TlsMode};
use kemari_nbd::tls::{PskKeys, TlsServer};
use libfuzzer_sys::fuzz_target;
use nbd_client::protocol::*;

/// The same exports under TLS off, on and require.
fn configs() -> &'static [ServerConfig; 3] {
    static C: OnceLock<[ServerConfig; 3]> = OnceLock::new();
    C.get_or_init(|| {
        let mut e = Exports::new();
        e.add("a", Arc::new(MemBackend::new(1 << 16, false)));
        e.add("ro", Arc::new(MemBackend::new(4096, true)));
        let path = std::env::temp_dir().join(format!("knbd-fuzz-{}", std::process::id()));
        let f = std::fs::File::create(&path).expect("fuzz image");
        f.set_len(1 << 20).expect("fuzz image size");
        e.add(
            "f",
            Arc::new(FileBackend::open(&path, false).expect("fuzz image")),
        );
        let _ = std::fs::remove_file(&path);
        let keys = PskKeys::parse("fuzz:00112233445566778899aabbccddeeff").expect("keys");
        let server = Arc::new(TlsServer::with_psk(keys).expect("TLS context"));
        [TlsMode::Off, TlsMode::On, TlsMode::Require].map(|mode| ServerConfig {
            exports: e.clone(),
            tls: Tls::new(mode, Some(server.clone())).expect("TLS set-up"),
            allow: Default::default(),
        })
    })
}

fuzz_target!(|data: &[u8]| {
    let first = data.first().copied().unwrap_or(0);
    // Start from a valid prefix half of the time so requests get exercised.
    let mut input = Vec::new();
    let export = if first & 0x80 != 0 { "f" } else { "a" };
    if first & 1 == 1 {
        input.extend_from_slice(&CLIENT_FIXED_NEWSTYLE.to_be_bytes());
        input.extend(encode_option(OPT_STRUCTURED_REPLY, &[]));
        if first & 2 == 2 {
            input.extend(encode_option(
                OPT_SET_META_CONTEXT,
                &encode_meta_context_request(export, &[META_BASE_ALLOCATION]),
            ));
        }
        input.extend(encode_option(OPT_GO, &encode_info_request(export, &[])));
    }
    input.extend_from_slice(data);
    let config = &configs()[usize::from(first >> 2) % 3];
    let _ = run_session_on_bytes(&input, config);
});
