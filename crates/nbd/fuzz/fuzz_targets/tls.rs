//! TLS negotiation: the server's TLS-PSK handshake (OpenSSL, with our
//! identity lookup) on arbitrary client bytes, and the `--tls-psk` file
//! parser on arbitrary text.
#![no_main]
use std::sync::OnceLock;

use kemari_nbd::tls::{PskKeys, TlsServer};
use libfuzzer_sys::fuzz_target;

fn server() -> &'static TlsServer {
    static S: OnceLock<TlsServer> = OnceLock::new();
    S.get_or_init(|| {
        let keys = PskKeys::parse("fuzz:00112233445566778899aabbccddeeff").expect("keys");
        TlsServer::with_psk(keys).expect("TLS context")
    })
}

fuzz_target!(|data: &[u8]| {
    let _ = server().handshake_on_bytes(data);
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(keys) = PskKeys::parse(text) {
            let _ = keys.get(b"fuzz");
        }
    }
});
