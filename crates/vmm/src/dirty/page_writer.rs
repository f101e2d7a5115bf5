//! A tiny real-mode guest program that dirties a known set of pages, for the
//! dirty-tracking tests and the `dirty-harvest` benchmark: each round it
//! writes 4 bytes at the start of `pages` consecutive pages from
//! `first_page`, then does `out dx, al` to `port` and starts over. The VMM
//! gets a KVM_EXIT_IO per round and can harvest between rounds, so exactly
//! those pages (and no other: no stack, code only read) are dirty each time.
//!
//! Real mode keeps it below 1 MiB and is emulated under PVM (slow per
//! instruction, but a round is ~30 instructions).

use vm_memory::{Bytes, GuestAddress};

use crate::memory::GuestMemoryMmap;
use crate::vstate::vcpu::{Vcpu, VcpuError};

/// Errors of the page writer.
#[derive(Debug, thiserror::Error)]
pub enum PageWriterError {
    /// The pages do not fit between the code page and 1 MiB.
    #[error("pages {first}..{end} must lie in 2..256 (real mode, code at page 1)")]
    Range {
        /// First page.
        first: u64,
        /// One past the last page.
        end: u64,
    },
    /// Writing the program failed.
    #[error("cannot write the program into guest memory")]
    Memory(#[source] vm_memory::GuestMemoryError),
    /// Setting registers failed.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// KVM_RUN failed.
    #[error("KVM_RUN failed")]
    Run(#[source] kvm_ioctls::Error),
    /// The vCPU stopped for something other than the writer's `out`.
    #[error("unexpected vCPU exit: {0}")]
    Exit(String),
}

/// The program's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageWriter {
    /// First page written (page number = guest physical address / 4096).
    pub first_page: u64,
    /// Pages written per round.
    pub pages: u16,
    /// The port written after each round.
    pub port: u16,
}

/// Guest physical address of the code.
pub const CODE_ADDR: u64 = 0x1000;

impl PageWriter {
    /// Checks the range.
    pub fn new(first_page: u64, pages: u16, port: u16) -> Result<Self, PageWriterError> {
        let end = first_page + u64::from(pages);
        if first_page < 2 || end > 256 || pages == 0 {
            return Err(PageWriterError::Range {
                first: first_page,
                end,
            });
        }
        Ok(PageWriter {
            first_page,
            pages,
            port,
        })
    }

    /// Guest page frame numbers dirtied each round.
    pub fn pfns(&self) -> std::ops::Range<u64> {
        self.first_page..self.first_page + u64::from(self.pages)
    }

    /// The machine code (16-bit).
    pub fn program(&self) -> Vec<u8> {
        let seg = (self.first_page * 0x100) as u16;
        let mut c = Vec::new();
        c.push(0xb8); // mov ax, seg
        c.extend_from_slice(&seg.to_le_bytes());
        c.extend_from_slice(&[0x8e, 0xc0]); // mov es, ax
        c.push(0xb9); // mov cx, pages
        c.extend_from_slice(&self.pages.to_le_bytes());
        let next = c.len();
        c.extend_from_slice(&[0x26, 0x66, 0xa3, 0x00, 0x00]); // mov es:[0], eax
        c.extend_from_slice(&[0x8c, 0xc0]); // mov ax, es
        c.extend_from_slice(&[0x05, 0x00, 0x01]); // add ax, 0x100 (next page)
        c.extend_from_slice(&[0x8e, 0xc0]); // mov es, ax
        c.push(0xe2); // loop next
        c.push((next as isize - (c.len() as isize + 1)) as u8);
        c.push(0xba); // mov dx, port
        c.extend_from_slice(&self.port.to_le_bytes());
        c.push(0xee); // out dx, al
        c.push(0xeb); // jmp 0
        c.push((-(c.len() as isize + 1)) as u8);
        c
    }

    /// Writes the program at [`CODE_ADDR`] and points `vcpu` (not started)
    /// at it in real mode.
    pub fn install(&self, mem: &GuestMemoryMmap, vcpu: &mut Vcpu) -> Result<(), PageWriterError> {
        self.install_at(mem, vcpu, CODE_ADDR)
    }

    /// Like [`install`](Self::install), with the code at `code_addr` (below
    /// 64 KiB, outside the pages written): several vCPUs can run writers of
    /// their own.
    pub fn install_at(
        &self,
        mem: &GuestMemoryMmap,
        vcpu: &mut Vcpu,
        code_addr: u64,
    ) -> Result<(), PageWriterError> {
        let code_page = code_addr >> 12;
        if code_addr >= 0x1_0000 || self.pfns().contains(&code_page) || code_page == 0 {
            return Err(PageWriterError::Range {
                first: self.first_page,
                end: self.first_page + u64::from(self.pages),
            });
        }
        mem.write_slice(&self.program(), GuestAddress(code_addr))
            .map_err(PageWriterError::Memory)?;
        let index = vcpu.index();
        let err = |what| {
            move |source| VcpuError::Kvm {
                index,
                what,
                source,
            }
        };
        let fd = vcpu.fd();
        let mut sregs = fd.get_sregs().map_err(err("KVM_GET_SREGS"))?;
        sregs.cs.base = 0;
        sregs.cs.selector = 0;
        fd.set_sregs(&sregs).map_err(err("KVM_SET_SREGS"))?;
        let regs = kvm_bindings::kvm_regs {
            rip: code_addr,
            rflags: 0x2,
            ..Default::default()
        };
        fd.set_regs(&regs).map_err(err("KVM_SET_REGS"))?;
        // An application processor would otherwise wait for INIT/SIPI in
        // KVM_RUN forever.
        let runnable = kvm_bindings::kvm_mp_state {
            mp_state: kvm_bindings::KVM_MP_STATE_RUNNABLE,
        };
        fd.set_mp_state(runnable).map_err(err("KVM_SET_MP_STATE"))?;
        Ok(())
    }

    /// Runs `vcpu` on the calling thread (instead of a vCPU thread) until the
    /// end of the next round.
    pub fn run_round(&self, vcpu: &mut Vcpu) -> Result<(), PageWriterError> {
        loop {
            match vcpu.fd().run() {
                Ok(kvm_ioctls::VcpuExit::IoOut(port, _)) if port == self.port => return Ok(()),
                Ok(kvm_ioctls::VcpuExit::Intr) => {}
                Ok(other) => return Err(PageWriterError::Exit(format!("{other:?}"))),
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {}
                Err(e) => return Err(PageWriterError::Run(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_is_checked() {
        assert!(PageWriter::new(1, 1, 0x510).is_err());
        assert!(PageWriter::new(250, 7, 0x510).is_err());
        assert!(PageWriter::new(2, 0, 0x510).is_err());
        assert_eq!(PageWriter::new(16, 16, 0x510).unwrap().pfns(), 16..32);
    }

    #[test]
    fn jumps_land_on_their_targets() {
        let p = PageWriter::new(16, 16, 0x510).unwrap().program();
        assert_eq!(p.len(), 28);
        // `loop` at 20 (rel8 at 21) goes back to 8; `jmp` at 26 to 0.
        assert_eq!(p[20], 0xe2);
        assert_eq!(22 + i64::from(p[21] as i8), 8);
        assert_eq!(p[26], 0xeb);
        assert_eq!(28 + i64::from(p[27] as i8), 0);
        assert_eq!(&p[1..3], &0x1000u16.to_le_bytes());
    }
}
