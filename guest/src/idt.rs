//! Exceptions: the IDT and its CPL0 stubs, and the CPL3 reporter.
//!
//! The bootstrap loads IDTR with an empty table; `install` fills it in at
//! CPL3 (writing 4 KiB at CPL0 would be emulated instruction by instruction).
//! A stub runs at CPL0 only long enough to read CR2 and `iretq` into
//! `guest_fault` at CPL3 on a stack of its own, which prints
//! `fault: <name> vector=<n> rip=<hex> addr=<hex> error=<hex>` and exits.
//! `hlt` at CPL3 is the exit path's last resort when no exit device
//! answered: the #GP stub sees it and triple-faults (empty IDT, unmapped
//! stack), which resets the machine (or, with QEMU's `-no-reboot`, stops
//! it). A software-interrupt gate would be simpler, but PVM does not
//! deliver `int n` from CPL3 through the guest's IDT.

use core::arch::global_asm;
use core::sync::atomic::{AtomicBool, Ordering};

use crate::exit::{exit, ExitCode};

global_asm!(
    r#"
    .pushsection .text.isr, "ax"
    .macro isr_noerr n
isr_\n:
    push $0
    push $\n
    jmp isr_common
    .endm
    .macro isr_err n
isr_\n:
    push $\n
    jmp isr_common
    .endm

    isr_noerr 0
    isr_noerr 1
    isr_noerr 2
    isr_noerr 3
    isr_noerr 4
    isr_noerr 5
    isr_noerr 6
    isr_noerr 7
    isr_err 8
    isr_noerr 9
    isr_err 10
    isr_err 11
    isr_err 12
    /* #GP: PVM runs CPL3 with IOPL forced to 0, so port I/O from CPL3
       traps here; perform the forms the guest uses (cpu.rs) at CPL0,
       where the registers still hold the CPL3 values, and skip the
       instruction. `rep outsb` (the console) goes out as one string I/O
       exit, and its updated rcx/rsi go back to CPL3. `hlt` is the exit
       path's last resort. Anything else is a real fault. */
isr_13:
    push %rcx
    mov 16(%rsp), %rcx              /* rcx, error, rip, cs, ... */
    cmpb $0xee, (%rcx)
    je 1f
    cmpb $0xef, (%rcx)
    je 2f
    cmpb $0xec, (%rcx)
    je 3f
    cmpw $0x6ef3, (%rcx)
    je 5f
    cmpb $0xf4, (%rcx)
    je triple_fault
    pop %rcx
    push $13
    jmp isr_common
1:  out %al, %dx
    jmp 4f
2:  out %eax, %dx
    jmp 4f
3:  in %dx, %al
4:  incq 16(%rsp)
    pop %rcx
    add $8, %rsp
    iretq
5:  mov (%rsp), %rcx
    rep outsb
    mov %rcx, (%rsp)
    addq $2, 16(%rsp)
    pop %rcx
    add $8, %rsp
    iretq
    isr_err 14
    isr_noerr 15
    isr_noerr 16
    isr_err 17
    isr_noerr 18
    isr_noerr 19
    isr_noerr 20
    isr_err 21
    isr_noerr 22
    isr_noerr 23
    isr_noerr 24
    isr_noerr 25
    isr_noerr 26
    isr_noerr 27
    isr_noerr 28
    isr_err 29
    isr_err 30
    isr_noerr 31

    /* Stack: vector, error, rip, cs, rflags, rsp, ss. Rewrite the frame to
       return to guest_fault(vector, rip, cr2, error, cs, rsp) at CPL3. */
isr_common:
    pop %rdi
    pop %rcx
    mov (%rsp), %rsi
    mov %cr2, %rdx
    mov 8(%rsp), %r8
    mov 24(%rsp), %r9
    mov $guest_fault, %rax
    mov %rax, (%rsp)
    movq $0x23, 8(%rsp)
    movq $0x3002, 16(%rsp)
    mov $fault_stack_top - 8, %rax
    mov %rax, 24(%rsp)
    movq $0x1b, 32(%rsp)
    iretq

triple_fault:
    lidt empty_idt_ptr
    mov $0x8000000000, %rsp         /* unmapped: no exception frame fits */
    ud2

    .popsection

    "#,
    options(att_syntax)
);

// `.rept` cannot name `isr_<n>` per iteration, so the table of stub
// addresses is spelled out here.
global_asm!(
    r#"
    .pushsection .rodata.isr_addrs, "a"
    .balign 8
    .global isr_addrs
isr_addrs:
    .quad isr_0, isr_1, isr_2, isr_3, isr_4, isr_5, isr_6, isr_7
    .quad isr_8, isr_9, isr_10, isr_11, isr_12, isr_13, isr_14, isr_15
    .quad isr_16, isr_17, isr_18, isr_19, isr_20, isr_21, isr_22, isr_23
    .quad isr_24, isr_25, isr_26, isr_27, isr_28, isr_29, isr_30, isr_31
    .balign 8
empty_idt_ptr:
    .word 0
    .quad 0
    .popsection
    "#,
    options(att_syntax)
);

extern "C" {
    static isr_addrs: [u64; 32];
    static mut idt: [u64; 512];
}

const KERNEL_CS: u64 = 0x08;
/// Present, interrupt gate, DPL 0.
const GATE_DPL0: u64 = 0x8e;

fn gate(handler: u64, attrs: u64) -> (u64, u64) {
    let low =
        (handler & 0xffff) | (KERNEL_CS << 16) | (attrs << 40) | ((handler >> 16) & 0xffff) << 48;
    (low, handler >> 32)
}

/// Fills in the IDT that the bootstrap loaded. Runs once, first thing at
/// CPL3, before anything can fault.
pub fn install() {
    // SAFETY: `idt` is the 4 KiB table defined in boot.rs, mapped
    // user-writable, and nothing else accesses it while it is written (no
    // interrupts, one vCPU). `isr_addrs` is read-only data from the asm above.
    unsafe {
        let table = &mut *core::ptr::addr_of_mut!(idt);
        let addrs = &*core::ptr::addr_of!(isr_addrs);
        for (vector, &handler) in addrs.iter().enumerate() {
            let (low, high) = gate(handler, GATE_DPL0);
            table[vector * 2] = low;
            table[vector * 2 + 1] = high;
        }
    }
}

fn exception_name(vector: u64) -> &'static str {
    match vector {
        0 => "divide error",
        1 => "debug",
        2 => "nmi",
        3 => "breakpoint",
        4 => "overflow",
        5 => "bound range exceeded",
        6 => "invalid opcode",
        7 => "device not available",
        8 => "double fault",
        10 => "invalid tss",
        11 => "segment not present",
        12 => "stack fault",
        13 => "general protection",
        14 => "page fault",
        16 => "x87 floating point",
        17 => "alignment check",
        18 => "machine check",
        19 => "simd floating point",
        20 => "virtualization",
        21 => "control protection",
        _ => "reserved",
    }
}

static IN_FAULT: AtomicBool = AtomicBool::new(false);

/// Entered at CPL3 from `isr_common` on the fault stack.
#[no_mangle]
extern "C" fn guest_fault(vector: u64, rip: u64, addr: u64, error: u64, cs: u64, rsp: u64) -> ! {
    if !IN_FAULT.swap(true, Ordering::Relaxed) {
        crate::say!(
            "fault: {} vector={} rip={:#x} addr={:#x} error={:#x}",
            exception_name(vector),
            vector,
            rip,
            addr,
            error
        );
        crate::say!("fault: cpl={} rsp={:#x}", cs & 3, rsp);
    }
    exit(ExitCode::Fault)
}
