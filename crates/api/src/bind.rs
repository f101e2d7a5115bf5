//! Binding the API socket without destroying files: the shared
//! `kemari-unix-socket` crate (also used by the VMM's other sockets and by
//! `kemari-nbd`), under its old path.

pub use kemari_unix_socket::{
    bind, parse_mode, remove_if_ours, BindError, SocketIdentity, SocketOptions,
};
