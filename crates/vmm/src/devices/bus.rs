//! Address buses (port I/O and MMIO): map an address range to the device that
//! serves it. Built once at start, then shared read-only by the vCPU threads.

use std::sync::{Arc, Mutex};

/// A device on a bus. `offset` is relative to the start of its range.
pub trait BusDevice: Send {
    /// A guest read of `data.len()` bytes. Unserved bytes must be left as 0.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// A guest write.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Errors when building a bus.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// Two devices claim overlapping ranges.
    #[error("bus range {base:#x}+{len:#x} overlaps another device")]
    Overlap {
        /// Start of the new range.
        base: u64,
        /// Its length.
        len: u64,
    },
    /// A zero-length range.
    #[error("bus range at {0:#x} has zero length")]
    Empty(u64),
}

struct Entry {
    base: u64,
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
}

/// A set of non-overlapping ranges, each served by one device.
#[derive(Default)]
pub struct Bus {
    entries: Vec<Entry>,
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `device` at `[base, base + len)`.
    pub fn insert(
        &mut self,
        device: Arc<Mutex<dyn BusDevice>>,
        base: u64,
        len: u64,
    ) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::Empty(base));
        }
        let end = base
            .checked_add(len)
            .ok_or(BusError::Overlap { base, len })?;
        if self
            .entries
            .iter()
            .any(|e| base < e.base + e.len && e.base < end)
        {
            return Err(BusError::Overlap { base, len });
        }
        let pos = self.entries.partition_point(|e| e.base < base);
        self.entries.insert(pos, Entry { base, len, device });
        Ok(())
    }

    fn find(&self, addr: u64) -> Option<(&Entry, u64)> {
        let pos = self.entries.partition_point(|e| e.base <= addr);
        let e = self.entries.get(pos.checked_sub(1)?)?;
        (addr - e.base < e.len).then(|| (e, addr - e.base))
    }

    /// Dispatches a read; addresses nobody serves read as all ones (like an
    /// empty ISA bus) and are logged at debug level.
    pub fn read(&self, addr: u64, data: &mut [u8]) {
        match self.find(addr) {
            Some((e, off)) => {
                data.fill(0);
                e.device
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .read(off, data)
            }
            None => {
                data.fill(0xff);
                tracing::trace!(
                    addr = format_args!("{addr:#x}"),
                    "read of unassigned address"
                );
            }
        }
    }

    /// Dispatches a write; writes nobody serves are dropped.
    pub fn write(&self, addr: u64, data: &[u8]) {
        match self.find(addr) {
            Some((e, off)) => e
                .device
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .write(off, data),
            None => {
                tracing::trace!(
                    addr = format_args!("{addr:#x}"),
                    "write to unassigned address"
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Recorder(Vec<(u64, Vec<u8>)>);
    impl BusDevice for Recorder {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data[0] = offset as u8;
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.0.push((offset, data.to_vec()));
        }
    }

    #[test]
    fn dispatches_by_range() {
        let a = Arc::new(Mutex::new(Recorder(vec![])));
        let mut bus = Bus::new();
        bus.insert(a.clone(), 0x3f8, 8).unwrap();
        bus.insert(Arc::new(Mutex::new(Recorder(vec![]))), 0x60, 1)
            .unwrap();
        let mut d = [0u8; 1];
        bus.read(0x3fa, &mut d);
        assert_eq!(d[0], 2);
        bus.read(0x400, &mut d);
        assert_eq!(d[0], 0xff);
        bus.write(0x3f8, &[7]);
        bus.write(0x3f0, &[7]);
        assert_eq!(a.lock().unwrap().0, vec![(0, vec![7])]);
    }

    #[test]
    fn rejects_overlaps() {
        let mut bus = Bus::new();
        bus.insert(Arc::new(Mutex::new(Recorder(vec![]))), 0x100, 0x10)
            .unwrap();
        for (b, l) in [(0xf8, 0x10), (0x10f, 1), (0x100, 0x10), (0x50, 0)] {
            assert!(bus
                .insert(Arc::new(Mutex::new(Recorder(vec![]))), b, l)
                .is_err());
        }
        bus.insert(Arc::new(Mutex::new(Recorder(vec![]))), 0x110, 1)
            .unwrap();
        assert!(bus
            .insert(Arc::new(Mutex::new(Recorder(vec![]))), u64::MAX, 2)
            .is_err());
    }
}
