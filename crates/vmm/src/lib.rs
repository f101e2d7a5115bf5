//! The kemari machine: a KVM virtual machine (memory, vCPUs, devices, boot) that
//! the availability layers (snapshot, warm restart, migration, fault tolerance)
//! build on.

pub mod acpi;
pub mod boot;
pub mod config;
pub mod devices;
pub mod dirty;
pub mod layout;
pub mod machine;
pub mod memory;
pub mod output;
pub mod persist;
pub mod seccomp;
pub mod sys;
pub mod unix_socket;
pub mod virtio_devices;
pub mod vstate;
