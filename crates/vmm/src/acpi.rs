//! ACPI tables for Linux guests: how a stock kernel (with no special command
//! line) finds the vCPUs, the IOAPIC, the serial port and the virtio-mmio
//! devices, and how it powers off and reboots.
//!
//! ```text
//! layout::ACPI_START (0xe0000, in the legacy BIOS area, reserved in E820)
//!   RSDP ──> XSDT ──> FADT ──> DSDT   (\_SB.COM1, \_SB.Vnnn, \_S5)
//!                └──> MADT            (a local APIC per vCPU, the IOAPIC)
//! ```
//!
//! The platform is *hardware-reduced* ACPI (FADT flag HW_REDUCED_ACPI): no
//! PM1 blocks, no SCI, no legacy PIC or PIT expected. Power management goes
//! through three I/O ports the VMM core must handle:
//!
//! | port | register | guest access | VMM action |
//! |---|---|---|---|
//! | [`SLEEP_CONTROL_PORT`] 0x600 | FADT SLEEP_CONTROL_REG | write `(5 << 2) \| 0x20` = 0x34 on poweroff | [`is_poweroff`] → stop the VM, exit 0 |
//! | [`SLEEP_STATUS_PORT`] 0x601 | FADT SLEEP_STATUS_REG | reads, writes 0x80 (clear WAK_STS) | read 0, ignore writes |
//! | [`RESET_PORT`] 0x602 | FADT RESET_REG | write [`RESET_VALUE`] on reboot | reboot (or exit, like a reset) |
//!
//! Linux only offers ACPI poweroff on a reduced-hardware platform when both
//! sleep registers exist and the DSDT has a `\_S5` package; it writes the
//! `_S5` sleep type (5) shifted left by 2 with SLP_EN (bit 5). A reboot tries
//! the FADT reset register first, then the i8042 (port 0x64, value 0xfe),
//! which the core already handles.
//!
//! On a hardware-reduced platform with no `reboot=` parameter, Linux reboots
//! through EFI (absent here) and then jumps, in real mode, to the BIOS reset
//! vector F000:FFF0. [`create_acpi_tables`] therefore also writes a tiny stub
//! at that vector that writes [`RESET_VALUE`] to [`RESET_PORT`], so a guest
//! reboot reaches the VMM whichever way the kernel tries it.
//!
//! Interrupts: each virtio-mmio device's GSI is an IOAPIC pin, described as
//! edge-triggered, active-high (the VMM signals it with an irqfd). ISA IRQs
//! are identity-mapped (no interrupt source overrides: there is no PIT in a
//! reduced-hardware platform, and the serial port's IRQ 4 is GSI 4).
//! The FADT also says: no VGA, no i8042 to probe, no CMOS RTC, no MSI.

use acpi_tables::aml::{
    self, Device, EISAName, Interrupt, Memory32Fixed, Name, Package, ResourceTemplate, Scope, IO,
};
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::madt::{
    EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT,
};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::Aml;
use vm_memory::{Bytes, GuestAddress};

use crate::devices::bus::BusDevice;
use crate::layout;
use crate::memory::GuestMemoryMmap;
use crate::vstate::{VmEvent, VmEventSink};

/// Port of the FADT sleep control register (see the module doc).
pub const SLEEP_CONTROL_PORT: u16 = 0x600;
/// Port of the FADT sleep status register.
pub const SLEEP_STATUS_PORT: u16 = 0x601;
/// Port of the FADT reset register.
pub const RESET_PORT: u16 = 0x602;
/// Value the guest writes to [`RESET_PORT`] to reboot.
pub const RESET_VALUE: u8 = 1;
/// The `_S5` (soft off) sleep type the DSDT announces.
pub const S5_SLEEP_TYPE: u8 = 5;
/// SLP_EN in the sleep control register.
const SLEEP_ENABLE: u8 = 1 << 5;

/// End of the area the tables may use (the last 64 KiB below 1 MiB are the
/// "BIOS", holding the reset vector).
const ACPI_END: u64 = 0xf_0000;
/// The real-mode reset vector (F000:FFF0).
pub const RESET_VECTOR: u64 = 0xf_fff0;
/// COM1, as the core's serial device.
const COM1_PORT: u16 = 0x3f8;
const COM1_IRQ: u32 = 4;

const OEM_ID: [u8; 6] = *b"KEMARI";
const OEM_TABLE_ID: [u8; 8] = *b"KEMARIVM";
const OEM_REVISION: u32 = 1;

// FADT IAPC_BOOT_ARCH bits (ACPI 6.5, table 5.11).
const IAPC_VGA_NOT_PRESENT: u16 = 1 << 2;
const IAPC_MSI_NOT_SUPPORTED: u16 = 1 << 3;
const IAPC_CMOS_RTC_NOT_PRESENT: u16 = 1 << 5;

/// One virtio-mmio device as the DSDT describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioMmioDesc {
    /// Guest-physical base of its register window.
    pub base: u64,
    /// Size of the window (normally [`layout::VIRTIO_MMIO_SIZE`]).
    pub size: u64,
    /// The IOAPIC pin (GSI) its irqfd raises.
    pub gsi: u32,
}

/// Errors while building the ACPI tables.
#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    /// A VM needs at least one vCPU.
    #[error("cannot describe a VM with no vCPUs")]
    NoVcpus,
    /// A device window is not 32-bit addressable (Memory32Fixed).
    #[error("virtio-mmio device {index} window {base:#x}+{size:#x} is not below 4 GiB")]
    DeviceWindow {
        /// Position in the device list.
        index: usize,
        /// Its base.
        base: u64,
        /// Its size.
        size: u64,
    },
    /// A GSI beyond the IOAPIC's pins.
    #[error("virtio-mmio device {index} uses GSI {gsi}, beyond the IOAPIC's 24 pins")]
    Gsi {
        /// Position in the device list.
        index: usize,
        /// The GSI.
        gsi: u32,
    },
    /// Too many devices for the DSDT's naming (V000..VFFF) or the IOAPIC.
    #[error("{0} virtio-mmio devices are more than the ACPI tables can describe")]
    TooManyDevices(usize),
    /// The tables do not fit between ACPI_START and 1 MiB.
    #[error("ACPI tables need {0} bytes, more than the {1} bytes reserved for them")]
    TooLarge(u64, u64),
    /// Guest memory refused the write.
    #[error("cannot write the {table} table at {addr:#x}")]
    Write {
        /// Which table.
        table: &'static str,
        /// Where.
        addr: u64,
        /// The cause.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
}

/// True if `value`, written to [`SLEEP_CONTROL_PORT`], asks for poweroff (S5).
pub fn is_poweroff(value: u8) -> bool {
    value & SLEEP_ENABLE != 0 && (value >> 2) & 0x7 == S5_SLEEP_TYPE
}

/// The three ACPI power-management ports ([`SLEEP_CONTROL_PORT`],
/// [`SLEEP_STATUS_PORT`], [`RESET_PORT`]) as one I/O-bus device: insert it at
/// [`SLEEP_CONTROL_PORT`] with length [`POWER_PORTS_LEN`]. A poweroff request
/// reports `VmEvent::Poweroff { code: 0 }`, a reset request `VmEvent::Reset`.
pub struct PowerPorts {
    events: VmEventSink,
}

/// Number of consecutive ports [`PowerPorts`] decodes.
pub const POWER_PORTS_LEN: u64 = (RESET_PORT - SLEEP_CONTROL_PORT + 1) as u64;

impl PowerPorts {
    /// Power ports reporting on `events`.
    pub fn new(events: VmEventSink) -> Self {
        PowerPorts { events }
    }
}

impl BusDevice for PowerPorts {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // Sleep status (WAK_STS clear) and everything else read as 0.
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some(&value) = data.first() else { return };
        let port = SLEEP_CONTROL_PORT as u64 + offset;
        if port == SLEEP_CONTROL_PORT as u64 && is_poweroff(value) {
            self.events.send(VmEvent::Poweroff { code: 0 });
        } else if port == RESET_PORT as u64 && value == RESET_VALUE {
            self.events.send(VmEvent::Reset);
        }
    }
}

/// Builds RSDP, XSDT, FADT, MADT and DSDT at [`layout::ACPI_START`] and
/// returns the RSDP's address (for `boot_params.acpi_rsdp_addr` or the PVH
/// start info's `rsdp_paddr`).
///
/// vCPU `i` must have APIC ID `i` (KVM's default for vCPU id `i`).
pub fn create_acpi_tables(
    mem: &GuestMemoryMmap,
    vcpus: u8,
    devices: &[VirtioMmioDesc],
) -> Result<GuestAddress, AcpiError> {
    if vcpus == 0 {
        return Err(AcpiError::NoVcpus);
    }
    if devices.len() > layout::VIRTIO_MAX_DEVICES.max(0xfff) {
        return Err(AcpiError::TooManyDevices(devices.len()));
    }
    for (index, d) in devices.iter().enumerate() {
        if d.base.checked_add(d.size).is_none_or(|end| end > 1 << 32) {
            return Err(AcpiError::DeviceWindow {
                index,
                base: d.base,
                size: d.size,
            });
        }
        if d.gsi >= 24 {
            return Err(AcpiError::Gsi { index, gsi: d.gsi });
        }
    }

    let mut writer = TableWriter::new(mem);
    let rsdp_addr = writer.reserve(Rsdp::len() as u64)?;

    let dsdt = build_dsdt(devices);
    let dsdt_addr = writer.write("DSDT", dsdt.as_slice())?;

    let fadt = build_fadt(dsdt_addr);
    let fadt_addr = writer.write("FADT", &aml_bytes(&fadt))?;

    let madt = build_madt(vcpus);
    let madt_addr = writer.write("MADT", &aml_bytes(&madt))?;

    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    let xsdt_addr = writer.write("XSDT", &aml_bytes(&xsdt))?;

    write_reset_vector(mem)?;

    let rsdp = Rsdp::new(OEM_ID, xsdt_addr);
    mem.write_slice(&aml_bytes(&rsdp), GuestAddress(rsdp_addr))
        .map_err(|source| AcpiError::Write {
            table: "RSDP",
            addr: rsdp_addr,
            source,
        })?;
    Ok(GuestAddress(rsdp_addr))
}

/// Real-mode code at the reset vector: `mov al, RESET_VALUE; mov dx,
/// RESET_PORT; out dx, al; hlt; jmp $-3`.
fn reset_vector_stub() -> [u8; 9] {
    let port = RESET_PORT.to_le_bytes();
    [
        0xb0,
        RESET_VALUE,
        0xba,
        port[0],
        port[1],
        0xee,
        0xf4,
        0xeb,
        0xfd,
    ]
}

fn write_reset_vector(mem: &GuestMemoryMmap) -> Result<(), AcpiError> {
    mem.write_slice(&reset_vector_stub(), GuestAddress(RESET_VECTOR))
        .map_err(|source| AcpiError::Write {
            table: "reset vector",
            addr: RESET_VECTOR,
            source,
        })
}

fn aml_bytes(table: &dyn Aml) -> Vec<u8> {
    let mut bytes = Vec::new();
    table.to_aml_bytes(&mut bytes);
    bytes
}

/// Places tables one after another, 16-byte aligned, from ACPI_START.
struct TableWriter<'a> {
    mem: &'a GuestMemoryMmap,
    next: u64,
}

impl<'a> TableWriter<'a> {
    fn new(mem: &'a GuestMemoryMmap) -> Self {
        TableWriter {
            mem,
            next: layout::ACPI_START,
        }
    }

    fn reserve(&mut self, len: u64) -> Result<u64, AcpiError> {
        let addr = self.next;
        let end = addr + len;
        if end > ACPI_END {
            return Err(AcpiError::TooLarge(
                end - layout::ACPI_START,
                ACPI_END - layout::ACPI_START,
            ));
        }
        self.next = (end + 15) & !15;
        Ok(addr)
    }

    fn write(&mut self, table: &'static str, bytes: &[u8]) -> Result<u64, AcpiError> {
        let addr = self.reserve(bytes.len() as u64)?;
        self.mem
            .write_slice(bytes, GuestAddress(addr))
            .map_err(|source| AcpiError::Write {
                table,
                addr,
                source,
            })?;
        Ok(addr)
    }
}

fn io_register(port: u16) -> GAS {
    GAS::new(
        AddressSpace::SystemIo,
        8,
        0,
        AccessSize::ByteAccess,
        port.into(),
    )
}

fn build_fadt(dsdt_addr: u64) -> acpi_tables::fadt::FADT {
    let mut fadt = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::ResetRegSup)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    fadt.iapc_boot_arch =
        (IAPC_VGA_NOT_PRESENT | IAPC_MSI_NOT_SUPPORTED | IAPC_CMOS_RTC_NOT_PRESENT).into();
    fadt.sleep_control_reg = io_register(SLEEP_CONTROL_PORT);
    fadt.sleep_status_reg = io_register(SLEEP_STATUS_PORT);
    fadt.reset_reg = io_register(RESET_PORT);
    fadt.reset_value = RESET_VALUE;
    fadt.finalize()
}

fn build_madt(vcpus: u8) -> MADT {
    let mut madt = MADT::new(
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
        LocalInterruptController::Address(layout::APIC_START as u32),
    );
    for id in 0..vcpus {
        madt.add_structure(ProcessorLocalApic::new(id, id, EnabledStatus::Enabled));
    }
    // The IOAPIC gets an ID above every local APIC's.
    madt.add_structure(IoApic::new(vcpus, layout::IOAPIC_START as u32, 0));
    madt
}

fn build_dsdt(devices: &[VirtioMmioDesc]) -> Sdt {
    // The serial port the core emulates.
    let com1_io = IO::new(COM1_PORT, COM1_PORT, 1, 8);
    let com1_irq = Interrupt::new(true, true, false, false, COM1_IRQ);
    let com1_crs = ResourceTemplate::new(vec![&com1_io, &com1_irq]);
    let com1_hid = Name::new("_HID".into(), &EISAName::new("PNP0501"));
    let com1_uid = Name::new("_UID".into(), &aml::ZERO);
    let com1_crs_name = Name::new("_CRS".into(), &com1_crs);
    let com1 = Device::new("COM1".into(), vec![&com1_hid, &com1_uid, &com1_crs_name]);

    // Each virtio-mmio device: Linux's virtio_mmio driver binds to LNRO0005.
    let descs: Vec<(Memory32Fixed, Interrupt)> = devices
        .iter()
        .map(|d| {
            (
                Memory32Fixed::new(true, d.base as u32, d.size as u32),
                Interrupt::new(true, true, false, false, d.gsi),
            )
        })
        .collect();
    let crs: Vec<ResourceTemplate<'_>> = descs
        .iter()
        .map(|(m, i)| ResourceTemplate::new(vec![m, i]))
        .collect();
    let uids: Vec<u32> = (0..devices.len() as u32).collect();
    let hid = Name::new("_HID".into(), &"LNRO0005");
    let uid_names: Vec<Name> = uids.iter().map(|u| Name::new("_UID".into(), u)).collect();
    let crs_names: Vec<Name> = crs.iter().map(|c| Name::new("_CRS".into(), c)).collect();
    let virtio: Vec<Device<'_>> = uid_names
        .iter()
        .zip(&crs_names)
        .enumerate()
        .map(|(i, (uid, crs))| {
            Device::new(format!("V{i:03X}").as_str().into(), vec![&hid, uid, crs])
        })
        .collect();

    let mut sb_children: Vec<&dyn Aml> = vec![&com1];
    sb_children.extend(virtio.iter().map(|d| d as &dyn Aml));
    let sb = Scope::new("\\_SB_".into(), sb_children);

    // \_S5: the soft-off sleep type written to the sleep control register.
    let s5_type = S5_SLEEP_TYPE;
    let s5 = Name::new("_S5_".into(), &Package::new(vec![&s5_type, &aml::ZERO]));

    let mut body = Vec::new();
    sb.to_aml_bytes(&mut body);
    s5.to_aml_bytes(&mut body);
    let mut dsdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    dsdt.append_slice(&body);
    dsdt
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{GuestMemoryFile, MemoryBacking};

    fn mem() -> GuestMemoryMmap {
        GuestMemoryFile::create(64 << 20, &MemoryBacking::Memfd)
            .unwrap()
            .map()
            .unwrap()
    }

    fn read(m: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        m.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }

    fn u64_at(b: &[u8], off: usize) -> u64 {
        u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
    }

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    /// Reads a whole table (signature, length from its header) and checks it.
    fn table(m: &GuestMemoryMmap, addr: u64, sig: &[u8; 4]) -> Vec<u8> {
        assert!((layout::ACPI_START..ACPI_END).contains(&addr));
        let header = read(m, addr, 36);
        assert_eq!(&header[0..4], sig);
        let len = u32_at(&header, 4) as usize;
        assert!(addr + len as u64 <= ACPI_END);
        let t = read(m, addr, len);
        assert_eq!(sum(&t), 0, "{} checksum", String::from_utf8_lossy(sig));
        t
    }

    fn devices(n: usize) -> Vec<VirtioMmioDesc> {
        (0..n)
            .map(|i| VirtioMmioDesc {
                base: layout::virtio_mmio_base(i),
                size: layout::VIRTIO_MMIO_SIZE,
                gsi: layout::VIRTIO_IRQ_BASE + i as u32,
            })
            .collect()
    }

    #[test]
    fn tables_parse_back_with_valid_checksums() {
        let m = mem();
        let rsdp = create_acpi_tables(&m, 2, &devices(2)).unwrap();
        assert_eq!(rsdp.0, layout::ACPI_START);
        assert_eq!(rsdp.0 % 16, 0);
        let r = read(&m, rsdp.0, 36);
        assert_eq!(&r[0..8], b"RSD PTR ");
        assert_eq!(sum(&r[0..20]), 0);
        assert_eq!(sum(&r), 0);
        assert_eq!(r[15], 2, "ACPI 2.0+ RSDP");

        let xsdt = table(&m, u64_at(&r, 24), b"XSDT");
        let entries: Vec<u64> = (36..xsdt.len())
            .step_by(8)
            .map(|o| u64_at(&xsdt, o))
            .collect();
        assert_eq!(entries.len(), 2);
        let fadt = table(&m, entries[0], b"FACP");
        let madt = table(&m, entries[1], b"APIC");

        // FADT: hardware-reduced, X_DSDT set, sleep and reset registers on our ports.
        let flags = u32_at(&fadt, 112);
        assert_ne!(flags & (1 << 20), 0, "HW_REDUCED_ACPI");
        assert_ne!(flags & (1 << 10), 0, "RESET_REG_SUP");
        let dsdt = table(&m, u64_at(&fadt, 140), b"DSDT");
        assert_eq!(fadt[116], 1, "reset register in I/O space");
        assert_eq!(u64_at(&fadt, 120), u64::from(RESET_PORT));
        assert_eq!(fadt[128], RESET_VALUE);
        assert_eq!(u64_at(&fadt, 244 + 4), u64::from(SLEEP_CONTROL_PORT));
        assert_eq!(u64_at(&fadt, 256 + 4), u64::from(SLEEP_STATUS_PORT));

        // MADT: LAPIC address, two enabled local APICs, then the IOAPIC.
        assert_eq!(u32_at(&madt, 36), layout::APIC_START as u32);
        let mut off = 44;
        let mut lapics = vec![];
        let mut ioapic = None;
        while off < madt.len() {
            let (kind, len) = (madt[off], madt[off + 1] as usize);
            match kind {
                0 => {
                    assert_eq!(u32_at(&madt, off + 4) & 1, 1, "enabled");
                    lapics.push(madt[off + 3]);
                }
                1 => ioapic = Some(u32_at(&madt, off + 4)),
                _ => panic!("unexpected MADT entry {kind}"),
            }
            off += len;
        }
        assert_eq!(lapics, vec![0, 1]);
        assert_eq!(ioapic, Some(layout::IOAPIC_START as u32));

        // DSDT: the serial port, both devices, and _S5.
        let body = &dsdt[36..];
        let has = |needle: &[u8]| body.windows(needle.len()).any(|w| w == needle);
        assert!(has(b"LNRO0005"));
        assert!(has(b"V000") && has(b"V001") && !has(b"V002"));
        assert!(has(b"COM1") && has(b"_S5_"));
        for d in devices(2) {
            // Memory32Fixed descriptor: 0x86, length 9, read-write, base, size.
            let mut desc = vec![0x86, 9, 0, 1];
            desc.extend_from_slice(&(d.base as u32).to_le_bytes());
            desc.extend_from_slice(&(d.size as u32).to_le_bytes());
            assert!(has(&desc), "window of {d:?}");
            // Extended interrupt: consumer, edge, active-high, exclusive.
            let mut irq = vec![0x89, 6, 0, 0b0011, 1];
            irq.extend_from_slice(&d.gsi.to_le_bytes());
            assert!(has(&irq), "interrupt of {d:?}");
        }
    }

    #[test]
    fn reset_vector_writes_the_reset_port() {
        let m = mem();
        create_acpi_tables(&m, 1, &[]).unwrap();
        let stub = read(&m, RESET_VECTOR, 9);
        assert_eq!(stub, [0xb0, 1, 0xba, 0x02, 0x06, 0xee, 0xf4, 0xeb, 0xfd]);
    }

    #[test]
    fn no_devices_and_many_vcpus() {
        let m = mem();
        let rsdp = create_acpi_tables(&m, 8, &[]).unwrap();
        let r = read(&m, rsdp.0, 36);
        let xsdt = table(&m, u64_at(&r, 24), b"XSDT");
        let madt = table(&m, u64_at(&xsdt, 44), b"APIC");
        assert_eq!(madt.len(), 44 + 8 * 8 + 12);
    }

    #[test]
    fn bad_inputs_are_refused() {
        let m = mem();
        assert!(matches!(
            create_acpi_tables(&m, 0, &[]),
            Err(AcpiError::NoVcpus)
        ));
        let high = [VirtioMmioDesc {
            base: 1 << 32,
            size: 0x1000,
            gsi: 5,
        }];
        assert!(matches!(
            create_acpi_tables(&m, 1, &high),
            Err(AcpiError::DeviceWindow { index: 0, .. })
        ));
        let gsi = [VirtioMmioDesc {
            base: layout::VIRTIO_MMIO_START,
            size: 0x1000,
            gsi: 24,
        }];
        assert!(matches!(
            create_acpi_tables(&m, 1, &gsi),
            Err(AcpiError::Gsi { index: 0, gsi: 24 })
        ));
    }

    #[test]
    fn power_ports_report_poweroff_and_reset() {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut p = PowerPorts::new(VmEventSink::channel(tx));
        p.write(1, &[0x80]); // clearing WAK_STS: nothing happens
        p.write(0, &[3 << 2 | SLEEP_ENABLE]); // S3: not supported, ignored
        p.write(0, &[(S5_SLEEP_TYPE << 2) | SLEEP_ENABLE]);
        p.write(2, &[RESET_VALUE]);
        let mut status = [0xff];
        p.read(1, &mut status);
        assert_eq!(status, [0]);
        assert_eq!(rx.try_recv().unwrap(), VmEvent::Poweroff { code: 0 });
        assert_eq!(rx.try_recv().unwrap(), VmEvent::Reset);
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn poweroff_value_is_recognised() {
        assert!(is_poweroff((S5_SLEEP_TYPE << 2) | SLEEP_ENABLE));
        assert!(!is_poweroff(S5_SLEEP_TYPE << 2));
        assert!(!is_poweroff((3 << 2) | SLEEP_ENABLE));
    }
}
