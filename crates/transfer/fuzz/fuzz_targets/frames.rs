//! Bytes from a hand-over peer after the handshake: the frame reader (local
//! channel, no tags) and the message decoder must refuse, never panic or
//! allocate past their limits.
#![no_main]

use libfuzzer_sys::fuzz_target;
use transfer::channel::Channel;
use transfer::message::Message;

fuzz_target!(|data: &[u8]| {
    let _ = serde_json::from_slice::<Message>(data);
    let mut ch = Channel::over_stream_for_fuzzing(data);
    let mut buf = Vec::new();
    while ch.recv(&mut buf).is_ok() {}
});
