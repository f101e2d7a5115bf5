//! virtio-net frame gathering (transmit) and scattering (receive) on chains
//! built from the input.
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;
use virtio_queue::QueueT;
use vmm::devices::virtio::block::request::RawDesc;
use vmm::devices::virtio::net::{gather_tx_frame, scatter_rx_frame};

fuzz_target!(|data: &[u8]| {
    let Some(mut s) = common::setup(data) else {
        return;
    };
    let mut buf = Vec::new();
    let mut frame = vec![0xa5u8; 60 + usize::from(s.flags)];
    let mut rounds = 0;
    while let Some(chain) = s.queue.pop_descriptor_chain(&s.mem) {
        rounds += 1;
        if rounds > 512 {
            break;
        }
        let head = chain.head_index();
        let tx = gather_tx_frame(&s.mem, chain.clone().map(RawDesc::from), &mut buf);
        if let Ok(len) = tx {
            assert_eq!(len, buf.len());
            frame = buf.clone();
        }
        let _ = scatter_rx_frame(&s.mem, chain.map(RawDesc::from), &frame);
        let _ = s.queue.add_used(&s.mem, head, 0);
    }
});
