//! KVM state of the machine: the VM, its vCPUs and their CPUID.

pub mod cpuid;
pub mod vcpu;
pub mod vm;

/// Something that ends or resets the VM, reported by a vCPU or a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmEvent {
    /// The guest powered off; `code` is 0 for a clean poweroff, non-zero for a
    /// failure the guest reported (exit port 0xf4).
    Poweroff {
        /// The guest's exit code.
        code: u32,
    },
    /// The guest asked for a reset (i8042, ACPI reset register, KVM reset
    /// event).
    Reset,
    /// The guest crashed: a vCPU triple-faulted (`KVM_EXIT_SHUTDOWN`), the
    /// CPU's way of giving up on an exception it cannot deliver. Not a reset
    /// the guest asked for: its registers were logged when it happened.
    Crashed {
        /// The vCPU that faulted.
        vcpu: u8,
        /// What happened, in a few words.
        reason: String,
    },
    /// The VM cannot continue.
    Error(String),
}

/// Where vCPUs and devices report [`VmEvent`]s: the owner of the machine decides
/// (a channel of its own, a log...).
#[derive(Clone)]
pub struct VmEventSink(std::sync::Arc<dyn Fn(VmEvent) + Send + Sync>);

impl VmEventSink {
    /// A sink calling `f` for each event.
    pub fn new(f: impl Fn(VmEvent) + Send + Sync + 'static) -> Self {
        VmEventSink(std::sync::Arc::new(f))
    }

    /// A sink forwarding to a channel.
    pub fn channel(tx: std::sync::mpsc::Sender<VmEvent>) -> Self {
        let tx = std::sync::Mutex::new(tx);
        Self::new(move |e| {
            let _ = tx.lock().unwrap_or_else(|p| p.into_inner()).send(e);
        })
    }

    /// Reports `event`.
    pub fn send(&self, event: VmEvent) {
        (self.0)(event)
    }
}

impl std::fmt::Debug for VmEventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("VmEventSink")
    }
}
