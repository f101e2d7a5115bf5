//! virtio-pmem (device ID 27, virtio 1.2 section 5.19): a file or block
//! device mapped into guest-physical memory, which a Linux guest drives as
//! persistent memory (/dev/pmemN, `mount -o dax`: its reads and writes are
//! loads and stores, no request per block). Its one queue carries FLUSH
//! requests, answered once the backing is synced (fsync), so the guest's
//! fsync makes its writes durable.
//!
//! The window's pages are the host's page cache of the backing: they stay
//! mapped across the guest's in-place reboots (the device model and its
//! memory slot are kept with the VM), which is what makes a read right
//! after a reboot run at memory speed (docs/warm-cache.md, "virtio-pmem").
//! Outside guest RAM, the window is not in snapshots or migration streams:
//! saving the VM syncs it ([`VirtioDevice::sync_backend`]) and the next VMM
//! maps the same path.
//!
//! FLUSH is served on the device event loop thread, synchronously, like a
//! virtio-blk flush.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use tracing::{debug, info, warn};
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress};

use super::block::request::RawDesc;
use super::{
    read_config_space, Activation, ActiveQueue, DeviceCounters, QueueProgress, QueueView,
    VirtioDevice, VirtioError, FEATURE_VERSION_1, TYPE_PMEM,
};
use crate::layout;
use crate::memory::GuestMemoryMmap;
use crate::sys::SharedMapping;
use crate::vstate::vm::{Vm, VmError};

/// Size of the request queue (the guest sends one FLUSH at a time per fsync).
pub const QUEUE_SIZE: u16 = 128;
/// VIRTIO_PMEM_REQ_TYPE_FLUSH.
pub const REQ_TYPE_FLUSH: u32 = 0;
/// Bytes of the request (`le32 type`) and of the response (`le32 ret`).
const REQ_LEN: usize = 4;
/// Longest chain accepted.
const MAX_DESCRIPTORS: usize = 16;

/// Why a virtio-pmem backing cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PmemError {
    /// The file cannot be opened.
    #[error("cannot open {path} read-write")]
    Open {
        /// The backing.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Its size does not fit.
    #[error("{path} has {size} bytes: a pmem backing's size must be a non-zero multiple of 2 MiB")]
    Size {
        /// The backing.
        path: PathBuf,
        /// Its size.
        size: u64,
    },
    /// mmap or its size query failed.
    #[error("cannot map {path}")]
    Map {
        /// The backing.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// KVM refused the memory slot.
    #[error("cannot give {path} to the guest at {guest:#x}")]
    Slot {
        /// The backing.
        path: PathBuf,
        /// Guest-physical address of the window.
        guest: u64,
        /// The cause.
        #[source]
        source: VmError,
    },
}

/// The backing's size in bytes (a block device's, too: its metadata says 0).
fn backing_size(file: &File) -> std::io::Result<u64> {
    use std::io::Seek;
    let mut f = file;
    let size = f.seek(std::io::SeekFrom::End(0))?;
    f.rewind()?;
    Ok(size)
}

/// Drops the backing's clean cached pages that nothing maps: another host
/// may have written the disk since this one last read it (a VM migrated
/// away and back). Dirty and mapped pages stay (this host wrote them, or a
/// process still using them holds the newest data).
fn drop_clean_cache(file: &File) {
    // SAFETY: posix_fadvise takes no pointers; a failure only leaves the
    // cache as it was.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        debug!(error = %std::io::Error::from_raw_os_error(rc), "pmem: cannot drop the backing's cached pages");
    }
}

/// A backing mapped into the guest: a shared mapping of the file and the
/// KVM memory slot that shows it at `guest`. Dropping it removes the slot
/// first, then unmaps.
pub struct PmemWindow {
    path: PathBuf,
    file: File,
    guest: u64,
    size: u64,
    vm: Vm,
    slot: u32,
    // Unmapped after the slot is gone (Drop runs before the fields drop).
    _mapping: SharedMapping,
}

impl std::fmt::Debug for PmemWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PmemWindow")
            .field("path", &self.path)
            .field("guest", &format_args!("{:#x}", self.guest))
            .field("size", &self.size)
            .field("slot", &self.slot)
            .finish()
    }
}

impl PmemWindow {
    /// The size of the backing at `path`, checked (what its window will take).
    pub fn probe(path: &Path) -> Result<u64, PmemError> {
        let file = open(path)?;
        checked_size(path, &file)
    }

    /// Opens `path`, maps it whole and gives it to `vm`'s guest at `guest`.
    pub fn open(vm: &Vm, path: &Path, guest: u64) -> Result<Self, PmemError> {
        let file = open(path)?;
        let size = checked_size(path, &file)?;
        drop_clean_cache(&file);
        let map_err = |source| PmemError::Map {
            path: path.to_owned(),
            source,
        };
        let len = usize::try_from(size).map_err(|_| map_err(std::io::Error::other("too large")))?;
        let mapping = SharedMapping::new(file.as_raw_fd(), len, 0).map_err(map_err)?;
        let vm = vm.try_clone().map_err(|source| PmemError::Slot {
            path: path.to_owned(),
            guest,
            source,
        })?;
        // SAFETY: `mapping` covers `size` bytes and lives in this window,
        // which removes the slot before it unmaps (Drop).
        let slot = unsafe { vm.map_device_memory(guest, size, mapping.as_ptr().as_ptr() as u64) }
            .map_err(|source| PmemError::Slot {
            path: path.to_owned(),
            guest,
            source,
        })?;
        info!(path = %path.display(), guest = format_args!("{guest:#x}"), size, "pmem window mapped");
        Ok(PmemWindow {
            path: path.to_owned(),
            file,
            guest,
            size,
            vm,
            slot,
            _mapping: mapping,
        })
    }

    /// Writes the window's changes to the backing (fsync: the kernel writes
    /// back the pages the guest dirtied through the mapping).
    pub fn sync(&self) -> std::io::Result<()> {
        self.file.sync_all()
    }

    /// Guest-physical address of the window.
    pub fn guest_address(&self) -> u64 {
        self.guest
    }

    /// Bytes in the window.
    pub fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for PmemWindow {
    fn drop(&mut self) {
        if let Err(e) = self.vm.unmap_device_memory(self.slot, self.guest) {
            warn!(path = %self.path.display(), error = %e, "pmem: cannot remove the window's memory slot");
        }
    }
}

fn open(path: &Path) -> Result<File, PmemError> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|source| PmemError::Open {
            path: path.to_owned(),
            source,
        })
}

fn checked_size(path: &Path, file: &File) -> Result<u64, PmemError> {
    let size = backing_size(file).map_err(|source| PmemError::Map {
        path: path.to_owned(),
        source,
    })?;
    if size == 0 || size % layout::PMEM_SIZE_ALIGN != 0 {
        return Err(PmemError::Size {
            path: path.to_owned(),
            size,
        });
    }
    Ok(size)
}

/// Why a request chain was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// No device-writable descriptor of 4 bytes for the response.
    #[error("no 4-byte device-writable response descriptor")]
    NoResponse,
    /// Fewer than 4 device-readable bytes before the response.
    #[error("request shorter than 4 bytes")]
    Short,
    /// A device-readable descriptor after a device-writable one.
    #[error("device-readable descriptor after the response")]
    ReadableAfterWritable,
    /// More descriptors than a request ever needs.
    #[error("chain longer than {MAX_DESCRIPTORS} descriptors")]
    TooLong,
    /// A descriptor outside guest memory.
    #[error("descriptor outside guest memory")]
    OutsideMemory,
}

/// A well-formed request: its type and where its `le32 ret` goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// VIRTIO_PMEM_REQ_TYPE_*.
    pub kind: u32,
    /// The response.
    pub response: GuestAddress,
}

/// Parses one chain (guest input; pure, fuzzed): device-readable bytes
/// holding `le32 type` (any framing), then a device-writable descriptor of
/// at least 4 bytes for `le32 ret`.
pub fn parse_request(
    mem: &GuestMemoryMmap,
    descs: impl Iterator<Item = RawDesc>,
) -> Result<Request, RequestError> {
    let mut kind = [0u8; REQ_LEN];
    let mut have = 0usize;
    let mut response = None;
    for (n, d) in descs.enumerate() {
        if n >= MAX_DESCRIPTORS {
            return Err(RequestError::TooLong);
        }
        if d.write {
            if response.is_none() && d.len as usize >= REQ_LEN {
                let addr = GuestAddress(d.addr);
                mem.read_obj::<u32>(addr)
                    .map_err(|_| RequestError::OutsideMemory)?;
                response = Some(addr);
            }
            continue;
        }
        if response.is_some() {
            return Err(RequestError::ReadableAfterWritable);
        }
        let want = (REQ_LEN - have).min(d.len as usize);
        if want > 0 {
            mem.read_slice(&mut kind[have..have + want], GuestAddress(d.addr))
                .map_err(|_| RequestError::OutsideMemory)?;
            have += want;
        }
    }
    if have < REQ_LEN {
        return Err(RequestError::Short);
    }
    Ok(Request {
        kind: u32::from_le_bytes(kind),
        response: response.ok_or(RequestError::NoResponse)?,
    })
}

/// A virtio-pmem device in front of a [`PmemWindow`].
pub struct Pmem {
    name: String,
    window: PmemWindow,
    config: [u8; 16],
    active: Option<ActiveQueue>,
    counters: DeviceCounters,
}

impl Pmem {
    /// A device named `name` showing `window`.
    pub fn new(name: impl Into<String>, window: PmemWindow) -> Self {
        let mut config = [0u8; 16];
        config[..8].copy_from_slice(&window.guest_address().to_le_bytes());
        config[8..].copy_from_slice(&window.size().to_le_bytes());
        Pmem {
            name: name.into(),
            window,
            config,
            active: None,
            counters: DeviceCounters::default(),
        }
    }

    fn process_queue(&mut self) {
        let Some(mut active) = self.active.take() else {
            return;
        };
        let mut used_any = false;
        while let Some(chain) = active.queue.pop_descriptor_chain(&active.mem) {
            let head = chain.head_index();
            let used = match parse_request(&active.mem, chain.map(RawDesc::from)) {
                Ok(req) => {
                    let ret = self.execute(req.kind);
                    match active.mem.write_obj(ret.to_le(), req.response) {
                        Ok(()) => REQ_LEN as u32,
                        Err(_) => 0,
                    }
                }
                Err(e) => {
                    debug!(device = %self.name, error = %e, "virtio-pmem: rejected descriptor chain");
                    self.counters.bad_descriptors += 1;
                    self.counters.errors += 1;
                    0
                }
            };
            if let Err(e) = active.queue.add_used(&active.mem, head, used) {
                debug!(device = %self.name, error = %e, "virtio-pmem: cannot add used entry");
                self.counters.bad_descriptors += 1;
            }
            used_any = true;
        }
        if used_any && active.queue.needs_notification(&active.mem).unwrap_or(true) {
            active.interrupt.signal_used_queue();
        }
        self.active = Some(active);
    }

    /// Serves one request; the `ret` to answer (0: done).
    fn execute(&mut self, kind: u32) -> u32 {
        if kind != REQ_TYPE_FLUSH {
            self.counters.errors += 1;
            return 1;
        }
        match self.window.sync() {
            Ok(()) => {
                self.counters.requests += 1;
                0
            }
            Err(e) => {
                warn!(device = %self.name, path = %self.window.path.display(), error = %e, "virtio-pmem: flush failed");
                self.counters.errors += 1;
                1
            }
        }
    }
}

impl VirtioDevice for Pmem {
    fn device_type(&self) -> u32 {
        TYPE_PMEM
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        FEATURE_VERSION_1
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_space(&self.config, offset, data);
    }

    fn activate(&mut self, mut activation: Activation) -> Result<(), VirtioError> {
        let [queue] = activation.take_queues()?;
        let Activation {
            mem,
            interrupt,
            acked_features,
            ..
        } = activation;
        info!(device = %self.name, features = acked_features, "virtio-pmem activated");
        self.active = Some(ActiveQueue {
            mem,
            queue,
            interrupt,
        });
        Ok(())
    }

    fn is_activated(&self) -> bool {
        self.active.is_some()
    }

    fn queue_notified(&mut self, index: usize) {
        if index == 0 {
            self.process_queue();
        }
    }

    fn sync_backend(&mut self) -> std::io::Result<()> {
        self.window.sync()
    }

    fn reset(&mut self) {
        self.active = None;
    }

    fn counters(&self) -> DeviceCounters {
        self.counters.clone()
    }

    fn queue_views(&self) -> Vec<QueueView> {
        ActiveQueue::views(self.active.as_ref())
    }

    fn queue_progress(&self) -> Vec<QueueProgress> {
        ActiveQueue::progress(self.active.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem() -> GuestMemoryMmap {
        crate::devices::virtio::block::tests::guest_memory()
    }

    fn desc(addr: u64, len: u32, write: bool) -> RawDesc {
        RawDesc {
            addr,
            len,
            write,
            has_next: false,
        }
    }

    #[test]
    fn a_flush_in_any_framing_parses() {
        let m = mem();
        m.write_obj(0u32, GuestAddress(0x100)).unwrap();
        let r = parse_request(
            &m,
            [desc(0x100, 4, false), desc(0x200, 4, true)].into_iter(),
        );
        assert_eq!(
            r,
            Ok(Request {
                kind: REQ_TYPE_FLUSH,
                response: GuestAddress(0x200)
            })
        );
        m.write_slice(&[7, 0], GuestAddress(0x300)).unwrap();
        m.write_slice(&[0, 0], GuestAddress(0x400)).unwrap();
        let r = parse_request(
            &m,
            [
                desc(0x300, 2, false),
                desc(0x400, 2, false),
                desc(0x500, 8, true),
            ]
            .into_iter(),
        )
        .unwrap();
        assert_eq!(r.kind, 7);
    }

    #[test]
    fn malformed_chains_are_refused() {
        let m = mem();
        let parse = |d: Vec<RawDesc>| parse_request(&m, d.into_iter());
        assert_eq!(
            parse(vec![desc(0, 4, false)]),
            Err(RequestError::NoResponse)
        );
        assert_eq!(
            parse(vec![desc(0, 4, false), desc(8, 2, true)]),
            Err(RequestError::NoResponse)
        );
        assert_eq!(
            parse(vec![desc(0, 3, false), desc(8, 4, true)]),
            Err(RequestError::Short)
        );
        assert_eq!(
            parse(vec![desc(8, 4, true), desc(0, 4, false)]),
            Err(RequestError::ReadableAfterWritable)
        );
        assert_eq!(
            parse(vec![desc(1 << 30, 4, false), desc(8, 4, true)]),
            Err(RequestError::OutsideMemory)
        );
        assert_eq!(
            parse(vec![desc(0, 4, false), desc(1 << 30, 4, true)]),
            Err(RequestError::OutsideMemory)
        );
        assert_eq!(
            parse(vec![desc(0, 1, false); 17]),
            Err(RequestError::TooLong)
        );
    }

    #[test]
    fn a_backing_must_be_a_non_zero_multiple_of_2m() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pmem");
        std::fs::File::create(&path).unwrap();
        let err = PmemWindow::probe(&path).unwrap_err().to_string();
        assert!(
            err.contains("has 0 bytes") && err.contains("multiple of 2 MiB"),
            "{err}"
        );
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(3 << 20)
            .unwrap();
        assert!(matches!(
            PmemWindow::probe(&path),
            Err(PmemError::Size { size, .. }) if size == 3 << 20
        ));
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4 << 20)
            .unwrap();
        assert_eq!(PmemWindow::probe(&path).unwrap(), 4 << 20);
        let missing = dir.path().join("missing");
        let err = PmemWindow::probe(&missing).unwrap_err().to_string();
        assert!(err.contains(&*missing.to_string_lossy()), "{err}");
    }
}
