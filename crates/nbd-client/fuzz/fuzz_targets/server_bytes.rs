//! What a server sends the client: the handshake on arbitrary bytes, then
//! arbitrary structured reply chunks of one read.
#![no_main]
use std::io::{Read, Write};

use libfuzzer_sys::fuzz_target;
use nbd_client::client::negotiate;
use nbd_client::read_reply::ReplyAssembly;

/// The server's side of a connection: reads come from the input, writes
/// go nowhere.
struct Server<'a>(&'a [u8]);

impl Read for Server<'_> {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(b)
    }
}

impl Write for Server<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    // [handshake length u16][handshake][read offset u16][read length u16]
    // then chunks [type u16][length u16][payload].
    let Some((head, rest)) = data.split_first_chunk::<2>() else {
        return;
    };
    let split = (u16::from_le_bytes(*head) as usize).min(rest.len());
    let (handshake, mut rest) = rest.split_at(split);
    if let Ok(info) = negotiate(&mut Server(handshake), "fuzz") {
        assert!(info.max_payload >= 512);
    }
    let Some((read, chunks)) = rest.split_first_chunk::<4>() else {
        return;
    };
    rest = chunks;
    let offset = u64::from(u16::from_le_bytes([read[0], read[1]]));
    let len = u16::from_le_bytes([read[2], read[3]]) as usize;
    let mut reply = ReplyAssembly::new(offset, len);
    while let Some((h, tail)) = rest.split_first_chunk::<4>() {
        let ty = u16::from_le_bytes([h[0], h[1]]);
        let n = (u16::from_le_bytes([h[2], h[3]]) as usize).min(tail.len());
        let (payload, tail) = tail.split_at(n);
        rest = tail;
        if reply.chunk(ty, payload).is_err() {
            return;
        }
    }
    if let Ok(d) = reply.finish() {
        assert_eq!(d.len(), len);
    }
});
