//! Device models: legacy ports (serial, i8042) and virtio devices.

pub mod block_backend;
pub mod virtio;
