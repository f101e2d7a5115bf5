//! Several TCP connections for one live migration (`--connections N`): the
//! main connection keeps the control messages, the pages sent with the
//! guest paused and the state; the pre-copy's page frames go over N − 1
//! page streams, each sealed and written by a thread of its own on the
//! source ([`send`]) and read and written into guest memory by a thread of
//! its own on the destination ([`receive`]).
//!
//! ```text
//! source                                            destination
//!   Offer{…, streams: N} ───────────────────────────▶ (an older kemari ignores
//!   ◀──────────────── StreamsReady{N, session}          the field and says Ready:
//!                                                       refused by the source)
//!   N − 1 times: connect, handshake (same key and protection),
//!   Join{session, i} ───────────────────────────────▶ accepted; any other refused
//!   per round r: Pages… RoundEnd{r} on each stream, then RoundEnd{r} on the
//!   main one ─────────────────────────────────────────▶ RoundAck{r} once every
//!                                                       stream ended round r
//! ```
//!
//! The order: each stream is one TCP byte stream read by one thread that
//! writes a batch into memory before it reads the next frame, so a stream's
//! `RoundEnd{r}` is read after every page it carried in round r is in
//! memory. The destination acknowledges round r only when every stream
//! reported its `RoundEnd{r}` ([`RoundTally`]), and the source reads no page
//! of round r + 1 before that acknowledgement. So no page of round r can
//! land after round r + 1's copy of it, and nothing of the pre-copy is in
//! flight when the guest pauses: the final pages go on the main connection.

pub mod receive;
pub mod send;
mod tally;

pub use tally::{RoundStatus, RoundTally, StreamEvent};

/// Most connections a migration may use.
pub const MAX_CONNECTIONS: u8 = 8;
