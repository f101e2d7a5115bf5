//! kemari's test guest: a PVH ELF whose tiny CPL0 bootstrap (`boot.rs`)
//! drops to CPL3, where everything else runs and polls: serial console,
//! virtio-mmio block and net drivers, a smoltcp TCP/IP stack with echo and
//! HTTP services, and the `counter`, `dirty` and `disk` workloads.
//! See docs/test-guest.md.
#![no_std]
#![no_main]

extern crate alloc;

mod boot;
mod cpu;
mod exit;
mod idt;
mod mem;
mod paging;
mod serial;
mod start_info;
mod time;
mod workloads;

use guest::cmdline::{self, Config};

use crate::exit::{exit, poweroff, ExitCode};
use crate::start_info::BootInfo;
use crate::workloads::counter::Counter;
use crate::workloads::dirty::Dirty;

/// Entered at CPL3 from the bootstrap with the PVH start info's address.
#[no_mangle]
extern "C" fn rust_start(start_info: u64) -> ! {
    idt::install();
    say!("kemari-guest: hello");
    let clock = time::init();

    let mut info = BootInfo::empty();
    // SAFETY: `start_info` is the address the VMM passed in ebx.
    if let Err(e) = unsafe { start_info::read(start_info, &mut info) } {
        say!("boot error: start info at {:#x}: {:?}", start_info, e);
        exit(ExitCode::DeviceError);
    }
    let cfg = match cmdline::parse(info.cmdline()) {
        Ok(cfg) => cfg,
        Err(e) => {
            say!("cmdline error: {}", e);
            exit(ExitCode::CmdlineError);
        }
    };
    mem::init(info.ram(), paging::mapped_limit());
    say!(
        "boot: ram_mib={} clock={} tsc_khz={} uptime_us={}",
        info.ram_bytes() >> 20,
        clock.name(),
        time::tsc_khz(),
        time::now_us()
    );
    run(&cfg)
}

fn run(cfg: &Config) -> ! {
    let mut counter = cfg.counter_ms.map(|ms| Counter::new(ms, time::now_ms()));
    let mut dirty = cfg.dirty.map(|spec| {
        let bytes = spec.mib << 20;
        let Some(base) = mem::alloc_phys(bytes, 2 << 20) else {
            say!(
                "cmdline error: dirty={},{}: working set larger than free RAM ({} MiB free)",
                spec.pages_per_s,
                spec.mib,
                mem::free_bytes() >> 20
            );
            exit(ExitCode::CmdlineError);
        };
        Dirty::new(base, bytes / 4096, spec.pages_per_s, time::now_ns())
    });

    loop {
        let now_ns = time::now_ns();
        let now_ms = now_ns / 1_000_000;
        if let Some(c) = counter.as_mut() {
            c.poll(now_ms);
        }
        if let Some(d) = dirty.as_mut() {
            d.poll(now_ns);
        }
        if cfg.poweroff_done {
            poweroff();
        }
        if cfg.poweroff_after_ms.is_some_and(|ms| now_ms >= ms) {
            poweroff();
        }
        core::hint::spin_loop();
    }
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    say!("panic: {}", info);
    exit(ExitCode::Panic)
}
