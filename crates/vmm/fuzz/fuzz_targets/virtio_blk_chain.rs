//! The virtio-blk request path (chain parsing and execution against an
//! in-memory disk) on a queue and guest memory built from the input.
#![no_main]

mod common;

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use vmm::devices::block_backend::MemoryBackend;
use vmm::devices::virtio::block::{features, Block};
use vmm::devices::virtio::{Activation, VirtioDevice, FEATURE_VERSION_1};

fuzz_target!(|data: &[u8]| {
    let Some(s) = common::setup(data) else { return };
    // 32 KiB .. 256 KiB disk, read-only if flag bit 1.
    let disk = MemoryBackend::new(32 * 1024 * (1 + u64::from(s.flags >> 5)), s.flags & 2 != 0);
    let mut blk = Block::new("fuzz0", Box::new(disk));
    let mut acked = FEATURE_VERSION_1 | (blk.features() & !features::EVENT_IDX);
    if s.flags & 1 != 0 {
        acked |= features::EVENT_IDX;
    }
    if blk
        .activate(Activation {
            mem: s.mem.clone(),
            queues: vec![s.queue],
            interrupt: Arc::new(common::NoInterrupt),
            acked_features: acked,
        })
        .is_err()
    {
        return;
    }
    // The event loop's path: serve the batch the gate saw, then the rest.
    if let Some(p) = blk.pending_outputs() {
        blk.serve_outputs_until(p.limit);
    }
    // Requests may have rewritten the rings (reads into guest memory): go again.
    blk.queue_notified(0);
    let _ = blk.counters();
});
