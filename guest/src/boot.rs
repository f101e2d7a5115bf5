//! The CPL0 bootstrap: PVH entry in 32-bit protected mode, long mode, then
//! down to CPL3 with IOPL=3 and interrupts off.
//!
//! On kemari's KVM (PVM) every CPL0 instruction is emulated (~3 µs each), so
//! this path is straight-line code of about a hundred instructions: the page
//! tables are assembled at build time (see `paging.rs`), the IDT contents are
//! filled in later at CPL3 (`idt.rs`), and the only memory written at CPL0
//! is the TSS descriptor.
//!
//! GDT selectors: 0x08 kernel code (64-bit), 0x10 kernel data, 0x18 user
//! data, 0x20 user code (64-bit), 0x28 the TSS. CPL3 runs with CS 0x23,
//! SS/DS/ES 0x1b and RFLAGS 0x3002 (IOPL=3, IF=0). PVM forces IOPL to 0
//! at CPL3 nonetheless; the #GP stub in `idt.rs` then performs the port
//! access at CPL0.

use core::arch::global_asm;

global_asm!(
    r#"
    /* PVH: the VMM enters at this 32-bit address (Xen's ELF note 18). */
    .pushsection .note.Xen, "a", @note
    .balign 4
    .long 4                 /* name size: "Xen\0" */
    .long 8                 /* descriptor size */
    .long 18                /* XEN_ELFNOTE_PHYS32_ENTRY */
    .asciz "Xen"
    .quad pvh_entry32
    .popsection

    .pushsection .text.boot, "ax"
    .code32
    .global pvh_entry32
pvh_entry32:
    cli
    cld
    mov %ebx, %edi                  /* hvm_start_info; cpuid clobbers ebx */
    lgdt gdt_ptr

    /* CR4: PAE, OSFXSR, OSXMMEXCPT (SSE usable). */
    mov %cr4, %eax
    or $((1 << 5) | (1 << 9) | (1 << 10)), %eax
    mov %eax, %cr4

    /* 1 GiB pages above 4 GiB if the CPU has them, else 2 MiB pages. */
    mov $pml4_2m, %esi
    mov $0x80000000, %eax
    cpuid
    cmp $0x80000001, %eax
    jb 1f
    mov $0x80000001, %eax
    cpuid
    bt $26, %edx
    jnc 1f
    mov $pml4_1g, %esi
1:  mov %esi, %cr3

    /* EFER.LME */
    mov $0xc0000080, %ecx
    rdmsr
    or $(1 << 8), %eax
    wrmsr

    /* CR0: PG, MP; clear EM (SSE) and TS. */
    mov %cr0, %eax
    or $((1 << 31) | (1 << 1) | 1), %eax
    and $~((1 << 2) | (1 << 3)), %eax
    mov %eax, %cr0
    ljmp $0x08, $entry64

    .code64
entry64:
    mov $0x10, %eax
    mov %eax, %ds
    mov %eax, %es
    mov %eax, %ss
    xor %eax, %eax
    mov %eax, %fs
    mov %eax, %gs
    mov $kernel_stack_top, %rsp

    /* TSS descriptor: base split over three fields, limit 0x67, type 0x89. */
    mov $tss, %eax
    mov %rax, %rdx
    shl $16, %rdx
    mov $0xffffff0000, %rcx
    and %rcx, %rdx
    mov %rax, %rcx
    shr $24, %rcx
    shl $56, %rcx
    or %rcx, %rdx
    mov $0x0000890000000067, %rcx
    or %rcx, %rdx
    mov %rdx, gdt_tss
    mov $0x28, %eax
    ltr %ax
    lidt idt_ptr

    /* kvmclock: CPUID 0x40000000 "KVMKVMKVM", 0x40000001 EAX bit 3. */
    mov $0x40000000, %eax
    cpuid
    cmp $0x4b4d564b, %ebx
    jne 2f
    cmp $0x40000001, %eax
    jb 2f
    mov $0x40000001, %eax
    cpuid
    bt $3, %eax
    jnc 2f
    mov $0x4b564d01, %ecx
    mov $pvclock, %eax
    or $1, %eax
    xor %edx, %edx
    wrmsr
    movl $1, kvmclock_enabled
2:
    /* Down to CPL3: IOPL=3, IF=0; rust_start(start_info). */
    mov $0x1b, %eax
    mov %eax, %ds
    mov %eax, %es
    mov %edi, %edi
    push $0x1b
    mov $user_stack_top - 8, %rax
    push %rax
    push $0x3002
    push $0x23
    mov $rust_start, %rax
    push %rax
    iretq
    .popsection

    /* Writable: the CPU sets the TSS busy bit, CPL0 fills in its base. */
    .pushsection .data.gdt, "aw"
    .balign 16
gdt:
    .quad 0
    .quad 0x00af9a000000ffff        /* 0x08 kernel code, 64-bit */
    .quad 0x00cf92000000ffff        /* 0x10 kernel data */
    .quad 0x00cff2000000ffff        /* 0x18 user data */
    .quad 0x00affa000000ffff        /* 0x20 user code, 64-bit */
gdt_tss:
    .quad 0                         /* 0x28 TSS, 16 bytes */
    .quad 0
    .popsection

    .pushsection .rodata.gdt_ptr, "a"
    .balign 8
gdt_ptr:
    .word 7 * 8 - 1
    .quad gdt
    .balign 8
    .global idt_ptr
idt_ptr:
    .word 256 * 16 - 1
    .quad idt
    .popsection

    .pushsection .data.tss, "aw"
    .balign 16
tss:
    .long 0
    .quad kernel_stack_top          /* RSP0: stack for exceptions from CPL3 */
    .fill 23, 4, 0
    .word 0
    .word 104                       /* no I/O bitmap: IOPL=3 grants ports */
    .popsection

    .pushsection .bss.stacks, "aw", @nobits
    .balign 4096
    .space 16384
    .global kernel_stack_top
kernel_stack_top:
    .space 262144
    .global user_stack_top
user_stack_top:
    .space 65536
    .global fault_stack_top
fault_stack_top:
    .balign 4096
    .global idt
idt:
    .space 256 * 16
    .balign 64
    .global pvclock
pvclock:
    .space 64
    .global kvmclock_enabled
kvmclock_enabled:
    .space 8
    .popsection
    "#,
    options(att_syntax)
);
