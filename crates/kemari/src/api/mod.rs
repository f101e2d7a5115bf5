//! The control API: HTTP/1.1 + JSON on a Unix socket (docs/api.yaml).

pub mod client;
pub mod http;
pub mod routes;
pub mod server;
