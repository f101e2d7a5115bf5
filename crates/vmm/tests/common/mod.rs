//! What the KVM tests share: a kernel small enough to build here.

use std::path::Path;

/// Where the kernel is loaded and entered (PVH, 32-bit protected mode).
pub const ENTRY: u32 = 0x10_0000;

/// A PVH ELF kernel whose code is `hlt; jmp .-1`: it sleeps in KVM_RUN,
/// and a kick takes it out.
pub fn halting_kernel(path: &Path) {
    let code: &[u8] = &[0xf4, 0xeb, 0xfd];
    // The note: namesz, descsz, type XEN_ELFNOTE_PHYS32_ENTRY, "Xen\0", the entry.
    let mut note = Vec::new();
    for v in [4u32, 4, 18] {
        note.extend_from_slice(&v.to_le_bytes());
    }
    note.extend_from_slice(b"Xen\0");
    note.extend_from_slice(&ENTRY.to_le_bytes());
    let (note_at, code_at) = (0x100u64, 0x200u64);

    let mut elf = Vec::new();
    elf.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0]);
    elf.extend_from_slice(&[0; 8]);
    elf.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    elf.extend_from_slice(&0x3eu16.to_le_bytes()); // x86-64
    elf.extend_from_slice(&1u32.to_le_bytes());
    elf.extend_from_slice(&u64::from(ENTRY).to_le_bytes());
    elf.extend_from_slice(&64u64.to_le_bytes()); // program headers
    elf.extend_from_slice(&0u64.to_le_bytes()); // no section headers
    elf.extend_from_slice(&0u32.to_le_bytes());
    for v in [64u16, 56, 2, 64, 0, 0] {
        elf.extend_from_slice(&v.to_le_bytes());
    }
    // type, flags, offset, vaddr, paddr, filesz, memsz, align
    let phdr = |elf: &mut Vec<u8>, kind: u32, flags: u32, at: u64, addr: u64, len: u64| {
        elf.extend_from_slice(&kind.to_le_bytes());
        elf.extend_from_slice(&flags.to_le_bytes());
        for v in [at, addr, addr, len, len, 4] {
            elf.extend_from_slice(&v.to_le_bytes());
        }
    };
    phdr(&mut elf, 1, 5, code_at, u64::from(ENTRY), code.len() as u64); // PT_LOAD, R+X
    phdr(&mut elf, 4, 4, note_at, 0, note.len() as u64); // PT_NOTE
    elf.resize(note_at as usize, 0);
    elf.extend_from_slice(&note);
    elf.resize(code_at as usize, 0);
    elf.extend_from_slice(code);
    std::fs::write(path, elf).unwrap();
}
