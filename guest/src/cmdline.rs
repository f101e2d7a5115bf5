//! The guest's kernel command line: which devices exist (passed by the VMM)
//! and which workloads and services to run. The format is documented in
//! docs/test-guest.md; parameters that are not the guest's own (`console=`,
//! `root=`, ...) are ignored, malformed values of its own are errors.

use core::fmt;

use crate::num::{parse_size, parse_u64};

/// Most virtio-mmio devices the guest accepts on its command line.
pub const MAX_DEVICES: usize = 8;
/// Most `disk=` jobs the guest accepts; they run in the order given.
pub const MAX_DISK_JOBS: usize = 4;
/// Most `pmem=` jobs the guest accepts; they run in the order given.
pub const MAX_PMEM_JOBS: usize = 4;

/// One `virtio_mmio.device=<size>@<base>:<irq>` parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmioDevice {
    pub base: u64,
    pub size: u64,
    pub irq: u32,
}

/// `dirty=<pages_per_s>,<MiB>[,seq|rand]`: a rate of 0 means "as fast as
/// possible"; pages are visited in order unless `rand`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirtySpec {
    pub pages_per_s: u64,
    pub mib: u64,
    pub order: Order,
}

/// Order in which `disk=write` visits blocks and `dirty` visits pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    Sequential,
    Random,
}

/// One `disk=` job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskJob {
    /// `disk=write,<blocks>,seq|rand[,flush][,burst=<n>/<ms>][,next]`: with
    /// `burst`, `n` blocks are written every `ms` milliseconds (the way an
    /// OS writes its file cache back), otherwise as fast as the disk goes.
    /// With `next`, sequence numbers continue after the highest one the
    /// boot's last verify read (a new generation of the data each boot).
    Write {
        blocks: u64,
        order: Order,
        flush: bool,
        burst: Option<Burst>,
        next: bool,
    },
    /// `disk=verify,<blocks>`: checks blocks 0..blocks.
    Verify { blocks: u64 },
}

/// One `pmem=` job, on the first virtio-pmem device's window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PmemJob {
    /// `pmem=verify`: checks that the window holds a whole generation.
    Verify,
    /// `pmem=write[,next]`: writes a generation over the window, then
    /// flushes it: generation 1, or with `next` one past the generation the
    /// boot's last verify read (1 if it read none).
    Write { next: bool },
}

/// Paced writing: `blocks` blocks every `period_ms` milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Burst {
    pub blocks: u64,
    pub period_ms: u64,
}

/// An IPv4 address with its prefix length, `a.b.c.d/prefix`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ipv4Cidr {
    pub addr: [u8; 4],
    pub prefix: u8,
}

/// `fault=<kind>`: fault on purpose, to test the fault path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// `fault=page`: read an unmapped address (512 GiB).
    Page,
    /// `fault=ud`: execute `ud2`.
    InvalidOpcode,
}

/// Everything the command line asks of the guest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    pub devices: [Option<MmioDevice>; MAX_DEVICES],
    pub counter_ms: Option<u64>,
    pub dirty: Option<DirtySpec>,
    pub disk_jobs: [Option<DiskJob>; MAX_DISK_JOBS],
    pub pmem_jobs: [Option<PmemJob>; MAX_PMEM_JOBS],
    pub ip: Option<Ipv4Cidr>,
    pub gw: Option<[u8; 4]>,
    /// `poweroff=done`: power off once the finite workloads (disk and pmem
    /// jobs) end.
    pub poweroff_done: bool,
    /// `poweroff_after=<ms>`: power off at this uptime.
    pub poweroff_after_ms: Option<u64>,
    /// `reboot_after=<ms>`: ask for a reset (i8042) at this uptime, on
    /// every boot.
    pub reboot_after_ms: Option<u64>,
    pub fault: Option<FaultKind>,
    /// `disk_errors=continue`: a failed disk request ends the disk jobs with a
    /// report instead of failing the guest (the other workloads go on).
    pub disk_errors_continue: bool,
}

impl Config {
    pub fn devices(&self) -> impl Iterator<Item = MmioDevice> + '_ {
        self.devices.iter().flatten().copied()
    }

    pub fn disk_jobs(&self) -> impl Iterator<Item = DiskJob> + '_ {
        self.disk_jobs.iter().flatten().copied()
    }

    pub fn pmem_jobs(&self) -> impl Iterator<Item = PmemJob> + '_ {
        self.pmem_jobs.iter().flatten().copied()
    }
}

/// A malformed parameter: `cmdline error: <param>=<value>: <expected>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmdlineError<'a> {
    pub param: &'a str,
    pub value: &'a str,
    pub expected: &'static str,
}

impl fmt::Display for CmdlineError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}: {}", self.param, self.value, self.expected)
    }
}

/// Parses the whole command line.
pub fn parse(cmdline: &str) -> Result<Config, CmdlineError<'_>> {
    let mut cfg = Config::default();
    for token in cmdline.split_ascii_whitespace() {
        let (key, value) = match token.split_once('=') {
            Some(kv) => kv,
            None => (token, ""),
        };
        let err = |expected| CmdlineError {
            param: key,
            value,
            expected,
        };
        match key {
            "virtio_mmio.device" => {
                const WANT: &str = "expected <size>@<base>:<irq>";
                let dev = parse_mmio_device(value).ok_or(err(WANT))?;
                push(&mut cfg.devices, dev).ok_or(err("too many virtio_mmio devices"))?;
            }
            "counter" => {
                let ms = parse_u64(value)
                    .filter(|&ms| ms > 0)
                    .ok_or(err("expected a period in ms > 0"))?;
                cfg.counter_ms = Some(ms);
            }
            "dirty" => {
                cfg.dirty = Some(
                    parse_dirty(value)
                        .ok_or(err("expected <pages_per_s>,<MiB>[,seq|rand] with MiB > 0"))?,
                );
            }
            "disk" => {
                const WANT: &str =
                    "expected write,<blocks>,seq|rand[,flush][,burst=<n>/<ms>][,next] or verify,<blocks>";
                let job = parse_disk(value).ok_or(err(WANT))?;
                push(&mut cfg.disk_jobs, job).ok_or(err("too many disk jobs"))?;
            }
            "pmem" => {
                let job = match value {
                    "verify" => PmemJob::Verify,
                    "write" => PmemJob::Write { next: false },
                    "write,next" => PmemJob::Write { next: true },
                    _ => return Err(err("expected verify, write or write,next")),
                };
                push(&mut cfg.pmem_jobs, job).ok_or(err("too many pmem jobs"))?;
            }
            "ip" => cfg.ip = Some(parse_cidr(value).ok_or(err("expected a.b.c.d/prefix"))?),
            "gw" => cfg.gw = Some(parse_ipv4(value).ok_or(err("expected a.b.c.d"))?),
            "poweroff" => match value {
                "done" => cfg.poweroff_done = true,
                _ => return Err(err("expected done")),
            },
            "disk_errors" => match value {
                "continue" => cfg.disk_errors_continue = true,
                "exit" => cfg.disk_errors_continue = false,
                _ => return Err(err("expected continue or exit")),
            },
            "poweroff_after" => {
                cfg.poweroff_after_ms = Some(parse_u64(value).ok_or(err("expected a time in ms"))?);
            }
            "reboot_after" => {
                cfg.reboot_after_ms = Some(parse_u64(value).ok_or(err("expected a time in ms"))?);
            }
            "fault" => {
                cfg.fault = Some(match value {
                    "page" => FaultKind::Page,
                    "ud" => FaultKind::InvalidOpcode,
                    _ => return Err(err("expected page or ud")),
                });
            }
            _ => {} // Not ours (console=, root=, ...).
        }
    }
    Ok(cfg)
}

fn push<T: Copy>(slots: &mut [Option<T>], item: T) -> Option<()> {
    let slot = slots.iter_mut().find(|s| s.is_none())?;
    *slot = Some(item);
    Some(())
}

/// `<size>@<base>:<irq>[:<id>]` (Linux's format; the optional platform
/// device id is accepted and ignored).
fn parse_mmio_device(value: &str) -> Option<MmioDevice> {
    let (size, rest) = value.split_once('@')?;
    let (base, rest) = rest.split_once(':')?;
    let irq = match rest.split_once(':') {
        Some((irq, id)) => {
            parse_u64(id)?;
            irq
        }
        None => rest,
    };
    let size = parse_size(size).filter(|&s| s > 0)?;
    let base = parse_u64(base)?;
    base.checked_add(size)?;
    Some(MmioDevice {
        base,
        size,
        irq: u32::try_from(parse_u64(irq)?).ok()?,
    })
}

fn parse_dirty(value: &str) -> Option<DirtySpec> {
    let mut parts = value.split(',');
    let pages_per_s = parse_u64(parts.next()?)?;
    let mib = parse_u64(parts.next()?).filter(|&m| m > 0 && m <= 1 << 20)?;
    let order = match parts.next() {
        None | Some("seq") => Order::Sequential,
        Some("rand") => Order::Random,
        Some(_) => return None,
    };
    match parts.next() {
        None => Some(DirtySpec {
            pages_per_s,
            mib,
            order,
        }),
        Some(_) => None,
    }
}

fn parse_disk(value: &str) -> Option<DiskJob> {
    let mut parts = value.split(',');
    let mode = parts.next()?;
    let blocks = parse_u64(parts.next()?).filter(|&b| b > 0)?;
    let job = match mode {
        "write" => {
            let order = match parts.next()? {
                "seq" => Order::Sequential,
                "rand" => Order::Random,
                _ => return None,
            };
            let mut flush = false;
            let mut burst = None;
            let mut next = false;
            for opt in parts.by_ref() {
                match opt {
                    "flush" if !flush => flush = true,
                    "next" if !next => next = true,
                    _ if burst.is_none() => {
                        let (n, ms) = opt.strip_prefix("burst=")?.split_once('/')?;
                        burst = Some(Burst {
                            blocks: parse_u64(n).filter(|&b| b > 0)?,
                            period_ms: parse_u64(ms).filter(|&m| m > 0)?,
                        });
                    }
                    _ => return None,
                }
            }
            DiskJob::Write {
                blocks,
                order,
                flush,
                burst,
                next,
            }
        }
        "verify" => DiskJob::Verify { blocks },
        _ => return None,
    };
    match parts.next() {
        None => Some(job),
        Some(_) => None,
    }
}

/// Parses `a.b.c.d`.
pub fn parse_ipv4(value: &str) -> Option<[u8; 4]> {
    let mut out = [0u8; 4];
    let mut parts = value.split('.');
    for byte in &mut out {
        let part = parts.next()?;
        if part.is_empty() || part.len() > 3 || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *byte = part.parse().ok()?;
    }
    match parts.next() {
        None => Some(out),
        Some(_) => None,
    }
}

fn parse_cidr(value: &str) -> Option<Ipv4Cidr> {
    let (addr, prefix) = value.split_once('/')?;
    let prefix = u8::try_from(parse_u64(prefix)?).ok().filter(|&p| p <= 32)?;
    Some(Ipv4Cidr {
        addr: parse_ipv4(addr)?,
        prefix,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_and_foreign_parameters() {
        assert_eq!(parse(""), Ok(Config::default()));
        assert_eq!(
            parse("console=ttyS0 root=/dev/vda quiet"),
            Ok(Config::default())
        );
    }

    #[test]
    fn kemari_and_qemu_devices() {
        let cfg =
            parse("virtio_mmio.device=4K@0xd0000000:5 virtio_mmio.device=512@0xfeb00e00:12:3")
                .unwrap();
        let devs: std::vec::Vec<_> = cfg.devices().collect();
        assert_eq!(
            devs,
            [
                MmioDevice {
                    base: 0xd000_0000,
                    size: 4096,
                    irq: 5
                },
                MmioDevice {
                    base: 0xfeb0_0e00,
                    size: 512,
                    irq: 12
                },
            ]
        );
    }

    #[test]
    fn workloads() {
        let cfg = parse(
            "counter=100 dirty=20000,1024 disk=write,10000,rand,flush disk=verify,10000 \
             ip=10.0.2.15/24 gw=10.0.2.1 poweroff=done poweroff_after=5000 reboot_after=300",
        )
        .unwrap();
        assert_eq!(cfg.counter_ms, Some(100));
        assert_eq!(
            cfg.dirty,
            Some(DirtySpec {
                pages_per_s: 20000,
                mib: 1024,
                order: Order::Sequential
            })
        );
        assert_eq!(
            parse("dirty=0,64,rand").unwrap().dirty,
            Some(DirtySpec {
                pages_per_s: 0,
                mib: 64,
                order: Order::Random
            })
        );
        let jobs: std::vec::Vec<_> = cfg.disk_jobs().collect();
        assert_eq!(
            jobs,
            [
                DiskJob::Write {
                    blocks: 10000,
                    order: Order::Random,
                    flush: true,
                    burst: None,
                    next: false,
                },
                DiskJob::Verify { blocks: 10000 }
            ]
        );
        assert_eq!(
            cfg.ip,
            Some(Ipv4Cidr {
                addr: [10, 0, 2, 15],
                prefix: 24
            })
        );
        assert_eq!(cfg.gw, Some([10, 0, 2, 1]));
        assert!(cfg.poweroff_done);
        assert_eq!(cfg.poweroff_after_ms, Some(5000));
        assert_eq!(cfg.reboot_after_ms, Some(300));
        assert_eq!(parse("").unwrap().reboot_after_ms, None);
        assert_eq!(cfg.fault, None);
        assert_eq!(parse("fault=page").unwrap().fault, Some(FaultKind::Page));
        assert_eq!(
            parse("fault=ud").unwrap().fault,
            Some(FaultKind::InvalidOpcode)
        );
    }

    #[test]
    fn malformed_values_are_errors() {
        for bad in [
            "counter=",
            "counter=0",
            "counter=abc",
            "dirty=100",
            "dirty=100,0",
            "dirty=x,1",
            "dirty=1,1,sideways",
            "dirty=1,1,rand,more",
            "disk=write,10",
            "disk=write,10,sideways",
            "disk=write,10,seq,flush,extra",
            "disk=write,10,seq,flush,flush",
            "disk=write,10,seq,next,next",
            "disk=write,10,seq,burst=0/10",
            "disk=write,10,seq,burst=4/0",
            "disk=write,10,seq,burst=4",
            "disk=write,10,seq,burst=4/10,burst=4/10",
            "disk=verify",
            "disk=verify,0",
            "disk=erase,10",
            "ip=10.0.2.15",
            "ip=10.0.2.256/24",
            "ip=10.0.2.15/33",
            "gw=1.2.3",
            "poweroff=now",
            "poweroff_after=soon",
            "reboot_after=",
            "fault=",
            "fault=maybe",
            "pmem=",
            "pmem=read",
            "pmem=verify,1",
            "pmem=write,",
            "pmem=write,next,next",
            "pmem=write,flush",
            "virtio_mmio.device=4K@0xd0000000",
            "virtio_mmio.device=0@0xd0000000:5",
            "virtio_mmio.device=4K@zz:5",
        ] {
            assert!(parse(bad).is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn pmem_jobs_run_in_order() {
        let cfg = parse("pmem=verify pmem=write,next pmem=write").unwrap();
        assert_eq!(
            cfg.pmem_jobs().collect::<Vec<_>>(),
            [
                PmemJob::Verify,
                PmemJob::Write { next: true },
                PmemJob::Write { next: false }
            ]
        );
        assert_eq!(parse("").unwrap().pmem_jobs().next(), None);
        let line = "pmem=verify ".repeat(MAX_PMEM_JOBS + 1);
        assert_eq!(parse(&line).unwrap_err().expected, "too many pmem jobs");
    }

    #[test]
    fn a_write_may_continue_the_sequence() {
        let cfg = parse("disk=verify,8 disk=write,8,seq,flush,next").unwrap();
        assert_eq!(
            cfg.disk_jobs().nth(1),
            Some(DiskJob::Write {
                blocks: 8,
                order: Order::Sequential,
                flush: true,
                burst: None,
                next: true,
            })
        );
    }

    #[test]
    fn paced_writes() {
        let cfg =
            parse("disk=write,100,seq,burst=16/250 disk=write,5,rand,burst=1/1,flush").unwrap();
        assert_eq!(
            cfg.disk_jobs().collect::<Vec<_>>(),
            [
                DiskJob::Write {
                    blocks: 100,
                    order: Order::Sequential,
                    flush: false,
                    burst: Some(Burst {
                        blocks: 16,
                        period_ms: 250
                    }),
                    next: false,
                },
                DiskJob::Write {
                    blocks: 5,
                    order: Order::Random,
                    flush: true,
                    burst: Some(Burst {
                        blocks: 1,
                        period_ms: 1
                    }),
                    next: false,
                },
            ]
        );
    }

    #[test]
    fn error_message_names_the_parameter() {
        let err = parse("counter=10 dirty=fast").unwrap_err();
        assert_eq!(err.param, "dirty");
        assert_eq!(err.value, "fast");
        assert_eq!(
            std::format!("{err}"),
            "dirty=fast: expected <pages_per_s>,<MiB>[,seq|rand] with MiB > 0"
        );
    }

    /// Arbitrary command lines never panic the parser (a poor man's fuzzer:
    /// random words over the characters that matter).
    #[test]
    fn random_lines_never_panic() {
        const ALPHABET: &[u8] = b"=,@:./xX0123456789KMGkmg abcdefghilmnoprstuvwy_-\xff";
        const WORDS: [&str; 11] = [
            "counter=",
            "dirty=",
            "disk=",
            "pmem=",
            "write,",
            "verify,",
            "ip=",
            "gw=",
            "virtio_mmio.device=",
            "poweroff",
            "fault=",
        ];
        let mut x: u64 = 0x1234_5678_9abc_def1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..20_000 {
            let mut line = std::string::String::new();
            for _ in 0..next() % 12 {
                if next() % 3 == 0 {
                    line.push_str(WORDS[(next() % WORDS.len() as u64) as usize]);
                } else {
                    let b = ALPHABET[(next() % ALPHABET.len() as u64) as usize];
                    line.push(b as char);
                }
            }
            let _ = parse(&line);
        }
    }

    #[test]
    fn too_many_disk_jobs() {
        let line = "disk=verify,1 ".repeat(MAX_DISK_JOBS + 1);
        assert_eq!(parse(&line).unwrap_err().expected, "too many disk jobs");
    }
}
