//! [`MachineError`]: what can fail while building, restoring or controlling
//! a machine, with the failing part as its source.

use super::RunState;
use crate::boot::{self, BootError};
use crate::config::ConfigError;
use crate::devices::bus::BusError;
use crate::devices::event_loop::EventLoopError;
use crate::dirty::DirtyError;
use crate::memory::MemoryError;
use crate::persist;
use crate::virtio_devices::AttachError;
use crate::vstate::vcpu::VcpuError;
use crate::vstate::vm::VmError;

/// Errors while building or controlling a machine.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Guest memory.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// KVM VM.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// vCPU.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// Kernel loading.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// Device wiring.
    #[error("device set-up: {0}")]
    Bus(#[from] BusError),
    /// virtio device creation.
    #[error(transparent)]
    Attach(#[from] AttachError),
    /// Device event loop.
    #[error(transparent)]
    EventLoop(#[from] EventLoopError),
    /// Dirty-page tracking.
    #[error(transparent)]
    Dirty(#[from] DirtyError),
    /// ACPI tables could not be built.
    #[error(transparent)]
    Acpi(#[from] crate::acpi::AcpiError),
    /// The bzImage could not be loaded.
    #[error(transparent)]
    BzImage(#[from] boot::bzimage::BzImageError),
    /// The serial console's output could not be opened.
    #[error("serial console output {path}")]
    Serial {
        /// The file or socket.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// An eventfd could not be created.
    #[error("cannot create an eventfd")]
    EventFd(#[source] std::io::Error),
    /// A vCPU's state could not be saved or restored.
    #[error(transparent)]
    VcpuState(#[from] persist::vcpu::VcpuStateError),
    /// The VM-wide KVM state could not be saved or restored.
    #[error(transparent)]
    VmState(persist::VmStateError),
    /// Saved state that cannot be restored here.
    #[error("cannot restore the saved state: {0}")]
    InvalidState(String),
    /// The operation does not apply in the current state.
    #[error("the VM is {0}")]
    State(RunState),
    /// A device backend could not be released.
    #[error("cannot release the backend of {device}")]
    Release {
        /// The device.
        device: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// What the guest wrote to a device's backend could not be made durable
    /// for a saved state (virtio-pmem: the backing's fsync failed).
    #[error("cannot sync the backend of {0}")]
    DeviceSync(String, #[source] std::io::Error),
}
