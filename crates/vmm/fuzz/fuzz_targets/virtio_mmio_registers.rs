//! The virtio-mmio register file in front of a virtio-blk device: a sequence
//! of guest register accesses (reads, writes of any width, status changes,
//! queue setup, notifications) decoded from the input, with guest memory
//! filled from the input's tail.
#![no_main]

use std::sync::{Arc, Mutex};

use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress};
use vmm::devices::block_backend::MemoryBackend;
use vmm::devices::virtio::block::Block;
use vmm::devices::virtio::mmio::MmioTransport;
use vmm::devices::virtio::VirtioDevice;
use vmm::memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

const MEM_SIZE: usize = 0x1_0000;
/// Each access: offset (2 bytes, le), kind (1 byte), value (4 bytes, le).
const OP_LEN: usize = 7;

fuzz_target!(|data: &[u8]| {
    let Some((&nops, rest)) = data.split_first() else {
        return;
    };
    let ops_len = (usize::from(nops) * OP_LEN).min(rest.len());
    let (ops, memory) = rest.split_at(ops_len);
    let Ok(mem) = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]) else {
        return;
    };
    let n = memory.len().min(MEM_SIZE);
    if mem.write_slice(&memory[..n], GuestAddress(0)).is_err() {
        return;
    }
    let Ok(irq) = EventFd::new(libc_nonblock()) else {
        return;
    };
    let blk = Block::new("fuzz0", Box::new(MemoryBackend::new(64 << 10, false)));
    let dev: Arc<Mutex<dyn VirtioDevice>> = Arc::new(Mutex::new(blk));
    let mut t = MmioTransport::new(dev, mem, irq);
    for op in ops.chunks_exact(OP_LEN) {
        let offset = u64::from(u16::from_le_bytes([op[0], op[1]])) & 0x1ff;
        let kind = op[2];
        let value = [op[3], op[4], op[5], op[6]];
        let width = [1usize, 2, 4, 8][usize::from(kind >> 1) & 3];
        let mut buf = [0u8; 8];
        buf[..4].copy_from_slice(&value);
        if kind & 1 == 0 {
            t.read(offset, &mut buf[..width]);
        } else {
            t.write(offset, &buf[..width]);
        }
    }
    let _ = t.state();
});

fn libc_nonblock() -> i32 {
    // EFD_NONBLOCK, so that a full counter never blocks the fuzzer.
    0o4000
}
