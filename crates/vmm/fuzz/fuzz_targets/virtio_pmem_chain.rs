//! The virtio-pmem request parser on chains popped from a queue and guest
//! memory built from the input (the device's window needs a KVM VM, so the
//! flush itself is not run here).
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;
use virtio_queue::QueueT;
use vmm::devices::virtio::block::request::RawDesc;
use vmm::devices::virtio::pmem::parse_request;

fuzz_target!(|data: &[u8]| {
    let Some(mut s) = common::setup(data) else { return };
    let mut popped = 0;
    while let Some(chain) = s.queue.pop_descriptor_chain(&s.mem) {
        let head = chain.head_index();
        let _ = parse_request(&s.mem, chain.map(RawDesc::from));
        let _ = s.queue.add_used(&s.mem, head, 4);
        popped += 1;
        if popped > 64 + usize::from(s.flags) * 2 {
            break;
        }
    }
});
