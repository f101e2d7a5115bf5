//! `kemari`'s command line and config file, turned into a [`MachineConfig`].

use std::path::{Path, PathBuf};

use clap::Parser;

mod roles;
use vmm::config::{
    parse_memory_size, ConfigError, DiskConfig, MachineConfig, NetConfig, PmemConfig, SerialConfig,
    MAX_VCPUS,
};
use vmm::memory::MemoryBacking;

/// Run one virtual machine.
#[derive(Debug, Parser)]
#[command(
    name = "kemari",
    version,
    about = "kemari: a KVM VMM built for availability"
)]
pub struct Args {
    /// Configuration file (TOML or JSON): the machine (MachineConfig's
    /// fields) or a role (restore, incoming, incoming_local, ft_standby with
    /// its keys), and the process's settings, under the flags' names with
    /// `_` for `-` (docs/cli.md, docs/operations.md). Flags given as well
    /// override its values.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Kernel image: a Linux bzImage (booted with ACPI tables describing the
    /// devices) or a PVH ELF (the test guest; devices on the command line).
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Initramfs image.
    #[arg(long)]
    pub initramfs: Option<PathBuf>,
    /// Kernel command line.
    #[arg(long)]
    pub cmdline: Option<String>,
    /// Guest memory size (e.g. 256M, 4G).
    #[arg(long)]
    pub memory: Option<String>,
    /// Number of vCPUs (1-8).
    #[arg(long)]
    pub vcpus: Option<u8>,
    /// Back guest memory with this file (under /dev/shm or a hugetlbfs mount)
    /// instead of an anonymous memfd.
    #[arg(long, conflicts_with = "hugepages")]
    pub memory_file: Option<PathBuf>,
    /// Back guest memory with 2 MiB huge pages (needs vm.nr_hugepages).
    #[arg(long)]
    pub hugepages: bool,
    /// Serial console: stdout, null, file:PATH or socket:PATH.
    #[arg(long)]
    pub serial: Option<String>,
    /// A virtio-blk disk: PATH, path=PATH[,ro], or an NBD URL
    /// (nbd://HOST[:PORT]/EXPORT, nbd+unix:///EXPORT?socket=PATH). Repeatable.
    /// An NBD disk takes `,cache=SIZE`: a warm read cache of SIZE in kemari,
    /// kept across the guest's reboots (off by default).
    #[arg(long = "disk")]
    pub disks: Vec<String>,
    /// A virtio-net device: tap=NAME[,mac=MAC]. Repeat for more.
    #[arg(long = "net")]
    pub nets: Vec<String>,
    /// A virtio-pmem device: a file or block device (size a multiple of
    /// 2 MiB) mapped into the guest, which sees /dev/pmemN and may mount it
    /// with `-o dax`: its pages stay in this host's page cache across the
    /// guest's reboots (docs/warm-cache.md). Repeatable.
    #[arg(long = "pmem", value_name = "PATH")]
    pub pmem: Vec<PathBuf>,
    /// Serve the control API on this Unix socket.
    #[arg(long)]
    pub api_socket: Option<PathBuf>,
    /// Permissions of the API socket, in octal (default 0600: only this
    /// user may control the VM; 0660 with --api-socket-group for a group).
    #[arg(long, value_name = "MODE", value_parser = kemari_api::bind::parse_mode)]
    pub api_socket_mode: Option<u32>,
    /// Group of the API socket (a name or a number).
    #[arg(long, value_name = "GROUP")]
    pub api_socket_group: Option<String>,
    /// Restore the VM saved in this snapshot directory (`kemarictl snapshot`
    /// or `kemarictl warm-restart`) instead of booting a kernel. --serial,
    /// --api-socket and --memory-file/--hugepages (for a full snapshot's copy
    /// of memory) may be given; the rest comes from the snapshot.
    #[arg(long, conflicts_with_all = ["kernel", "initramfs", "cmdline", "memory", "vcpus", "disks", "nets", "pmem"])]
    pub restore: Option<PathBuf>,
    /// With --restore DIR: be the VM's prepared successor. Start before the
    /// state exists, while the old kemari still runs the VM: read
    /// DIR/config.json (`kemarictl warm-restart DIR --prepare`), map the VM's
    /// memory file, create the KVM VM and its memory slots, then wait on
    /// DIR/successor.sock; the old kemari's `warm-restart DIR` hands the VM
    /// over and it resumes here at once. Give it its own --api-socket.
    #[arg(long, requires = "restore")]
    pub await_state: bool,
    /// Wait on this Unix socket for a VM migrated from another kemari on this
    /// host (`kemarictl migrate-local SOCKET`) and run it: zero-copy, guest
    /// memory and TAPs are handed over. --serial and --api-socket may be given.
    /// With --memory-file PATH (the source VM's own memory file) the KVM VM
    /// and its memory slots are built at start-up, before the source
    /// connects, and an offer of any other memory is refused.
    #[arg(long, conflicts_with_all = ["kernel", "initramfs", "cmdline", "memory", "vcpus", "disks", "nets", "pmem", "restore"])]
    pub incoming_local: Option<PathBuf>,
    /// Wait on this TCP address (HOST:PORT) for a live migration from another
    /// kemari (`kemarictl migrate --to`) and run the VM. Needs
    /// --migration-key-file; --net tap=NAME may rename TAPs for this host,
    /// --serial and --api-socket may be given.
    #[arg(long, conflicts_with_all = ["kernel", "initramfs", "cmdline", "memory", "vcpus", "disks", "pmem", "restore", "incoming_local"])]
    pub incoming: Option<String>,
    /// Be the fault-tolerance standby of the VM whose primary will connect to
    /// this TCP address (HOST:PORT; `kemarictl ft start --peer`): receive its
    /// synchronizations and run the VM if the primary is lost. Needs
    /// --migration-key-file; --net tap=NAME, --serial and --api-socket may be
    /// given.
    #[arg(long, conflicts_with_all = ["kernel", "initramfs", "cmdline", "memory", "vcpus", "disks", "pmem", "restore", "incoming_local", "incoming"])]
    pub ft_standby: Option<String>,
    /// Fault-tolerance fence: what only the running copy of the VM holds. A
    /// primary takes it at start; a standby takes it before it runs the VM
    /// and does not fail over while another copy holds it (split brain).
    /// Give both ends the same fence. PATH: a lock file both can lock (one
    /// host, or a shared filesystem). etcd://HOST:PORT[,HOST:PORT…][/PREFIX][?ttl=SECONDS]:
    /// the key PREFIX/ID (default prefix /kemari/vms, TTL 5 s; needs --id)
    /// in an etcd cluster (TLS: &cacert=PEM[&cert=PEM&key=PEM]), bound to
    /// a lease the running copy renews; a
    /// copy that cannot renew it stops releasing outputs before it can
    /// expire, and ends (docs/fleet.md).
    #[arg(long, value_name = "PATH|etcd://…", value_parser = ft::fence::FenceSpec::parse)]
    pub ft_fence: Option<ft::fence::FenceSpec>,
    /// Fault-tolerance fence across hosts (STONITH-style): a command the
    /// standby runs before it runs the VM, which must make sure the primary
    /// is off (power it off, cut its disk and network) and exit 0; any other
    /// outcome and the standby does not fail over. Run by `sh -c`, with
    /// KEMARI_FT_PEER set to the primary's address.
    #[arg(long)]
    pub ft_fence_cmd: Option<String>,
    /// Protect the VM with fault tolerance from its start: once it runs,
    /// synchronize it to the standby (`kemari --ft-standby`) at HOST:PORT,
    /// as `kemarictl ft start --peer` would, keyed by --migration-key-file.
    /// A failed start leaves the VM running unprotected (logged, and an
    /// `operation_failed` event); `kemarictl ft start` may try again.
    #[arg(long, value_name = "HOST:PORT", conflicts_with_all = ["ft_standby", "incoming", "incoming_local"])]
    pub ft_peer: Option<String>,
    /// With --ft-peer: Remus-style checkpoints every this many ms instead of
    /// event-driven synchronization.
    #[arg(long, value_name = "MS")]
    pub ft_periodic_ms: Option<u64>,
    /// With --ft-peer: the sync link's heartbeat interval, ms (default 100).
    #[arg(long, value_name = "MS")]
    pub ft_heartbeat_ms: Option<u64>,
    /// With --ft-peer: the peer is lost after this long without a frame, ms
    /// (default 1000).
    #[arg(long, value_name = "MS")]
    pub ft_timeout_ms: Option<u64>,
    /// Pre-shared key (a file of at least 16 bytes) that authenticates the
    /// live-migration and fault-tolerance streams, which are encrypted
    /// (Noise, AES-256-GCM); both ends need the same key.
    #[arg(long)]
    pub migration_key_file: Option<PathBuf>,
    /// With --incoming or --ft-standby: an authenticated but unencrypted
    /// link, for a trusted, dedicated one (the source's `migrate` or the
    /// primary's `ft start` must say `--plaintext-link` too).
    #[arg(long)]
    pub plaintext_link: bool,
    /// Build the VM but do not start its vCPUs until resumed through the API.
    #[arg(long)]
    pub start_paused: bool,
    /// What a guest reset (a reboot: i8042, ACPI reset register, port 0xcf9)
    /// does: `restart` boots the guest again in this process (same disks,
    /// TAPs, API socket, pid and identity; memory cleared, kernel loaded
    /// again), `exit` ends the VM and exits 0.
    #[arg(long, value_enum, default_value_t = OnReboot::Restart)]
    pub on_reboot: OnReboot,
    /// What a guest crash (a vCPU's triple fault) does: `stop` ends the VM
    /// with exit status 4, `restart` boots the guest again as a reboot does.
    #[arg(long, value_enum, default_value_t = OnCrash::Stop)]
    pub on_crash: OnCrash,
    /// The system calls each thread may make (seccomp filters, see
    /// docs/architecture.md): `on` kills the process (SIGSYS) at a call
    /// outside its thread's filter; `log` allows it and has the kernel log
    /// it (dmesg: `audit: type=1326 … syscall=N`), to find what a new
    /// workload needs; `off` filters nothing. Also from `KEMARI_SECCOMP`.
    #[arg(long, value_enum, env = "KEMARI_SECCOMP", default_value_t = SeccompFlag::On)]
    pub seccomp: SeccompFlag,
    /// Log filter: a level (off, error, warn, info, debug, trace) or tracing
    /// directives such as warn,vmm=debug.
    #[arg(long, env = kemari_logging::ENV, default_value = kemari_logging::DEFAULT_LEVEL,
          value_parser = kemari_logging::check_filter)]
    pub log_level: String,
    /// Logs as JSON lines.
    #[arg(long)]
    pub log_json: bool,
    /// The VM's name, a label (1-64 characters of A-Z a-z 0-9 . _ -), shown
    /// in GET /vm and in its events; kept wherever the VM goes. On a
    /// restore or an arrival, replaces the saved one.
    #[arg(long, value_parser = crate::identity::check)]
    pub name: Option<String>,
    /// The VM's id (same characters; default: 16 random hex digits given at
    /// first boot), kept wherever the VM goes. On a restore or an arrival,
    /// replaces the saved one.
    #[arg(long, value_parser = crate::identity::check)]
    pub id: Option<String>,
    /// Append the VM's events (the lines of GET /vm/events) to this file or
    /// FIFO, opened at start-up (a FIFO: once a reader has opened it).
    #[arg(long, value_name = "PATH")]
    pub events_file: Option<PathBuf>,
    /// Also serve GET /metrics (Prometheus text format) over TCP on this
    /// address (`127.0.0.1:9400`); the API socket always serves it.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<String>,
}

/// `--on-reboot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnReboot {
    /// Boot the guest again in this process.
    Restart,
    /// End the VM; exit 0.
    Exit,
}

/// `--on-crash`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnCrash {
    /// End the VM; exit 4.
    Stop,
    /// Boot the guest again in this process.
    Restart,
}

/// `--seccomp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SeccompFlag {
    /// Kill the process at a forbidden call.
    On,
    /// Log forbidden calls, allow them.
    Log,
    /// No filters.
    Off,
}

impl From<SeccompFlag> for vmm::seccomp::SeccompMode {
    fn from(flag: SeccompFlag) -> Self {
        match flag {
            SeccompFlag::On => vmm::seccomp::SeccompMode::Kill,
            SeccompFlag::Log => vmm::seccomp::SeccompMode::Log,
            SeccompFlag::Off => vmm::seccomp::SeccompMode::Off,
        }
    }
}

/// Errors assembling the configuration. Each names the input as the user
/// wrote it (`--memory 255M`, `memory = "255M" in vm.toml`) and what to do.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The config file cannot be read.
    #[error("cannot read config file {path} (--config): {cause}; check the path")]
    ReadConfig {
        /// The file.
        path: PathBuf,
        /// The cause (part of the message, so not a `#[source]`: it would
        /// be printed twice).
        cause: std::io::Error,
    },
    /// The config file does not parse.
    #[error("config file {path}: {message}")]
    ParseConfig {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A required setting is absent.
    #[error("missing {0} (give it as a flag or in --config)")]
    Missing(&'static str),
    /// More than one role (flags and the config file together).
    #[error("one role at a time: {0} given (flags and --config together); keep one")]
    Roles(String),
    /// A role's config file defines a machine.
    #[error(
        "a config file for {role} defines no machine (the VM comes from elsewhere): remove {keys}"
    )]
    MachineInRoleFile {
        /// The role.
        role: String,
        /// The machine keys found.
        keys: String,
    },
    /// A value is invalid.
    #[error(transparent)]
    Invalid(#[from] ConfigError),
    /// A setting's value is invalid.
    #[error("{input}: {reason}")]
    Setting {
        /// The setting as the user wrote it: `--memory 255M`, or
        /// `memory = "255M" in FILE`.
        input: String,
        /// What is wrong and what to do.
        reason: String,
    },
}

/// Where a setting came from: a flag or a key of the config file.
#[derive(Debug, Clone, Copy)]
enum Given<'a> {
    Flag(&'static str),
    File { key: &'static str, path: &'a Path },
}

impl Given<'_> {
    /// `value` (as it appears in the input: quoted if a string) where it
    /// was given, as the user wrote it.
    fn input(self, value: &str) -> String {
        match self {
            Given::Flag(flag) => format!("{flag} {}", value.trim_matches('"')),
            Given::File { key, path } if path.extension().is_some_and(|e| e == "json") => {
                format!("\"{key}\": {value} in {}", path.display())
            }
            Given::File { key, path } => format!("{key} = {value} in {}", path.display()),
        }
    }

    fn error(self, value: &str, reason: impl std::fmt::Display) -> CliError {
        CliError::Setting {
            input: self.input(value),
            reason: reason.to_string(),
        }
    }
}

/// The flag's value if given, else the file's, with where it came from.
fn pick<'a, T>(
    flag: Option<T>,
    file: Option<T>,
    names: (&'static str, &'static str),
    path: Option<&'a Path>,
) -> Option<(T, Given<'a>)> {
    match (flag, file, path) {
        (Some(v), _, _) => Some((v, Given::Flag(names.0))),
        (None, Some(v), Some(path)) => Some((v, Given::File { key: names.1, path })),
        (None, Some(v), None) => Some((v, Given::Flag(names.0))),
        (None, None, _) => None,
    }
}

/// A partial configuration as read from a file: everything optional, flags fill
/// the rest.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    vcpus: Option<u8>,
    memory: Option<String>,
    memory_file: Option<PathBuf>,
    hugepages: Option<bool>,
    kernel: Option<PathBuf>,
    initramfs: Option<PathBuf>,
    cmdline: Option<String>,
    serial: Option<String>,
    #[serde(default)]
    disks: Vec<DiskConfig>,
    #[serde(default)]
    nets: Vec<NetConfig>,
    #[serde(default)]
    pmem: Vec<PmemConfig>,
    api_socket: Option<PathBuf>,
    api_socket_mode: Option<String>,
    api_socket_group: Option<String>,
    id: Option<String>,
    name: Option<String>,
    events_file: Option<PathBuf>,
    metrics_listen: Option<String>,
    // The role and process keys (cli/roles.rs), named as the flags.
    restore: Option<PathBuf>,
    await_state: Option<bool>,
    incoming: Option<String>,
    incoming_local: Option<PathBuf>,
    ft_standby: Option<String>,
    ft_fence: Option<String>,
    ft_fence_cmd: Option<String>,
    ft_peer: Option<String>,
    ft_periodic_ms: Option<u64>,
    ft_heartbeat_ms: Option<u64>,
    ft_timeout_ms: Option<u64>,
    migration_key_file: Option<PathBuf>,
    plaintext_link: Option<bool>,
    start_paused: Option<bool>,
    on_reboot: Option<String>,
    on_crash: Option<String>,
    seccomp: Option<String>,
    log_level: Option<String>,
    log_json: Option<bool>,
}

impl Args {
    /// The machine configuration and the API socket (if any).
    pub fn machine_config(&self) -> Result<(MachineConfig, Option<PathBuf>), CliError> {
        let file = match &self.config {
            Some(path) => read_config_file(path)?,
            None => FileConfig::default(),
        };
        let path = self.config.as_deref();
        let (id, name) = self.identity_from(&file)?;
        let kernel = self
            .kernel
            .clone()
            .or(file.kernel)
            .ok_or(CliError::Missing("--kernel"))?;
        let (memory, given) = pick(
            self.memory.clone(),
            file.memory,
            ("--memory", "memory"),
            path,
        )
        .ok_or(CliError::Missing("--memory"))?;
        let memory_bytes =
            parse_memory_size(&memory).map_err(|e| given.error(&format!("{memory:?}"), e))?;
        let vcpus = match pick(self.vcpus, file.vcpus, ("--vcpus", "vcpus"), path) {
            Some((n, given)) if n == 0 || n > MAX_VCPUS => {
                return Err(
                    given.error(&n.to_string(), format!("must be between 1 and {MAX_VCPUS}"))
                )
            }
            Some((n, _)) => n,
            None => 1,
        };
        let memory_backing = if let Some(p) = self.memory_file.clone().or(file.memory_file) {
            MemoryBacking::File { path: p }
        } else if self.hugepages || file.hugepages.unwrap_or(false) {
            MemoryBacking::MemfdHugetlb
        } else {
            MemoryBacking::Memfd
        };
        let serial = match pick(
            self.serial.clone(),
            file.serial,
            ("--serial", "serial"),
            path,
        ) {
            Some((s, given)) => parse_serial(&s).map_err(|e| given.error(&format!("{s:?}"), e))?,
            None => SerialConfig::Stdout,
        };
        let mut disks = file.disks;
        for d in &self.disks {
            disks.push(parse_disk(d)?);
        }
        let mut nets = file.nets;
        for n in &self.nets {
            nets.push(parse_net(n)?);
        }
        let mut pmem = file.pmem;
        pmem.extend(
            self.pmem
                .iter()
                .map(|path| PmemConfig { path: path.clone() }),
        );
        let config = MachineConfig {
            vcpus,
            memory_bytes,
            memory_backing,
            kernel,
            initramfs: self.initramfs.clone().or(file.initramfs),
            cmdline: self.cmdline.clone().or(file.cmdline).unwrap_or_default(),
            serial,
            disks,
            nets,
            pmem,
            // First boot: the VM's id from now on.
            id: Some(id.unwrap_or_else(crate::identity::random_id)),
            name,
        };
        config.validate()?;
        Ok((config, self.api_socket.clone().or(file.api_socket)))
    }
}

impl Args {
    /// The id and name the flags or `file` give (checked), if any.
    fn identity_from(
        &self,
        file: &FileConfig,
    ) -> Result<(Option<String>, Option<String>), CliError> {
        let path = self.config.as_deref();
        let checked = |flag, key, given: Option<String>, from_file: Option<String>| match pick(
            given,
            from_file,
            (flag, key),
            path,
        ) {
            Some((v, given)) => crate::identity::check(&v)
                .map(Some)
                .map_err(|e| given.error(&format!("{v:?}"), e)),
            None => Ok(None),
        };
        Ok((
            checked("--id", "id", self.id.clone(), file.id.clone())?,
            checked("--name", "name", self.name.clone(), file.name.clone())?,
        ))
    }

    /// The VM's id and name as far as this VMM knows before its VM is here
    /// (a standby, a destination): the flags' or the config file's.
    pub fn identity(&self) -> Result<(Option<String>, Option<String>), CliError> {
        let file = match &self.config {
            Some(path) => read_config_file(path)?,
            None => FileConfig::default(),
        };
        self.identity_from(&file)
    }

    /// Where to append the events, from the flag or the config file.
    pub fn events_file(&self) -> Result<Option<PathBuf>, CliError> {
        if self.events_file.is_some() {
            return Ok(self.events_file.clone());
        }
        match &self.config {
            Some(path) => Ok(read_config_file(path)?.events_file),
            None => Ok(None),
        }
    }

    /// Where to serve `/metrics` over TCP, from the flag or the config file.
    pub fn metrics_listen(&self) -> Result<Option<String>, CliError> {
        if self.metrics_listen.is_some() {
            return Ok(self.metrics_listen.clone());
        }
        match &self.config {
            Some(path) => Ok(read_config_file(path)?.metrics_listen),
            None => Ok(None),
        }
    }

    /// The API socket, from the flag or the config file.
    pub fn api_socket_path(&self) -> Result<Option<PathBuf>, CliError> {
        if self.api_socket.is_some() {
            return Ok(self.api_socket.clone());
        }
        match &self.config {
            Some(path) => Ok(read_config_file(path)?.api_socket),
            None => Ok(None),
        }
    }

    /// The API socket's permissions, from the flags or the config file.
    pub fn api_socket_options(&self) -> Result<kemari_api::bind::SocketOptions, CliError> {
        let file = match &self.config {
            Some(path) => read_config_file(path)?,
            None => FileConfig::default(),
        };
        let mut options = kemari_api::bind::SocketOptions::default();
        if let Some(mode) = self.api_socket_mode {
            options.mode = mode;
        } else if let (Some(text), Some(path)) = (&file.api_socket_mode, &self.config) {
            let given = Given::File {
                key: "api_socket_mode",
                path,
            };
            options.mode = kemari_api::bind::parse_mode(text)
                .map_err(|e| given.error(&format!("{text:?}"), e))?;
        }
        options.group = self.api_socket_group.clone().or(file.api_socket_group);
        Ok(options)
    }

    /// Memory backing chosen by flags (memfd if none).
    pub fn memory_backing(&self) -> MemoryBacking {
        if let Some(p) = &self.memory_file {
            MemoryBacking::File { path: p.clone() }
        } else if self.hugepages {
            MemoryBacking::MemfdHugetlb
        } else {
            MemoryBacking::Memfd
        }
    }

    /// Applies the flags a restore may change to the saved configuration.
    /// A TAP may be renamed (`--net tap=NAME`), but the guest's MAC stays
    /// the one it had: a state without one (older kemari) keeps the MAC its
    /// saved TAP name gave, and a `mac=` other than the guest's is refused.
    pub fn apply_restore_overrides(&self, config: &mut MachineConfig) -> Result<(), CliError> {
        if self.id.is_some() {
            config.id = self.id.clone();
        }
        if self.name.is_some() {
            config.name = self.name.clone();
        }
        // A state saved before VMs had ids: the VM gets its id now.
        config.id.get_or_insert_with(crate::identity::random_id);
        if let Some(s) = &self.serial {
            config.serial = parse_serial(s).map_err(|e| Given::Flag("--serial").error(s, e))?;
        }
        // TAPs of this host, in network-device order.
        for (i, n) in self.nets.iter().enumerate() {
            let net = parse_net(n)?;
            match config.nets.get_mut(i) {
                Some(existing) => {
                    let guest_mac = match (&existing.mac, &net.mac) {
                        (None, Some(given)) => vmm::config::parse_mac(given)?,
                        _ => existing.mac_address(),
                    };
                    if let Some(given) = &net.mac {
                        if vmm::config::parse_mac(given)? != guest_mac {
                            return Err(option_error(
                                "net",
                                n,
                                &format!(
                                    "the guest's MAC is {}: a restored VM keeps it",
                                    vmm::config::format_mac(guest_mac)
                                ),
                            ));
                        }
                    }
                    existing.mac = Some(vmm::config::format_mac(guest_mac));
                    existing.tap = net.tap;
                }
                None => {
                    return Err(CliError::Invalid(ConfigError::DeviceOption {
                        kind: "net",
                        value: n.clone(),
                        reason: format!("the VM has {} network devices", config.nets.len()),
                    }))
                }
            }
        }
        Ok(())
    }
}

fn read_config_file(path: &PathBuf) -> Result<FileConfig, CliError> {
    let text = std::fs::read_to_string(path).map_err(|cause| CliError::ReadConfig {
        path: path.clone(),
        cause,
    })?;
    let parsed = if path.extension().is_some_and(|e| e == "json") {
        serde_json::from_str(&text).map_err(|e| e.to_string())
    } else {
        toml::from_str(&text).map_err(|e| e.to_string())
    };
    parsed.map_err(|message| CliError::ParseConfig {
        path: path.clone(),
        message,
    })
}

/// Parses a serial console target; the error says what to write instead.
fn parse_serial(s: &str) -> Result<SerialConfig, &'static str> {
    Ok(match s {
        "stdout" => SerialConfig::Stdout,
        "null" | "none" => SerialConfig::Null,
        _ => match s.split_once(':') {
            Some(("file", p)) if !p.is_empty() => SerialConfig::File(p.into()),
            Some(("socket", p)) if !p.is_empty() => SerialConfig::Socket(p.into()),
            _ => return Err("use stdout, null, file:PATH or socket:PATH"),
        },
    })
}

fn option_error(kind: &'static str, value: &str, reason: &str) -> CliError {
    CliError::Invalid(ConfigError::DeviceOption {
        kind,
        value: value.to_owned(),
        reason: reason.to_owned(),
    })
}

/// Parses `PATH`, `path=PATH`, `path=PATH,ro` or `PATH,ro`, each with an
/// optional `cache=SIZE`.
pub fn parse_disk(s: &str) -> Result<DiskConfig, CliError> {
    let mut path = None;
    let mut read_only = false;
    let mut cache_bytes = None;
    for (i, part) in s.split(',').enumerate() {
        // An NBD URL may itself hold '=' (nbd+unix:///export?socket=PATH).
        if i == 0 && vmm::devices::block_backend::is_nbd_url(part) {
            path = Some(part);
            continue;
        }
        match part.split_once('=') {
            Some(("path", p)) => path = Some(p),
            Some(("ro" | "readonly", v)) => {
                read_only = match v {
                    "on" | "true" | "1" => true,
                    "off" | "false" | "0" => false,
                    _ => return Err(option_error("disk", s, "ro takes on/off")),
                }
            }
            Some(("cache", v)) => {
                cache_bytes = match v {
                    "off" | "0" => None,
                    _ => Some(vmm::config::parse_size(v).map_err(|_| {
                        option_error("disk", s, "cache takes a size like 512M, or off")
                    })?),
                }
            }
            None if part == "ro" || part == "readonly" => read_only = true,
            None if i == 0 => path = Some(part),
            _ => return Err(option_error("disk", s, &format!("unknown option {part:?}"))),
        }
    }
    let path = path
        .filter(|p| !p.is_empty())
        .ok_or_else(|| option_error("disk", s, "no path"))?;
    Ok(DiskConfig {
        path: path.into(),
        read_only,
        cache_bytes,
    })
}

/// Parses `tap=NAME[,mac=MAC]` (or `NAME[,mac=MAC]`).
pub fn parse_net(s: &str) -> Result<NetConfig, CliError> {
    let mut tap = None;
    let mut mac = None;
    for (i, part) in s.split(',').enumerate() {
        match part.split_once('=') {
            Some(("tap", t)) => tap = Some(t),
            Some(("mac", m)) => {
                vmm::config::parse_mac(m)?;
                mac = Some(m.to_owned());
            }
            None if i == 0 => tap = Some(part),
            _ => return Err(option_error("net", s, &format!("unknown option {part:?}"))),
        }
    }
    let tap = tap
        .filter(|t| !t.is_empty())
        .ok_or_else(|| option_error("net", s, "no tap name"))?;
    if tap.len() > 15 {
        return Err(option_error("net", s, "TAP names are at most 15 bytes"));
    }
    Ok(NetConfig {
        tap: tap.to_owned(),
        mac,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reset_restarts_and_a_crash_stops_unless_told_otherwise() {
        use clap::Parser;
        let args = Args::parse_from(["kemari", "--kernel", "/k", "--memory", "64M"]);
        assert_eq!(
            (args.on_reboot, args.on_crash),
            (OnReboot::Restart, OnCrash::Stop)
        );
        let args = Args::parse_from(["kemari", "--on-reboot", "exit", "--on-crash", "restart"]);
        assert_eq!(
            (args.on_reboot, args.on_crash),
            (OnReboot::Exit, OnCrash::Restart)
        );
        assert!(Args::try_parse_from(["kemari", "--on-reboot", "halt"]).is_err());
        assert!(Args::try_parse_from(["kemari", "--on-crash", "exit"]).is_err());
    }

    #[test]
    fn disks_and_nets() {
        assert_eq!(
            parse_disk("/a.img").unwrap(),
            DiskConfig {
                path: "/a.img".into(),
                read_only: false,
                cache_bytes: None,
            }
        );
        assert!(parse_disk("path=/a.img,ro").unwrap().read_only);
        assert!(parse_disk("/a.img,ro=on").unwrap().read_only);
        assert!(parse_disk("").is_err());
        assert_eq!(
            parse_disk("nbd+unix:///d?socket=/s,ro").unwrap(),
            DiskConfig {
                path: "nbd+unix:///d?socket=/s".into(),
                read_only: true,
                cache_bytes: None,
            }
        );
        assert_eq!(
            parse_disk("nbd://h:1/d,cache=512M").unwrap().cache_bytes,
            Some(512 << 20)
        );
        assert_eq!(parse_disk("nbd://h/d,cache=off").unwrap().cache_bytes, None);
        assert!(parse_disk("nbd://h/d,cache=lots").is_err());
        assert!(parse_disk("/a,bogus=1").is_err());
        assert_eq!(
            parse_net("tap=t0,mac=52:54:00:00:00:01")
                .unwrap()
                .mac
                .as_deref(),
            Some("52:54:00:00:00:01")
        );
        assert_eq!(parse_net("t0").unwrap().tap, "t0");
        assert!(parse_net("tap=t0,mac=zz").is_err());
        assert!(parse_net("tap=waytoolongtapname0").is_err());
        assert!(parse_net("mac=52:54:00:00:00:01").is_err());
    }

    #[test]
    fn a_renamed_tap_keeps_the_guests_mac() {
        let saved = |mac: Option<&str>| MachineConfig {
            vcpus: 1,
            memory_bytes: 64 << 20,
            memory_backing: MemoryBacking::Memfd,
            kernel: "/k".into(),
            initramfs: None,
            cmdline: String::new(),
            serial: SerialConfig::Null,
            disks: vec![],
            nets: vec![NetConfig {
                tap: "src-tap".into(),
                mac: mac.map(str::to_owned),
            }],
            pmem: Vec::new(),
            id: None,
            name: None,
        };
        let renamed = Args::parse_from(["kemari", "--incoming", "h:1", "--net", "tap=dst-tap"]);
        // Saved by an older kemari, without its MAC: the one its TAP gave.
        let mut c = saved(None);
        renamed.apply_restore_overrides(&mut c).unwrap();
        assert_eq!(c.nets[0].tap, "dst-tap");
        assert_eq!(c.nets[0].mac_address(), vmm::config::default_mac("src-tap"));
        let mut c = saved(Some("52:54:00:00:00:07"));
        renamed.apply_restore_overrides(&mut c).unwrap();
        assert_eq!(c.nets[0].mac.as_deref(), Some("52:54:00:00:00:07"));
        let other = Args::parse_from([
            "kemari",
            "--incoming",
            "h:1",
            "--net",
            "tap=dst-tap,mac=52:54:00:00:00:08",
        ]);
        assert!(other.apply_restore_overrides(&mut c).is_err());
        let mut c = saved(None);
        other.apply_restore_overrides(&mut c).unwrap();
        assert_eq!(c.nets[0].mac.as_deref(), Some("52:54:00:00:00:08"));
        // An older state gets an id; a saved one is kept unless --id says.
        assert_eq!(c.id.as_ref().map(String::len), Some(16));
        let mut c = saved(None);
        c.id = Some("vm-7".into());
        renamed.apply_restore_overrides(&mut c).unwrap();
        assert_eq!((c.id.as_deref(), c.name.as_deref()), (Some("vm-7"), None));
        let named = Args::parse_from(["kemari", "--restore", "/d", "--name", "db.2"]);
        named.apply_restore_overrides(&mut c).unwrap();
        assert_eq!(
            (c.id.as_deref(), c.name.as_deref()),
            (Some("vm-7"), Some("db.2"))
        );
    }

    #[test]
    fn ids_and_names_from_flags_or_file() {
        let a = Args::parse_from(["kemari", "--kernel", "/k", "--memory", "64M"]);
        let (c, _) = a.machine_config().unwrap();
        assert_eq!(c.id.as_ref().map(String::len), Some(16));
        assert_eq!(c.name, None);
        let a = Args::parse_from([
            "kemari", "--kernel", "/k", "--memory", "64M", "--id", "a1", "--name", "web.1",
        ]);
        let (c, _) = a.machine_config().unwrap();
        assert_eq!(
            (c.id.as_deref(), c.name.as_deref()),
            (Some("a1"), Some("web.1"))
        );
        assert!(Args::try_parse_from(["kemari", "--name", "a b"]).is_err());
        assert!(Args::try_parse_from(["kemari", "--id", ""]).is_err());
        let dir = std::env::temp_dir().join(format!("kemari-cli-id-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("vm.toml");
        std::fs::write(
            &cfg,
            "kernel = \"/k\"\nmemory = \"64M\"\nname = \"db\"\nevents_file = \"/e\"\nmetrics_listen = \"127.0.0.1:9400\"\n",
        )
        .unwrap();
        let a = Args::parse_from(["kemari", "--config", cfg.to_str().unwrap()]);
        assert_eq!(a.machine_config().unwrap().0.name.as_deref(), Some("db"));
        assert_eq!(a.events_file().unwrap(), Some(PathBuf::from("/e")));
        assert_eq!(
            a.metrics_listen().unwrap().as_deref(),
            Some("127.0.0.1:9400")
        );
        std::fs::write(&cfg, "kernel = \"/k\"\nmemory = \"64M\"\nname = \"d/b\"\n").unwrap();
        let a = Args::parse_from(["kemari", "--config", cfg.to_str().unwrap()]);
        let e = a.machine_config().unwrap_err().to_string();
        assert!(e.starts_with("name = \"d/b\" in "), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn serial() {
        assert_eq!(
            parse_serial("file:/x").unwrap(),
            SerialConfig::File("/x".into())
        );
        assert_eq!(
            parse_serial("socket:/s").unwrap(),
            SerialConfig::Socket("/s".into())
        );
        assert!(parse_serial("file:").is_err());
        assert!(parse_serial("tty").is_err());
    }

    #[test]
    fn flags_override_file() {
        let dir = std::env::temp_dir().join(format!("kemari-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("vm.toml");
        std::fs::write(
            &cfg,
            "kernel = \"/k\"\nmemory = \"128M\"\nvcpus = 2\n[[disks]]\npath = \"/d.img\"\n",
        )
        .unwrap();
        let args = Args::parse_from([
            "kemari",
            "--config",
            cfg.to_str().unwrap(),
            "--memory",
            "256M",
        ]);
        let (c, api) = args.machine_config().unwrap();
        assert_eq!(c.memory_bytes, 256 << 20);
        assert_eq!(c.vcpus, 2);
        assert_eq!(c.disks.len(), 1);
        assert!(api.is_none());
        std::fs::write(&cfg, "kernel = \"/k\"\nmemroy = \"128M\"\n").unwrap();
        let args = Args::parse_from(["kemari", "--config", cfg.to_str().unwrap()]);
        assert!(matches!(
            args.machine_config(),
            Err(CliError::ParseConfig { .. })
        ));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn missing_and_invalid() {
        let a = Args::parse_from(["kemari", "--memory", "256M"]);
        assert!(matches!(
            a.machine_config(),
            Err(CliError::Missing("--kernel"))
        ));
        let a = Args::parse_from(["kemari", "--kernel", "/k", "--memory", "1M"]);
        assert_eq!(
            a.machine_config().unwrap_err().to_string(),
            "--memory 1M: must be at least 16M (try 16M)"
        );
        let a = Args::parse_from([
            "kemari", "--kernel", "/k", "--memory", "256M", "--vcpus", "9",
        ]);
        assert!(a.machine_config().is_err());
    }

    #[test]
    fn errors_name_the_input_as_written() {
        let dir = std::env::temp_dir().join(format!("kemari-cli-echo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("vm.toml");
        let at = cfg.display();
        std::fs::write(&cfg, "kernel = \"/k\"\nmemory = \"255M\"\n").unwrap();
        let run = |extra: &[&str]| {
            let mut argv = vec!["kemari", "--config", cfg.to_str().unwrap()];
            argv.extend_from_slice(extra);
            Args::parse_from(argv)
                .machine_config()
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            run(&[]),
            format!("memory = \"255M\" in {at}: must be a multiple of 2M (try 256M)")
        );
        assert_eq!(
            run(&["--memory", "255M"]),
            "--memory 255M: must be a multiple of 2M (try 256M)"
        );
        std::fs::write(&cfg, "kernel = \"/k\"\nmemory = \"1G\"\nvcpus = 9\n").unwrap();
        assert_eq!(
            run(&[]),
            format!("vcpus = 9 in {at}: must be between 1 and 8")
        );
        std::fs::write(&cfg, "kernel = \"/k\"\nmemory = \"1G\"\nserial = \"tty\"\n").unwrap();
        assert_eq!(
            run(&[]),
            format!("serial = \"tty\" in {at}: use stdout, null, file:PATH or socket:PATH")
        );
        let json = dir.join("vm.json");
        std::fs::write(&json, r#"{"kernel": "/k", "memory": "255M"}"#).unwrap();
        let e = Args::parse_from(["kemari", "--config", json.to_str().unwrap()])
            .machine_config()
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            format!(
                "\"memory\": \"255M\" in {}: must be a multiple of 2M (try 256M)",
                json.display()
            )
        );
        // A missing file: its cause once, and what to do.
        let gone = dir.join("gone.toml");
        let e = Args::parse_from(["kemari", "--config", gone.to_str().unwrap()])
            .machine_config()
            .unwrap_err();
        assert!(std::error::Error::source(&e).is_none(), "{e:?}");
        let text = e.to_string();
        assert_eq!(text.matches("No such file").count(), 1, "{text}");
        assert!(text.contains("check the path"), "{text}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn api_socket_permissions_from_flags_or_file() {
        let a = Args::parse_from(["kemari", "--kernel", "/k"]);
        assert_eq!(a.api_socket_options().unwrap().mode, 0o600);
        let a = Args::parse_from([
            "kemari",
            "--api-socket-mode",
            "0660",
            "--api-socket-group",
            "kvm",
        ]);
        let o = a.api_socket_options().unwrap();
        assert_eq!((o.mode, o.group.as_deref()), (0o660, Some("kvm")));
        assert!(Args::try_parse_from(["kemari", "--api-socket-mode", "0999"]).is_err());
        let dir = std::env::temp_dir().join(format!("kemari-cli-mode-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("vm.toml");
        std::fs::write(
            &cfg,
            "api_socket_mode = \"640\"\napi_socket_group = \"0\"\n",
        )
        .unwrap();
        let a = Args::parse_from(["kemari", "--config", cfg.to_str().unwrap()]);
        let o = a.api_socket_options().unwrap();
        assert_eq!((o.mode, o.group.as_deref()), (0o640, Some("0")));
        std::fs::write(&cfg, "api_socket_mode = \"rw\"\n").unwrap();
        let a = Args::parse_from(["kemari", "--config", cfg.to_str().unwrap()]);
        let e = a.api_socket_options().unwrap_err().to_string();
        assert!(e.starts_with("api_socket_mode = \"rw\" in "), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
