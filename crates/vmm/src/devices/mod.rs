//! Device models: the address buses, legacy ports (serial, i8042, exit port) and
//! virtio devices.

pub mod bus;
pub mod event_loop;
pub mod legacy;
pub mod virtio;
