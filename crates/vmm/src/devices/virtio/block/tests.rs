use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::request::types;
use super::*;
use crate::devices::block_backend::{MemoryBackend, RawFileBackend};
use crate::devices::virtio::VirtioInterrupt;
use crate::memory::{GuestMemoryFile, MemoryBacking};

pub(crate) const F_NEXT: u16 = 1;
pub(crate) const F_WRITE: u16 = 2;

/// A split virtqueue laid out by hand in guest memory, playing the driver.
pub(crate) struct TestRing {
    pub mem: GuestMemoryMmap,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub size: u16,
    avail_idx: u16,
}

impl TestRing {
    pub fn new(mem: &GuestMemoryMmap, base: u64, size: u16) -> Self {
        let r = TestRing {
            mem: mem.clone(),
            desc: base,
            avail: base + 16 * u64::from(size),
            used: base + 16 * u64::from(size) + 0x1000,
            size,
            avail_idx: 0,
        };
        for a in [r.avail, r.used] {
            mem.write_slice(&[0u8; 8], GuestAddress(a)).unwrap();
        }
        r
    }

    pub fn queue(&self) -> Queue {
        let mut q = Queue::new(self.size).unwrap();
        q.set_size(self.size);
        q.set_desc_table_address(Some(self.desc as u32), Some((self.desc >> 32) as u32));
        q.set_avail_ring_address(Some(self.avail as u32), Some((self.avail >> 32) as u32));
        q.set_used_ring_address(Some(self.used as u32), Some((self.used >> 32) as u32));
        q.set_ready(true);
        q
    }

    pub fn set_desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let a = GuestAddress(self.desc + 16 * u64::from(i));
        self.mem.write_obj(addr, a).unwrap();
        self.mem.write_obj(len, GuestAddress(a.0 + 8)).unwrap();
        self.mem.write_obj(flags, GuestAddress(a.0 + 12)).unwrap();
        self.mem.write_obj(next, GuestAddress(a.0 + 14)).unwrap();
    }

    /// Writes a chain at descriptor indices first.. and makes it available.
    pub fn add_chain(&mut self, first: u16, descs: &[(u64, u32, bool)]) {
        for (k, &(addr, len, write)) in descs.iter().enumerate() {
            let i = first + k as u16;
            let mut flags = if write { F_WRITE } else { 0 };
            if k + 1 < descs.len() {
                flags |= F_NEXT;
            }
            self.set_desc(i, addr, len, flags, i + 1);
        }
        self.push_avail(first);
    }

    pub fn push_avail(&mut self, head: u16) {
        let slot = self.avail + 4 + 2 * u64::from(self.avail_idx % self.size);
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(self.avail_idx, GuestAddress(self.avail + 2))
            .unwrap();
    }

    /// Forces the avail index (to corrupt it).
    pub fn set_avail_idx(&mut self, idx: u16) {
        self.avail_idx = idx;
        self.mem
            .write_obj(idx, GuestAddress(self.avail + 2))
            .unwrap();
    }

    pub fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(self.used + 2)).unwrap()
    }

    /// (id, len) of used entry `i`.
    pub fn used_elem(&self, i: u16) -> (u32, u32) {
        let a = self.used + 4 + 8 * u64::from(i % self.size);
        (
            self.mem.read_obj(GuestAddress(a)).unwrap(),
            self.mem.read_obj(GuestAddress(a + 4)).unwrap(),
        )
    }
}

#[derive(Default)]
pub(crate) struct CountingInterrupt {
    pub used: AtomicUsize,
}

impl VirtioInterrupt for CountingInterrupt {
    fn signal_used_queue(&self) {
        self.used.fetch_add(1, Ordering::SeqCst);
    }
    fn signal_config_change(&self) {}
}

pub(crate) fn guest_memory() -> GuestMemoryMmap {
    GuestMemoryFile::create(16 << 20, &MemoryBacking::Memfd)
        .unwrap()
        .map()
        .unwrap()
}

fn temp_image(tag: &str, size: u64) -> PathBuf {
    let path = std::env::temp_dir().join(format!("kemari-blk-{tag}-{}.img", std::process::id()));
    std::fs::File::create(&path).unwrap().set_len(size).unwrap();
    path
}

struct Fixture {
    blk: Block,
    ring: TestRing,
    irq: Arc<CountingInterrupt>,
}

fn fixture(backend: Box<dyn BlockBackend>, features: u64) -> Fixture {
    let mem = guest_memory();
    let ring = TestRing::new(&mem, 0x10000, QUEUE_SIZE);
    let mut blk = Block::new("blk0", backend);
    let irq = Arc::new(CountingInterrupt::default());
    let mut q = ring.queue();
    q.set_event_idx(features & features::EVENT_IDX != 0);
    blk.activate(Activation {
        mem,
        queues: vec![q],
        interrupt: irq.clone(),
        acked_features: features,
    })
    .unwrap();
    Fixture { blk, ring, irq }
}

const HDR: u64 = 0x100000;
const DATA: u64 = 0x200000;
const STATUS: u64 = 0x300000;

impl Fixture {
    fn header(&self, t: u32, sector: u64) {
        let m = &self.ring.mem;
        m.write_obj(t, GuestAddress(HDR)).unwrap();
        m.write_obj(0u32, GuestAddress(HDR + 4)).unwrap();
        m.write_obj(sector, GuestAddress(HDR + 8)).unwrap();
        m.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    }

    fn status(&self) -> u8 {
        self.ring.mem.read_obj(GuestAddress(STATUS)).unwrap()
    }

    /// Submits one request and returns (status, used len).
    fn submit(&mut self, t: u32, sector: u64, data: Option<(u32, bool)>) -> (u8, u32) {
        self.header(t, sector);
        let mut descs = vec![(HDR, 16, false)];
        if let Some((len, write)) = data {
            descs.push((DATA, len, write));
        }
        descs.push((STATUS, 1, true));
        let n = self.ring.used_idx();
        self.ring.add_chain(0, &descs);
        self.blk.queue_notified(0);
        assert_eq!(self.ring.used_idx(), n.wrapping_add(1), "request completed");
        (self.status(), self.ring.used_elem(n).1)
    }
}

#[test]
fn read_write_flush_round_trip_on_raw_file() {
    let path = temp_image("rt", 1 << 20);
    let backend = RawFileBackend::open(&path, false).unwrap();
    let mut f = fixture(Box::new(backend), FEATURE_VERSION_1);
    assert_ne!(f.blk.features() & features::FLUSH, 0);
    assert_ne!(f.blk.features() & features::DISCARD, 0);
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    f.ring
        .mem
        .write_slice(&pattern, GuestAddress(DATA))
        .unwrap();
    assert_eq!(
        f.submit(types::OUT, 8, Some((4096, false))),
        (status::OK, 1)
    );
    assert_eq!(f.submit(types::FLUSH, 0, None), (status::OK, 1));
    f.ring
        .mem
        .write_slice(&[0u8; 4096], GuestAddress(DATA))
        .unwrap();
    assert_eq!(
        f.submit(types::IN, 8, Some((4096, true))),
        (status::OK, 4097)
    );
    let mut back = vec![0u8; 4096];
    f.ring
        .mem
        .read_slice(&mut back, GuestAddress(DATA))
        .unwrap();
    assert_eq!(back, pattern);
    // The file holds the data at sector 8.
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(&on_disk[4096..8192], &pattern[..]);
    let c = f.blk.counters();
    assert_eq!(
        (c.requests, c.bytes_in, c.bytes_out, c.errors),
        (3, 4096, 4096, 0)
    );
    assert!(f.irq.used.load(Ordering::SeqCst) >= 3);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn get_id_discard_write_zeroes_and_unsupported() {
    let mut f = fixture(
        Box::new(MemoryBackend::new(1 << 20, false)),
        FEATURE_VERSION_1,
    );
    assert_eq!(
        f.submit(types::GET_ID, 0, Some((20, true))),
        (status::OK, 21)
    );
    let mut id = [0u8; 20];
    f.ring.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id[..5], b"blk0\0");

    f.ring
        .mem
        .write_slice(&[0xaa; 1024], GuestAddress(DATA))
        .unwrap();
    assert_eq!(
        f.submit(types::OUT, 0, Some((1024, false))),
        (status::OK, 1)
    );
    // Zero sector 1 only.
    let m = &f.ring.mem;
    m.write_obj(1u64, GuestAddress(DATA)).unwrap();
    m.write_obj(1u32, GuestAddress(DATA + 8)).unwrap();
    m.write_obj(0u32, GuestAddress(DATA + 12)).unwrap();
    assert_eq!(
        f.submit(types::WRITE_ZEROES, 0, Some((16, false))),
        (status::OK, 1)
    );
    assert_eq!(
        f.submit(types::IN, 0, Some((1024, true))),
        (status::OK, 1025)
    );
    let mut back = [0u8; 1024];
    f.ring
        .mem
        .read_slice(&mut back, GuestAddress(DATA))
        .unwrap();
    assert!(back[..512].iter().all(|&b| b == 0xaa));
    assert!(back[512..].iter().all(|&b| b == 0));
    // Discard with the unmap flag is not allowed.
    let m = &f.ring.mem;
    m.write_obj(0u64, GuestAddress(DATA)).unwrap();
    m.write_obj(1u32, GuestAddress(DATA + 8)).unwrap();
    m.write_obj(1u32, GuestAddress(DATA + 12)).unwrap();
    assert_eq!(
        f.submit(types::DISCARD, 0, Some((16, false))).0,
        status::UNSUPP
    );
    assert_eq!(f.submit(77, 0, None).0, status::UNSUPP);
}

#[test]
fn output_batches_stop_where_the_gate_looked() {
    let mut f = fixture(
        Box::new(MemoryBackend::new(1 << 20, false)),
        FEATURE_VERSION_1 | features::EVENT_IDX,
    );
    assert_eq!(f.blk.output_queue(), Some(0));
    assert_eq!(f.blk.pending_outputs(), None);
    f.header(types::FLUSH, 0);
    for head in [0u16, 2, 4] {
        f.ring
            .add_chain(head, &[(HDR, 16, false), (STATUS, 1, true)]);
    }
    let batch = f.blk.pending_outputs().expect("three requests wait");
    assert_eq!((batch.limit, batch.requests), (3, 3));
    // Published after the gate looked: not part of the batch.
    f.ring.add_chain(6, &[(HDR, 16, false), (STATUS, 1, true)]);
    assert_eq!(f.blk.serve_outputs_until(batch.limit), 3);
    assert_eq!(f.ring.used_idx(), 3);
    let rest = f.blk.pending_outputs().expect("the fourth waits");
    assert_eq!((rest.limit, rest.requests), (4, 1));
    assert_eq!(f.blk.serve_outputs_until(rest.limit), 1);
    assert_eq!(f.ring.used_idx(), 4);
    assert_eq!(f.blk.pending_outputs(), None);
    assert_eq!(f.blk.counters().requests, 4);
}

#[test]
fn queue_views_show_requests_the_device_has_not_taken() {
    let mut f = fixture(
        Box::new(MemoryBackend::new(1 << 20, false)),
        FEATURE_VERSION_1 | features::EVENT_IDX,
    );
    let view = |f: &Fixture| f.blk.queue_views()[0];
    assert_eq!(view(&f).waiting, 0);
    f.header(types::FLUSH, 0);
    for head in [0u16, 2] {
        f.ring
            .add_chain(head, &[(HDR, 16, false), (STATUS, 1, true)]);
    }
    let v = view(&f);
    assert_eq!(
        (v.next_avail, v.next_used, v.avail_idx, v.waiting),
        (0, 0, Some(2), 2)
    );
    f.blk.serve_outputs_until(1);
    let v = view(&f);
    assert_eq!((v.next_avail, v.next_used, v.waiting), (1, 1, 1));
    f.blk.reset();
    assert!(f.blk.queue_views().is_empty(), "no queues once reset");
}

#[test]
fn read_only_disk_refuses_writes_with_ioerr() {
    let path = temp_image("ro", 64 << 10);
    let backend = RawFileBackend::open(&path, true).unwrap();
    let mut f = fixture(Box::new(backend), FEATURE_VERSION_1);
    assert_ne!(f.blk.features() & features::RO, 0);
    assert_eq!(
        f.blk.features() & (features::DISCARD | features::WRITE_ZEROES),
        0
    );
    assert_eq!(
        f.submit(types::OUT, 0, Some((512, false))),
        (status::IOERR, 1)
    );
    assert_eq!(f.submit(types::IN, 0, Some((512, true))).0, status::OK);
    assert_eq!(
        f.submit(types::WRITE_ZEROES, 0, Some((16, false))).0,
        status::UNSUPP
    );
    assert_eq!(f.blk.counters().errors, 2);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn config_space() {
    let f = fixture(
        Box::new(MemoryBackend::new(3 << 20, false)),
        FEATURE_VERSION_1,
    );
    let mut cap = [0u8; 8];
    f.blk.read_config(0, &mut cap);
    assert_eq!(u64::from_le_bytes(cap), (3 << 20) / 512);
    let mut w = [0u8; 4];
    f.blk.read_config(20, &mut w);
    assert_eq!(u32::from_le_bytes(w), 512);
    f.blk.read_config(12, &mut w);
    assert_eq!(u32::from_le_bytes(w), SEG_MAX);
    f.blk.read_config(58, &mut w);
    assert_eq!(w, [0; 4]);
    f.blk.read_config(u64::MAX, &mut w);
    assert_eq!(w, [0; 4]);
}

#[test]
fn malformed_chains_are_rejected_without_panic() {
    let mut f = fixture(
        Box::new(MemoryBackend::new(1 << 20, false)),
        FEATURE_VERSION_1,
    );
    // Beyond capacity.
    assert_eq!(
        f.submit(types::IN, (1 << 20) / 512, Some((512, true))),
        (status::IOERR, 1)
    );
    // Wrong direction: a write whose data is device-writable.
    assert_eq!(
        f.submit(types::OUT, 0, Some((512, true))),
        (status::IOERR, 1)
    );
    // Data outside guest memory.
    f.header(types::IN, 0);
    f.ring.add_chain(
        0,
        &[(HDR, 16, false), (1 << 40, 512, true), (STATUS, 1, true)],
    );
    f.blk.queue_notified(0);
    assert_eq!(f.status(), status::IOERR);
    // A loop: 0 -> 1 -> 0 ... is cut by the queue size and returned with len 0.
    f.ring.set_desc(0, HDR, 16, F_NEXT, 1);
    f.ring.set_desc(1, STATUS, 1, F_WRITE | F_NEXT, 0);
    let n = f.ring.used_idx();
    f.ring.push_avail(0);
    f.blk.queue_notified(0);
    assert_eq!(f.ring.used_elem(n), (0, 0));
    // Next index outside the table.
    f.ring.set_desc(0, HDR, 16, F_NEXT, 999);
    let n = f.ring.used_idx();
    f.ring.push_avail(0);
    f.blk.queue_notified(0);
    assert_eq!(f.ring.used_elem(n), (0, 0));
    // As long as the queue: 255 chained readable descriptors, then the status.
    for i in 0..QUEUE_SIZE {
        if i == QUEUE_SIZE - 1 {
            f.ring.set_desc(i, STATUS, 1, F_WRITE, 0);
        } else {
            f.ring.set_desc(i, HDR, 16, F_NEXT, i + 1);
        }
    }
    f.header(types::IN, 0);
    f.ring.push_avail(0);
    f.blk.queue_notified(0);
    assert_eq!(f.status(), status::IOERR, "readable data on a read");
    // Head index outside the table: consumed, but it cannot be returned.
    let n = f.ring.used_idx();
    f.ring.push_avail(QUEUE_SIZE + 5);
    f.blk.queue_notified(0);
    assert_eq!(f.ring.used_idx(), n);
    f.ring.push_avail(QUEUE_SIZE + 5);
    f.blk.queue_notified(0);
    let c = f.blk.counters();
    assert!(c.bad_descriptors >= 8, "{c:?}");
    assert_eq!(c.bytes_in + c.bytes_out, 0);
    // A corrupt avail index stops processing and does not spin.
    f.ring.set_avail_idx(f.ring.used_idx().wrapping_add(1000));
    f.blk.queue_notified(0);
}

#[test]
fn corrupt_avail_index_with_event_idx_does_not_spin() {
    let mut f = fixture(
        Box::new(MemoryBackend::new(1 << 20, false)),
        FEATURE_VERSION_1 | features::EVENT_IDX,
    );
    assert_eq!(f.submit(types::IN, 0, Some((512, true))).0, status::OK);
    f.ring.set_avail_idx(5000);
    f.blk.queue_notified(0);
}

#[test]
fn event_idx_writes_avail_event() {
    let mut f = fixture(
        Box::new(MemoryBackend::new(1 << 20, false)),
        FEATURE_VERSION_1 | features::EVENT_IDX,
    );
    assert_eq!(f.submit(types::IN, 0, Some((512, true))).0, status::OK);
    assert_eq!(f.submit(types::IN, 0, Some((512, true))).0, status::OK);
    // avail_event (after the used ring) tells the driver to kick at index 2.
    let avail_event: u16 = f
        .ring
        .mem
        .read_obj(GuestAddress(f.ring.used + 4 + 8 * u64::from(QUEUE_SIZE)))
        .unwrap();
    assert_eq!(avail_event, 2);
    assert_eq!(f.blk.queue_progress()[0].next_avail, 2);
}

/// 1 MiB of a pattern that differs from 4 KiB block to block and within each.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i / 4096 * 7 + i % 251) as u8).collect()
}

#[test]
fn block_reads_into_guest_memory_are_dirty_tracked() {
    // Each way a read reaches guest memory: a backend's buffer and a copy
    // (memory disk), `pread` straight into it (file), the warm cache's
    // copy out of its store (a hit) and out of its fill (a miss).
    let path = temp_image("dirty-read", 1 << 20);
    std::fs::write(&path, pattern(1 << 20)).unwrap();
    let mut mem_disk = MemoryBackend::new(1 << 20, false);
    mem_disk.write_at(0, &pattern(1 << 20)).unwrap();
    let cached = crate::devices::cached_backend::CachedBackend::new(
        Box::new(RawFileBackend::open(&path, false).unwrap()),
        "dirty-read",
        1 << 20,
    )
    .unwrap();
    let backends: Vec<(&str, Box<dyn BlockBackend>)> = vec![
        ("memory", Box::new(mem_disk)),
        (
            "file",
            Box::new(RawFileBackend::open(&path, false).unwrap()),
        ),
        ("cache", Box::new(cached)),
    ];
    for (name, backend) in backends {
        let mut f = fixture(backend, FEATURE_VERSION_1);
        // The cache: the first pass misses, the second hits.
        for pass in 0..2 {
            f.ring
                .mem
                .write_slice(&[0u8; 12288], GuestAddress(DATA))
                .unwrap();
            crate::memory::set_vmm_dirty_tracking(&f.ring.mem, true);
            let _ = crate::memory::harvest_vmm_dirty(&f.ring.mem);
            // Sector 9: not block aligned, three pages of guest memory.
            assert_eq!(f.submit(types::IN, 9, Some((8192, true))).0, status::OK);
            let dirty = crate::memory::harvest_vmm_dirty(&f.ring.mem);
            for pfn in [
                DATA >> 12,
                (DATA >> 12) + 1,
                STATUS >> 12,
                f.ring.used >> 12,
            ] {
                assert!(
                    dirty.contains(&pfn),
                    "{name} pass {pass}: pfn {pfn:#x} not in {dirty:x?}"
                );
            }
            let mut back = vec![0u8; 8192];
            f.ring
                .mem
                .read_slice(&mut back, GuestAddress(DATA))
                .unwrap();
            assert!(
                back == pattern(1 << 20)[9 * 512..9 * 512 + 8192],
                "{name} pass {pass}: wrong data"
            );
        }
        if let Some(c) = f.blk.counters().cache {
            assert_eq!((c.misses, c.hits), (3, 3), "{name}: {c:?}");
        }
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn reset_and_unactivated_notifications() {
    let mut f = fixture(
        Box::new(MemoryBackend::new(1 << 20, false)),
        FEATURE_VERSION_1,
    );
    f.blk.reset();
    assert!(!f.blk.is_activated());
    f.blk.queue_notified(0);
    f.blk.queue_notified(7);
    assert!(f.blk.queue_progress().is_empty());
}
