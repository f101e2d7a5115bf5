//! The virtio-mmio v2 register block of one device.

use core::ptr::{read_volatile, write_volatile};

use super::{status, VirtioError, F_VERSION_1};

const MAGIC: u32 = 0x7472_6976; // "virt"

mod reg {
    pub const MAGIC: usize = 0x000;
    pub const VERSION: usize = 0x004;
    pub const DEVICE_ID: usize = 0x008;
    pub const DEVICE_FEATURES: usize = 0x010;
    pub const DEVICE_FEATURES_SEL: usize = 0x014;
    pub const DRIVER_FEATURES: usize = 0x020;
    pub const DRIVER_FEATURES_SEL: usize = 0x024;
    pub const QUEUE_SEL: usize = 0x030;
    pub const QUEUE_NUM_MAX: usize = 0x034;
    pub const QUEUE_NUM: usize = 0x038;
    pub const QUEUE_READY: usize = 0x044;
    pub const QUEUE_NOTIFY: usize = 0x050;
    pub const STATUS: usize = 0x070;
    pub const QUEUE_DESC_LOW: usize = 0x080;
    pub const QUEUE_DESC_HIGH: usize = 0x084;
    pub const QUEUE_DRIVER_LOW: usize = 0x090;
    pub const QUEUE_DRIVER_HIGH: usize = 0x094;
    pub const QUEUE_DEVICE_LOW: usize = 0x0a0;
    pub const QUEUE_DEVICE_HIGH: usize = 0x0a4;
    pub const CONFIG: usize = 0x100;
}

/// What a probe found at a `virtio_mmio.device=` address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// No virtio device (bad magic).
    NotVirtio(u32),
    /// A legacy (version 1) transport: not supported.
    Legacy,
    /// An empty slot (device ID 0).
    Empty,
    /// A modern device with this device ID (1 = net, 2 = block).
    Device(u32),
}

pub struct MmioTransport {
    base: usize,
}

impl MmioTransport {
    /// # Safety
    /// `base` must be the address of a virtio-mmio register block (or of
    /// unbacked MMIO space) inside the identity-mapped 4 GiB, owned by this
    /// transport alone.
    pub unsafe fn new(base: u64) -> Self {
        Self {
            base: base as usize,
        }
    }

    pub fn base(&self) -> u64 {
        self.base as u64
    }

    pub fn read(&self, offset: usize) -> u32 {
        // SAFETY: per `new`, base + offset is a device register (offsets
        // are the spec's, below 0x200) and nothing else aliases it.
        unsafe { read_volatile((self.base + offset) as *const u32) }
    }

    pub fn write(&self, offset: usize, value: u32) {
        // SAFETY: as in `read`.
        unsafe { write_volatile((self.base + offset) as *mut u32, value) }
    }

    pub fn probe(&self) -> Probe {
        let magic = self.read(reg::MAGIC);
        if magic != MAGIC {
            return Probe::NotVirtio(magic);
        }
        if self.read(reg::VERSION) != 2 {
            return Probe::Legacy;
        }
        match self.read(reg::DEVICE_ID) {
            0 => Probe::Empty,
            id => Probe::Device(id),
        }
    }

    /// Resets the device and negotiates features: VERSION_1 plus those of
    /// `wanted` the device offers. Returns the accepted set.
    pub fn negotiate(&self, wanted: u64) -> Result<u64, VirtioError> {
        self.write(reg::STATUS, 0);
        self.write(reg::STATUS, status::ACKNOWLEDGE);
        self.write(reg::STATUS, status::ACKNOWLEDGE | status::DRIVER);
        self.write(reg::DEVICE_FEATURES_SEL, 0);
        let low = self.read(reg::DEVICE_FEATURES) as u64;
        self.write(reg::DEVICE_FEATURES_SEL, 1);
        let high = self.read(reg::DEVICE_FEATURES) as u64;
        let offered = high << 32 | low;
        if offered & F_VERSION_1 == 0 {
            self.fail();
            return Err(VirtioError::MissingFeature("VERSION_1"));
        }
        let accepted = offered & (wanted | F_VERSION_1);
        self.write(reg::DRIVER_FEATURES_SEL, 0);
        self.write(reg::DRIVER_FEATURES, accepted as u32);
        self.write(reg::DRIVER_FEATURES_SEL, 1);
        self.write(reg::DRIVER_FEATURES, (accepted >> 32) as u32);
        let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;
        self.write(reg::STATUS, s);
        if self.read(reg::STATUS) & status::FEATURES_OK == 0 {
            self.fail();
            return Err(VirtioError::FeaturesRejected);
        }
        Ok(accepted)
    }

    /// Largest size of queue `index` (0 if it does not exist).
    pub fn queue_max(&self, index: u32) -> u32 {
        self.write(reg::QUEUE_SEL, index);
        self.read(reg::QUEUE_NUM_MAX)
    }

    /// Hands queue `index` to the device: its size and ring addresses.
    pub fn setup_queue(&self, index: u32, size: u16, desc: u64, driver: u64, device: u64) {
        self.write(reg::QUEUE_SEL, index);
        self.write(reg::QUEUE_NUM, size as u32);
        self.write(reg::QUEUE_DESC_LOW, desc as u32);
        self.write(reg::QUEUE_DESC_HIGH, (desc >> 32) as u32);
        self.write(reg::QUEUE_DRIVER_LOW, driver as u32);
        self.write(reg::QUEUE_DRIVER_HIGH, (driver >> 32) as u32);
        self.write(reg::QUEUE_DEVICE_LOW, device as u32);
        self.write(reg::QUEUE_DEVICE_HIGH, (device >> 32) as u32);
        self.write(reg::QUEUE_READY, 1);
    }

    pub fn driver_ok(&self) {
        let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK;
        self.write(reg::STATUS, s);
    }

    pub fn fail(&self) {
        self.write(reg::STATUS, status::FAILED);
    }

    pub fn notify(&self, queue: u16) {
        self.write(reg::QUEUE_NOTIFY, queue as u32);
    }

    /// Reads a 32-bit word of the device-specific configuration space.
    pub fn config32(&self, offset: usize) -> u32 {
        self.read(reg::CONFIG + offset)
    }

    /// Reads a byte of the device-specific configuration space.
    pub fn config8(&self, offset: usize) -> u8 {
        // SAFETY: as in `read`; the configuration space allows byte access.
        unsafe { read_volatile((self.base + reg::CONFIG + offset) as *const u8) }
    }
}
