//! Device models: the address buses, legacy ports (serial, i8042, exit port),
//! disk backends and virtio devices.

pub mod block_backend;
pub mod bus;
pub mod console_buffer;
pub mod event_loop;
pub mod legacy;
pub mod virtio;
