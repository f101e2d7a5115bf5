//! Boot-time set-up of a vCPU's registers: the boot protocol's entry state
//! (PVH or the Linux 64-bit protocol), and the CPUID, LAPIC LINT pins and
//! MSRs firmware would give a vCPU (as Firecracker's `arch/x86_64/regs.rs`).

use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, CpuId, Msrs};

use super::{Vcpu, VcpuError};

/// Initial register state of the boot vCPU.
#[derive(Debug, Clone, Copy)]
pub enum BootEntry {
    /// PVH: 32-bit protected mode, paging off, `ebx` = start info.
    Pvh {
        /// Entry point.
        entry: u64,
        /// Guest-physical address of `hvm_start_info`.
        start_info: u64,
    },
    /// Linux 64-bit boot protocol: long mode with identity page tables already
    /// written by the loader, `rsi` = zero page.
    Linux64 {
        /// Entry point.
        entry: u64,
        /// Guest-physical address of boot_params.
        boot_params: u64,
        /// PML4 address.
        page_tables: u64,
        /// GDT address (flat 64-bit code/data descriptors at 0x08/0x10).
        gdt: u64,
    },
}

/// IA32_MISC_ENABLE.
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
/// IA32_MTRR_DEF_TYPE.
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;

/// The MSRs firmware sets before it starts a kernel, and their values:
/// fast strings on; MTRRs on with write-back as the default type (no ranges),
/// as Firecracker and Cloud Hypervisor set them. A guest whose MTRRs are off
/// treats its memory as uncached and skips setting up PAT.
pub const BOOT_MSRS: [(u32, u64); 2] = [
    (MSR_IA32_MISC_ENABLE, 1),
    (MSR_MTRR_DEF_TYPE, (1 << 11) | 6),
];

impl Vcpu {
    /// Sets CPUID (adjusted for this vCPU's APIC ID), the LAPIC's LINT pins and
    /// the MSRs firmware would set, for a machine of `vcpus` vCPUs.
    pub fn configure(&self, cpuid: &CpuId, vcpus: u8) -> Result<(), VcpuError> {
        let index = self.index;
        let err = |what| {
            move |source| VcpuError::Kvm {
                index,
                what,
                source,
            }
        };
        let mut cpuid = cpuid.clone();
        crate::vstate::cpuid::patch_for_vcpu(&mut cpuid, index, vcpus);
        self.fd.set_cpuid2(&cpuid).map_err(err("KVM_SET_CPUID2"))?;
        // LINT0 = ExtINT (the PIC), LINT1 = NMI, as firmware would set them.
        let mut lapic = self.fd.get_lapic().map_err(err("KVM_GET_LAPIC"))?;
        let lint0 = get_lapic_reg(&lapic.regs, 0x350);
        set_lapic_reg(&mut lapic.regs, 0x350, (lint0 & !0x700) | 0x700);
        let lint1 = get_lapic_reg(&lapic.regs, 0x360);
        set_lapic_reg(&mut lapic.regs, 0x360, (lint1 & !0x700) | 0x400);
        self.fd.set_lapic(&lapic).map_err(err("KVM_SET_LAPIC"))?;
        let entries: Vec<_> = BOOT_MSRS
            .iter()
            .map(|&(index, data)| kvm_msr_entry {
                index,
                data,
                ..Default::default()
            })
            .collect();
        let msrs = Msrs::from_entries(&entries).map_err(|_| VcpuError::Gone(index))?;
        // Best effort: not every KVM lets userspace set them all.
        let _ = self.fd.set_msrs(&msrs);
        Ok(())
    }

    /// Sets the boot vCPU's registers for `entry`.
    pub fn set_boot_state(&self, entry: BootEntry) -> Result<(), VcpuError> {
        let index = self.index;
        let err = |what| {
            move |source| VcpuError::Kvm {
                index,
                what,
                source,
            }
        };
        let mut sregs = self.fd.get_sregs().map_err(err("KVM_GET_SREGS"))?;
        let mut regs = kvm_regs {
            rflags: 0x2,
            ..Default::default()
        };
        match entry {
            BootEntry::Pvh { entry, start_info } => {
                set_flat_segments(&mut sregs, 0x10, 0x18, 0x20, false);
                sregs.cr0 = 0x11; // PE | ET
                sregs.cr4 = 0;
                sregs.efer = 0;
                regs.rip = entry;
                regs.rbx = start_info;
            }
            BootEntry::Linux64 {
                entry,
                boot_params,
                page_tables,
                gdt,
            } => {
                sregs.gdt.base = gdt;
                sregs.gdt.limit = 0x1f;
                set_flat_segments(&mut sregs, 0x08, 0x10, 0x18, true);
                sregs.cr3 = page_tables;
                sregs.cr4 = 0x20; // PAE
                sregs.cr0 = 0x8000_0011; // PG | ET | PE
                sregs.efer = 0x500; // LME | LMA
                regs.rip = entry;
                regs.rsi = boot_params;
                regs.rsp = 0x8ff0;
                regs.rbp = 0x8ff0;
            }
        }
        self.fd.set_sregs(&sregs).map_err(err("KVM_SET_SREGS"))?;
        self.fd.set_regs(&regs).map_err(err("KVM_SET_REGS"))?;
        let fpu = kvm_fpu {
            fcw: 0x37f,
            mxcsr: 0x1f80,
            ..Default::default()
        };
        self.fd.set_fpu(&fpu).map_err(err("KVM_SET_FPU"))?;
        Ok(())
    }
}

/// Flat code and data segments (base 0, 4 GiB) and a 32-bit busy TSS, as the
/// boot protocols expect them loaded.
fn set_flat_segments(
    sregs: &mut kvm_bindings::kvm_sregs,
    code: u16,
    data: u16,
    tss: u16,
    long: bool,
) {
    let d = flat_segment(data, 0x3, false);
    sregs.cs = flat_segment(code, 0xb, long);
    sregs.ds = d;
    sregs.es = d;
    sregs.fs = d;
    sregs.gs = d;
    sregs.ss = d;
    sregs.tr = kvm_segment {
        base: 0,
        limit: 0x67,
        selector: tss,
        type_: 0xb,
        present: 1,
        s: 0,
        ..Default::default()
    };
}

fn flat_segment(selector: u16, type_: u8, long: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl: 0,
        db: u8::from(!long),
        s: 1,
        l: u8::from(long),
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

fn get_lapic_reg(regs: &[std::os::raw::c_char; 1024], offset: usize) -> u32 {
    let b: [u8; 4] = std::array::from_fn(|i| regs[offset + i] as u8);
    u32::from_le_bytes(b)
}

fn set_lapic_reg(regs: &mut [std::os::raw::c_char; 1024], offset: usize, value: u32) {
    for (i, b) in value.to_le_bytes().into_iter().enumerate() {
        regs[offset + i] = b as std::os::raw::c_char;
    }
}
