use super::*;
use crate::devices::virtio::{DeviceCounters, QueueProgress, VirtioError};
use crate::memory::{GuestMemoryFile, MemoryBacking};

#[derive(Default)]
struct FakeDevice {
    activated: Option<Vec<(u16, u16)>>,
    acked: u64,
    notified: Vec<usize>,
    resets: usize,
    config: [u8; 8],
}

impl VirtioDevice for FakeDevice {
    fn device_type(&self) -> u32 {
        2
    }
    fn name(&self) -> &str {
        "fake0"
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[16, 8]
    }
    fn features(&self) -> u64 {
        FEATURE_VERSION_1 | FEATURE_EVENT_IDX | 1
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = self.config.get(offset as usize + i).copied().unwrap_or(0);
        }
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            if let Some(c) = self.config.get_mut(offset as usize + i) {
                *c = *b;
            }
        }
    }
    fn activate(&mut self, a: Activation) -> Result<(), VirtioError> {
        self.acked = a.acked_features;
        self.activated = Some(
            a.queues
                .iter()
                .map(|q| (q.next_avail(), q.next_used()))
                .collect(),
        );
        a.interrupt.signal_used_queue();
        Ok(())
    }
    fn is_activated(&self) -> bool {
        self.activated.is_some()
    }
    fn queue_notified(&mut self, index: usize) {
        self.notified.push(index);
    }
    fn reset(&mut self) {
        self.activated = None;
        self.resets += 1;
    }
    fn counters(&self) -> DeviceCounters {
        DeviceCounters::default()
    }
    fn queue_progress(&self) -> Vec<QueueProgress> {
        self.activated
            .as_ref()
            .map(|qs| {
                qs.iter()
                    .map(|&(a, u)| QueueProgress {
                        next_avail: a + 3,
                        next_used: u + 2,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

fn setup() -> (MmioTransport, Arc<Mutex<FakeDevice>>, EventFd) {
    let mem = GuestMemoryFile::create(16 << 20, &MemoryBacking::Memfd)
        .unwrap()
        .map()
        .unwrap();
    let dev = Arc::new(Mutex::new(FakeDevice::default()));
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let t = MmioTransport::new(dev.clone(), mem, irq.try_clone().unwrap());
    (t, dev, irq)
}

fn r(t: &mut MmioTransport, off: u64) -> u32 {
    let mut b = [0u8; 4];
    t.read(off, &mut b);
    u32::from_le_bytes(b)
}

fn w(t: &mut MmioTransport, off: u64, v: u32) {
    t.write(off, &v.to_le_bytes());
}

fn negotiate(t: &mut MmioTransport, features: u64) {
    w(t, reg::STATUS, status::ACKNOWLEDGE);
    w(t, reg::STATUS, status::ACKNOWLEDGE | status::DRIVER);
    w(t, reg::DRIVER_FEATURES_SEL, 0);
    w(t, reg::DRIVER_FEATURES, features as u32);
    w(t, reg::DRIVER_FEATURES_SEL, 1);
    w(t, reg::DRIVER_FEATURES, (features >> 32) as u32);
    w(
        t,
        reg::STATUS,
        status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
    );
}

fn setup_queue(t: &mut MmioTransport, index: u32, base: u64, size: u32) {
    w(t, reg::QUEUE_SEL, index);
    w(t, reg::QUEUE_NUM, size);
    w(t, reg::QUEUE_DESC_LOW, base as u32);
    w(t, reg::QUEUE_DESC_HIGH, (base >> 32) as u32);
    w(t, reg::QUEUE_DRIVER_LOW, (base + 0x1000) as u32);
    w(t, reg::QUEUE_DRIVER_HIGH, 0);
    w(t, reg::QUEUE_DEVICE_LOW, (base + 0x2000) as u32);
    w(t, reg::QUEUE_DEVICE_HIGH, 0);
    w(t, reg::QUEUE_READY, 1);
}

const ALL: u32 = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK;

#[test]
fn identification_registers() {
    let (mut t, _, _) = setup();
    assert_eq!(r(&mut t, reg::MAGIC), 0x7472_6976);
    assert_eq!(r(&mut t, reg::VERSION), 2);
    assert_eq!(r(&mut t, reg::DEVICE_ID), 2);
    assert_eq!(r(&mut t, reg::VENDOR_ID), MMIO_VENDOR_ID);
    w(&mut t, reg::DEVICE_FEATURES_SEL, 1);
    assert_eq!(r(&mut t, reg::DEVICE_FEATURES), 1);
    w(&mut t, reg::DEVICE_FEATURES_SEL, 0);
    assert_eq!(r(&mut t, reg::DEVICE_FEATURES), (1 << 29) | 1);
    w(&mut t, reg::DEVICE_FEATURES_SEL, 7);
    assert_eq!(r(&mut t, reg::DEVICE_FEATURES), 0);
    w(&mut t, reg::QUEUE_SEL, 1);
    assert_eq!(r(&mut t, reg::QUEUE_NUM_MAX), 8);
    w(&mut t, reg::QUEUE_SEL, 2);
    assert_eq!(r(&mut t, reg::QUEUE_NUM_MAX), 0);
    assert_eq!(t.num_queues(), 2);
    assert_eq!(MmioTransport::queue_notify_address_offset(), 0x50);
    // Bad sizes and offsets: zeros, no panic.
    let mut b = [0xffu8; 2];
    t.read(reg::MAGIC, &mut b);
    assert_eq!(b, [0, 0]);
    let mut b = [0xffu8; 4];
    t.read(2, &mut b);
    assert_eq!(b, [0; 4]);
    t.read(0xf8, &mut b);
    t.write(reg::STATUS, &[1, 2]);
    t.write(u64::MAX, &[1]);
    t.read(u64::MAX, &mut b);
    t.read(0x100, &mut []);
    assert_eq!(t.status(), 0);
}

#[test]
fn config_space_any_width() {
    let (mut t, dev, _) = setup();
    t.write(0x102, &[0xaa, 0xbb]);
    let mut b = [0u8; 4];
    t.read(0x100, &mut b);
    assert_eq!(b, [0, 0, 0xaa, 0xbb]);
    assert_eq!(dev.lock().unwrap().config[3], 0xbb);
    let mut b = [0xffu8; 8];
    t.read(0x106, &mut b);
    assert_eq!(b, [0; 8]);
}

#[test]
fn config_reads_do_not_wait_for_a_busy_device() {
    let (mut t, dev, _) = setup();
    let generation = r(&mut t, reg::CONFIG_GENERATION);
    let mut busy = dev.lock().unwrap();
    busy.config[0] = 9;
    t.interrupt.signal_config_change();
    let mut b = [0u8; 1];
    t.read(0x100, &mut b);
    assert_eq!(b, [0], "stale bytes while the device is busy, no deadlock");
    drop(busy);
    t.read(0x100, &mut b);
    assert_eq!(b, [9]);
    assert_ne!(r(&mut t, reg::CONFIG_GENERATION), generation);
    assert_eq!(t.interrupt_status(), INT_CONFIG);
}

#[test]
fn feature_negotiation_requires_version_1() {
    let (mut t, _, _) = setup();
    negotiate(&mut t, 1);
    assert_eq!(t.status() & status::FEATURES_OK, 0);
    w(&mut t, reg::STATUS, 0);
    // Features not offered are refused too.
    negotiate(&mut t, FEATURE_VERSION_1 | 2);
    assert_eq!(t.status() & status::FEATURES_OK, 0);
    w(&mut t, reg::STATUS, 0);
    negotiate(&mut t, FEATURE_VERSION_1 | 1);
    assert_ne!(t.status() & status::FEATURES_OK, 0);
    assert_eq!(t.acked_features(), FEATURE_VERSION_1 | 1);
    // Feature writes after FEATURES_OK are ignored.
    w(&mut t, reg::DRIVER_FEATURES_SEL, 0);
    w(&mut t, reg::DRIVER_FEATURES, 0);
    assert_eq!(t.acked_features(), FEATURE_VERSION_1 | 1);
}

#[test]
fn activation_and_reset() {
    let (mut t, dev, irq) = setup();
    negotiate(&mut t, FEATURE_VERSION_1);
    setup_queue(&mut t, 0, 0x10_0000, 16);
    // Queue 1 missing: activation fails with NEEDS_RESET.
    w(&mut t, reg::STATUS, ALL);
    assert_ne!(t.status() & status::DEVICE_NEEDS_RESET, 0);
    assert!(!dev.lock().unwrap().is_activated());
    assert_eq!(t.interrupt_status() & INT_CONFIG, INT_CONFIG);

    w(&mut t, reg::STATUS, 0);
    assert_eq!(t.status(), 0);
    assert_eq!(t.interrupt_status(), 0);
    assert_eq!(r(&mut t, reg::QUEUE_READY), 0);
    negotiate(&mut t, FEATURE_VERSION_1);
    setup_queue(&mut t, 0, 0x10_0000, 16);
    setup_queue(&mut t, 1, 0x20_0000, 8);
    assert_eq!(r(&mut t, reg::QUEUE_READY), 1);
    let _ = irq.read();
    w(&mut t, reg::STATUS, ALL);
    assert_eq!(t.status(), ALL);
    assert!(dev.lock().unwrap().is_activated());
    // The fake device signals on activation: status bit and irqfd.
    assert_eq!(t.interrupt_status(), INT_USED_RING);
    assert_eq!(irq.read().unwrap(), 1);
    w(&mut t, reg::INTERRUPT_ACK, INT_USED_RING);
    assert_eq!(t.interrupt_status(), 0);
    // Queue registers are frozen once live.
    w(&mut t, reg::QUEUE_SEL, 0);
    w(&mut t, reg::QUEUE_NUM, 4);
    assert_eq!(t.state().queues[0].size, 16);
    // Direct notifications reach the device; unknown queues do not.
    w(&mut t, reg::QUEUE_NOTIFY, 1);
    w(&mut t, reg::QUEUE_NOTIFY, 9);
    assert_eq!(dev.lock().unwrap().notified, vec![1]);
    w(&mut t, reg::STATUS, 0);
    assert!(!dev.lock().unwrap().is_activated());
    assert_eq!(dev.lock().unwrap().resets, 2);
}

#[test]
fn invalid_queue_addresses_need_reset() {
    let (mut t, dev, _) = setup();
    negotiate(&mut t, FEATURE_VERSION_1);
    setup_queue(&mut t, 0, 0x10_0000, 16);
    // Outside the 16 MiB of guest memory.
    setup_queue(&mut t, 1, 0x4000_0000, 8);
    w(&mut t, reg::STATUS, ALL);
    assert_ne!(t.status() & status::DEVICE_NEEDS_RESET, 0);
    assert!(!dev.lock().unwrap().is_activated());
}

#[test]
fn driver_ok_without_features_ok_is_refused() {
    let (mut t, dev, _) = setup();
    w(&mut t, reg::STATUS, status::ACKNOWLEDGE | status::DRIVER);
    w(
        &mut t,
        reg::STATUS,
        status::ACKNOWLEDGE | status::DRIVER | status::DRIVER_OK,
    );
    assert_ne!(t.status() & status::DEVICE_NEEDS_RESET, 0);
    assert!(!dev.lock().unwrap().is_activated());
    // Writing status without echoing NEEDS_RESET keeps it; clearing a
    // driver bit is ignored.
    w(
        &mut t,
        reg::STATUS,
        status::ACKNOWLEDGE | status::DRIVER | status::DRIVER_OK | status::FAILED,
    );
    assert_ne!(t.status() & status::FAILED, 0);
    assert_ne!(t.status() & status::DEVICE_NEEDS_RESET, 0);
    w(&mut t, reg::STATUS, status::ACKNOWLEDGE);
    assert_ne!(t.status() & status::DRIVER, 0);
}

#[test]
fn block_device_end_to_end_through_registers() {
    use crate::devices::block_backend::MemoryBackend;
    use crate::devices::virtio::block::tests::TestRing;
    use crate::devices::virtio::block::{features, Block};
    use vm_memory::{Bytes, GuestAddress};

    let mem = GuestMemoryFile::create(16 << 20, &MemoryBacking::Memfd)
        .unwrap()
        .map()
        .unwrap();
    let blk = Block::new("blk0", Box::new(MemoryBackend::new(1 << 20, false)));
    let dev: Arc<Mutex<dyn VirtioDevice>> = Arc::new(Mutex::new(blk));
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let mut t = MmioTransport::new(dev.clone(), mem.clone(), irq.try_clone().unwrap());
    let mut cap = [0u8; 8];
    t.read(CONFIG_SPACE_OFFSET, &mut cap);
    assert_eq!(u64::from_le_bytes(cap), 2048);
    let mut ring = TestRing::new(&mem, 0x10000, 256);
    negotiate(
        &mut t,
        FEATURE_VERSION_1 | features::EVENT_IDX | features::FLUSH,
    );
    assert_ne!(t.status() & status::FEATURES_OK, 0);
    setup_queue(&mut t, 0, 0x10000, 256);
    w(&mut t, reg::STATUS, ALL);
    assert_eq!(t.status(), ALL);

    // A FLUSH request, notified by a direct QueueNotify write.
    mem.write_obj(4u32, GuestAddress(0x100000)).unwrap();
    mem.write_obj(0u64, GuestAddress(0x100008)).unwrap();
    mem.write_obj(0xffu8, GuestAddress(0x100100)).unwrap();
    ring.add_chain(0, &[(0x100000, 16, false), (0x100100, 1, true)]);
    w(&mut t, reg::QUEUE_NOTIFY, 0);
    assert_eq!(ring.used_idx(), 1);
    assert_eq!(mem.read_obj::<u8>(GuestAddress(0x100100)).unwrap(), 0);
    assert_eq!(irq.read().unwrap(), 1);
    assert_eq!(r(&mut t, reg::INTERRUPT_STATUS), INT_USED_RING);
    w(&mut t, reg::INTERRUPT_ACK, INT_USED_RING);
    assert_eq!(r(&mut t, reg::INTERRUPT_STATUS), 0);
    // EVENT_IDX reached the device's queue: avail_event was published.
    let avail_event: u16 = mem.read_obj(GuestAddress(ring.used + 4 + 8 * 256)).unwrap();
    assert_eq!(avail_event, 1);
    let state = t.state();
    assert_eq!(
        (state.queues[0].next_avail, state.queues[0].next_used),
        (1, 1)
    );
    w(&mut t, reg::STATUS, 0);
    assert!(!dev.lock().unwrap().is_activated());
}

#[test]
fn state_round_trip() {
    let (mut t, dev, _) = setup();
    negotiate(&mut t, FEATURE_VERSION_1 | FEATURE_EVENT_IDX);
    setup_queue(&mut t, 0, 0x10_0000, 16);
    setup_queue(&mut t, 1, 0x20_0000, 4);
    w(&mut t, reg::STATUS, ALL);
    w(&mut t, reg::QUEUE_SEL, 1);
    let state = t.state();
    assert_eq!(state.queues[1].size, 4);
    assert_eq!(
        state.queues[0].next_avail, 3,
        "progress comes from the device"
    );
    assert_eq!(state.queues[1].next_used, 2);
    assert!(state.queues[0].event_idx);
    let json = serde_json::to_string(&state).unwrap();
    let back: MmioTransportState = serde_json::from_str(&json).unwrap();
    assert_eq!(back, state);

    let fresh = Arc::new(Mutex::new(FakeDevice::default()));
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let mut t2 = MmioTransport::restore(
        fresh.clone(),
        t.mem.clone(),
        irq.try_clone().unwrap(),
        &back,
    )
    .unwrap();
    assert_eq!(
        fresh.lock().unwrap().activated,
        Some(vec![(3, 2), (3, 2)]),
        "device re-activated at the saved positions"
    );
    assert_eq!(
        fresh.lock().unwrap().acked,
        FEATURE_VERSION_1 | FEATURE_EVENT_IDX
    );
    assert_eq!(r(&mut t2, reg::QUEUE_NUM_MAX), 8);
    assert_eq!(r(&mut t2, reg::STATUS), ALL);
    // Saving the restored transport gives the same registers (the fake
    // device adds its offsets once more).
    let again = t2.state();
    assert_eq!(again.status, state.status);
    assert_eq!(again.queues[1].desc_table, 0x20_0000);
    drop(dev);

    // State for another device type or queue count is refused.
    let mut wrong = back.clone();
    wrong.device_type = 1;
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let fresh = Arc::new(Mutex::new(FakeDevice::default()));
    assert!(matches!(
        MmioTransport::restore(
            fresh.clone(),
            t.mem.clone(),
            irq.try_clone().unwrap(),
            &wrong
        ),
        Err(MmioError::DeviceType { .. })
    ));
    let mut wrong = back.clone();
    wrong.queues.pop();
    assert!(matches!(
        MmioTransport::restore(
            fresh.clone(),
            t.mem.clone(),
            irq.try_clone().unwrap(),
            &wrong
        ),
        Err(MmioError::QueueCount { .. })
    ));
    let mut wrong = back;
    wrong.queues[0].size = 3;
    assert!(matches!(
        MmioTransport::restore(fresh, t.mem.clone(), irq, &wrong),
        Err(MmioError::InvalidQueue { .. })
    ));
}

#[test]
fn transport_and_devices_can_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<MmioTransport>();
    send::<crate::devices::virtio::block::Block>();
    send::<crate::devices::virtio::net::Net>();
    send::<crate::devices::virtio::tap::Tap>();
}
