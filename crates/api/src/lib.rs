//! kemari's control API: HTTP/1.1 + JSON on a Unix socket (docs/api.yaml,
//! docs/api.md).
//!
//! - [`routes`]: the typed requests ([`ApiRequest`]) and the one route table
//!   ([`routes::ROUTES`]) that the server, the client and `kemarictl` share;
//! - [`reply`]: what the VMM's controller answers ([`Reply`],
//!   [`ActionError`]); `status.rs` alone turns answers into HTTP statuses;
//! - [`server`]: the concurrent, bounded server ([`ApiServer`]) and
//!   [`bind`]: binding its socket without destroying files;
//! - [`client`]: calls for `kemarictl`, benchmarks and tests;
//!   [`latency`]: how long a `GET /vm` takes while other clients misbehave;
//! - [`http`]: the small, fuzzed HTTP/1.1 parser;
//! - [`metrics_listener`]: `GET /metrics` over TCP (`--metrics-listen`).

pub mod bind;
pub mod client;
pub mod http;
pub mod latency;
pub mod metrics_listener;
pub mod reply;
pub mod routes;
pub mod server;
mod status;

pub use reply::{ActionError, LineStream, Reply};
pub use routes::{ApiRequest, FtStartRequest, Routed};
pub use server::{ApiServer, Handler, Listening, ServerOptions};
pub use status::Refusal;
