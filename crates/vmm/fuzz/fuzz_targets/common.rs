//! Guest memory and a split virtqueue built from fuzz input.
//!
//! Input layout: byte 0 = flags for the target, byte 1 = queue size selector,
//! the rest is copied to guest address 0, where the descriptor table starts
//! (size * 16 bytes) followed by the available ring. The used ring lives at
//! USED, outside the input's reach unless the input is long; buffers may point
//! anywhere (in or out of the 64 KiB of guest memory).

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm::memory::GuestMemoryMmap;

pub const MEM_SIZE: usize = 0x1_0000;
pub const USED: u64 = 0x8000;

pub struct Setup {
    pub mem: GuestMemoryMmap,
    pub queue: Queue,
    pub flags: u8,
}

pub fn setup(data: &[u8]) -> Option<Setup> {
    let (&flags, rest) = data.split_first()?;
    let (&size_sel, body) = rest.split_first()?;
    let size = 1u16 << (size_sel % 9);
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).ok()?;
    let n = body.len().min(MEM_SIZE);
    mem.write_slice(&body[..n], GuestAddress(0)).ok()?;
    let avail = u64::from(size) * 16;
    let mut queue = Queue::new(256).ok()?;
    queue.set_size(size);
    queue.set_desc_table_address(Some(0), Some(0));
    queue.set_avail_ring_address(Some(avail as u32), Some(0));
    queue.set_used_ring_address(Some(USED as u32), Some(0));
    queue.set_ready(true);
    queue.set_event_idx(flags & 1 != 0);
    Some(Setup { mem, queue, flags })
}

#[allow(dead_code)] // used by some targets only
pub struct NoInterrupt;

impl vmm::devices::virtio::VirtioInterrupt for NoInterrupt {
    fn signal_used_queue(&self) {}
    fn signal_config_change(&self) {}
}
