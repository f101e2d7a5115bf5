//! The VMM's metrics for Prometheus: `GET /metrics` on the API socket and,
//! with `--metrics-listen ADDR`, on a small TCP listener.
//!
//! [`prometheus`] builds the exposition at each scrape from what the API's
//! queries read ([`Shared`](crate::controller::Shared): the machine's
//! monitor, fault tolerance's status, the operations), plus the histograms
//! recorded where the samples happen (fault tolerance's pause and output
//! delay per sync, a hand-over's downtime). [`listener`] serves it over TCP.

pub mod listener;
pub mod prometheus;

pub use prometheus::{exposition, OperationMetrics, CONTENT_TYPE};
