//! The guest's Rust entry point at CPL3 and its main polling loop.

use guest::cmdline::{self, Config, FaultKind};

use crate::exit::{exit, poweroff, reboot, ExitCode};
use crate::net::NetStack;
use crate::say;
use crate::start_info::BootInfo;
use crate::virtio::blk::Blk;
use crate::virtio::mmio::{MmioTransport, Probe};
use crate::virtio::net::VirtioNet;
use crate::virtio::pmem::{self, Pmem};
use crate::workloads::counter::Counter;
use crate::workloads::dirty::Dirty;
use crate::workloads::disk::DiskRunner;
use crate::workloads::pmem::PmemRunner;

/// The devices found on the command line.
struct Devices {
    blk: Option<Blk>,
    net: Option<VirtioNet>,
    pmem: Option<Pmem>,
}

/// Probes each `virtio_mmio.device=` slot and brings up the first block,
/// the first network and the first pmem device.
fn probe_devices(cfg: &Config) -> Devices {
    let mut devs = Devices {
        blk: None,
        net: None,
        pmem: None,
    };
    for d in cfg.devices() {
        if d.base.saturating_add(d.size) > 1 << 32 {
            say!(
                "cmdline error: virtio_mmio.device={:#x}@{:#x}:{}: above 4 GiB",
                d.size,
                d.base,
                d.irq
            );
            exit(ExitCode::CmdlineError);
        }
        // SAFETY: the VMM announced a virtio-mmio window at this address
        // (below 4 GiB, so mapped); each window gets one transport.
        let t = unsafe { MmioTransport::new(d.base) };
        let probe = t.probe();
        match probe {
            Probe::Device(2) if devs.blk.is_none() => match Blk::new(t) {
                Ok(b) => {
                    say!(
                        "virtio: blk at {:#x} irq={} blocks={} flush={}",
                        d.base,
                        d.irq,
                        b.capacity_blocks(),
                        b.has_flush()
                    );
                    devs.blk = Some(b);
                }
                Err(e) => say!("virtio: blk at {:#x}: {}", d.base, e),
            },
            Probe::Device(1) if devs.net.is_none() => match VirtioNet::new(t) {
                Ok(n) => {
                    say!("virtio: net at {:#x} irq={}", d.base, d.irq);
                    devs.net = Some(n);
                }
                Err(e) => say!("virtio: net at {:#x}: {}", d.base, e),
            },
            Probe::Device(pmem::DEVICE_ID) if devs.pmem.is_none() => match Pmem::new(t) {
                Ok(p) => {
                    say!(
                        "virtio: pmem at {:#x} irq={} start={:#x} size={}",
                        d.base,
                        d.irq,
                        p.start(),
                        p.size()
                    );
                    devs.pmem = Some(p);
                }
                Err(e) => say!("virtio: pmem at {:#x}: {}", d.base, e),
            },
            Probe::Empty => {}
            other => say!("virtio: {:#x}: skipped ({:?})", d.base, other),
        }
    }
    devs
}

/// Entered at CPL3 from the bootstrap with the PVH start info's address.
#[no_mangle]
extern "C" fn rust_start(start_info: u64) -> ! {
    crate::idt::install();
    say!("kemari-guest: hello");
    let clock = crate::time::init();

    let mut info = BootInfo::empty();
    // SAFETY: `start_info` is the address the VMM passed in ebx.
    if let Err(e) = unsafe { crate::start_info::read(start_info, &mut info) } {
        say!("boot error: start info at {:#x}: {}", start_info, e);
        exit(ExitCode::DeviceError);
    }
    let cfg = match cmdline::parse(info.cmdline()) {
        Ok(cfg) => cfg,
        Err(e) => {
            say!("cmdline error: {}", e);
            exit(ExitCode::CmdlineError);
        }
    };
    crate::mem::init(info.ram(), crate::paging::mapped_limit());
    say!(
        "boot: ram_mib={} clock={} tsc_khz={} uptime_us={}",
        info.ram_bytes() >> 20,
        clock.name(),
        crate::time::tsc_khz(),
        crate::time::now_us()
    );
    run(&cfg)
}

/// `fault=`: fault on purpose (tests the fault report).
fn fault(kind: FaultKind) -> ! {
    match kind {
        FaultKind::Page => {
            // 512 GiB: past every mapping the page tables make.
            let addr = crate::paging::MAPPED_WITH_1G_PAGES as *const u64;
            // SAFETY: not safe at all: this read faults on purpose; the
            // fault handler reports it and exits, so it never returns.
            let v = unsafe { core::ptr::read_volatile(addr) };
            say!("fault=page: read {:#x} did not fault", v);
        }
        FaultKind::InvalidOpcode => {
            // SAFETY: `ud2` raises #UD on purpose; the handler never returns.
            unsafe { core::arch::asm!("ud2") };
        }
    }
    exit(ExitCode::Fault)
}

fn run(cfg: &Config) -> ! {
    if let Some(kind) = cfg.fault {
        fault(kind);
    }
    let devs = probe_devices(cfg);
    let mut blk = devs.blk;
    let mut disk = match (&blk, cfg.disk_jobs().next()) {
        (_, None) => None,
        (Some(b), Some(_)) => Some(DiskRunner::new(cfg, b, crate::time::now_ms())),
        (None, Some(_)) => {
            say!("cmdline error: disk=: no virtio-blk device found");
            exit(ExitCode::CmdlineError);
        }
    };
    let mut pmem = devs.pmem;
    let mut pmem_jobs = match (&pmem, cfg.pmem_jobs().next()) {
        (_, None) => None,
        (Some(_), Some(_)) => Some(PmemRunner::new(cfg)),
        (None, Some(_)) => {
            say!("cmdline error: pmem=: no virtio-pmem device found");
            exit(ExitCode::CmdlineError);
        }
    };
    let mut net = match (devs.net, cfg.ip) {
        (Some(dev), Some(ip)) => Some(NetStack::new(dev, ip, cfg.gw, crate::time::now_us())),
        (Some(_), None) => {
            say!("net: no ip= on the command line; network off");
            None
        }
        (None, Some(_)) => {
            say!("cmdline error: ip=: no virtio-net device found");
            exit(ExitCode::CmdlineError);
        }
        (None, None) => None,
    };
    let mut counter = cfg
        .counter_ms
        .map(|ms| Counter::new(ms, crate::time::now_ms()));
    let mut dirty = cfg.dirty.map(|spec| {
        let bytes = spec.mib << 20;
        let Some(base) = crate::mem::alloc_phys(bytes, 2 << 20) else {
            say!(
                "cmdline error: dirty={},{}: no contiguous RAM that large ({} MiB free in all)",
                spec.pages_per_s,
                spec.mib,
                crate::mem::free_bytes() >> 20
            );
            exit(ExitCode::CmdlineError);
        };
        let random = spec.order == cmdline::Order::Random;
        // Where it is, so a test can damage it through the memory file and
        // see the check catch it.
        say!("dirty: working set at {:#x}, {} MiB", base, spec.mib);
        Dirty::new(
            base,
            bytes / 4096,
            spec.pages_per_s,
            random,
            crate::time::now_ns(),
        )
    });

    // The longest stall of this loop since the last counter line, not
    // counting the cost of printing that line (see counter.rs).
    let mut last_turn_ns = crate::time::now_ns();
    let mut longest_stall_ns = 0;
    let mut cheapest_print_ns = u64::MAX;
    let mut printed_at_ns = None;
    loop {
        let now_ns = crate::time::now_ns();
        let now_ms = now_ns / 1_000_000;
        let mut turn_ns = now_ns.saturating_sub(last_turn_ns);
        if let Some(at) = printed_at_ns.take() {
            // The last turn printed: `at` is when its line was written.
            cheapest_print_ns = cheapest_print_ns.min(now_ns.saturating_sub(at));
            turn_ns = turn_ns.saturating_sub(cheapest_print_ns);
        }
        longest_stall_ns = longest_stall_ns.max(turn_ns);
        last_turn_ns = now_ns;
        if let Some(c) = counter.as_mut() {
            if c.poll(now_ns / 1000, longest_stall_ns / 1000) {
                longest_stall_ns = 0;
                printed_at_ns = Some(now_ns);
            }
        }
        if let Some(d) = dirty.as_mut() {
            d.poll(now_ns);
        }
        if let (Some(d), Some(b)) = (disk.as_mut(), blk.as_mut()) {
            d.poll(b, now_ms);
        }
        if let (Some(j), Some(p)) = (pmem_jobs.as_mut(), pmem.as_mut()) {
            j.poll(p, now_ms);
        }
        if let Some(n) = net.as_mut() {
            n.poll(now_ns / 1000);
        }
        let disk_done = disk.as_ref().is_none_or(|d| d.done());
        let pmem_done = pmem_jobs.as_ref().is_none_or(|j| j.done());
        if cfg.poweroff_done && disk_done && pmem_done {
            if disk.as_ref().is_some_and(|d| d.failed())
                || pmem_jobs.as_ref().is_some_and(|j| j.failed())
            {
                exit(ExitCode::VerifyFailed);
            }
            poweroff();
        }
        if cfg.poweroff_after_ms.is_some_and(|ms| now_ms >= ms) {
            poweroff();
        }
        if cfg.reboot_after_ms.is_some_and(|ms| now_ms >= ms)
            || net.as_ref().is_some_and(|n| n.reboot_due(now_ms))
        {
            reboot();
        }
        core::hint::spin_loop();
    }
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    say!("panic: {}", info);
    exit(ExitCode::Panic)
}
