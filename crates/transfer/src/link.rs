//! The two ways the shared sequences use a connection, so that one
//! pre-copy loop and one destination sequence serve a plain [`Channel`]
//! (live, local, warm) and fault tolerance's split link, whose halves a
//! heartbeat thread shares.

use std::fs::File;
use std::io::Write;

use crate::channel::{Channel, FdRead};
use crate::error::{Peer, TransferError};
use crate::message::{Kind, Message};
use crate::pages::PageFrame;

/// What the pre-copy loop needs of the sending end.
pub trait RoundLink {
    /// Sends one page batch of a pre-copy round.
    fn send_pages(&mut self, payload: &[u8]) -> Result<(), TransferError>;
    /// Sends the full `frame` as round `round` and leaves an empty frame in
    /// its place (several streams swap it for a free one: no copy).
    fn send_frame(&mut self, frame: &mut PageFrame, round: u32) -> Result<(), TransferError> {
        self.send_pages(frame.payload(round))?;
        frame.clear();
        Ok(())
    }
    /// Ends round `round` (`pages`: sent so far, all rounds) and waits until
    /// the receiving end has every page of it in memory.
    fn end_round(&mut self, round: u32, pages: u64) -> Result<(), TransferError>;
    /// Payload bytes sent so far.
    fn bytes_sent(&self) -> u64;
    /// What this end does now, for error messages.
    fn set_phase(&mut self, phase: String);
}

impl<S: FdRead + Write> RoundLink for Channel<S> {
    fn send_pages(&mut self, payload: &[u8]) -> Result<(), TransferError> {
        self.send(Kind::Pages, payload)
    }

    fn end_round(&mut self, round: u32, pages: u64) -> Result<(), TransferError> {
        self.send_msg(&Message::RoundEnd { round, pages })?;
        let mut buf = Vec::new();
        self.expect(
            &mut buf,
            "RoundAck",
            |m| matches!(m, Message::RoundAck { round: r } if *r == round),
        )?;
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    fn set_phase(&mut self, phase: String) {
        Channel::set_phase(self, phase);
    }
}

/// What the destination sequence needs of the receiving end.
pub trait Duplex {
    /// Receives one frame into `buf`; returns its kind.
    fn recv(&mut self, buf: &mut Vec<u8>) -> Result<Kind, TransferError>;
    /// Sends a control message.
    fn send_msg(&mut self, msg: &Message) -> Result<(), TransferError>;
    /// The fds received so far.
    fn take_fds(&mut self) -> Vec<File>;
    /// The other end.
    fn peer(&self) -> Peer;
    /// What this end does now, for error messages.
    fn set_phase(&mut self, phase: &'static str);
    /// The phase set last.
    fn phase(&self) -> String;

    /// Decodes a control frame received by [`recv`](Self::recv).
    fn decode(&self, buf: &[u8]) -> Result<Message, TransferError> {
        serde_json::from_slice(buf).map_err(|e| TransferError::Malformed {
            peer: self.peer(),
            phase: self.phase(),
            detail: format!("message: {e}"),
        })
    }

    /// A frame of `kind` where `expected` was due.
    fn out_of_order(&self, kind: Kind, expected: &'static str) -> TransferError {
        TransferError::Unexpected {
            peer: self.peer(),
            phase: self.phase(),
            got: format!("a {kind:?} frame"),
            expected,
        }
    }

    /// Message `got` where `expected` was due (the peer's `Failed` becomes
    /// its refusal).
    fn unexpected(&self, expected: &'static str, got: Message) -> TransferError {
        match got {
            Message::Failed { reason } => TransferError::Refused {
                peer: self.peer(),
                reason,
            },
            other => TransferError::Unexpected {
                peer: self.peer(),
                phase: self.phase(),
                got: other.name().to_owned(),
                expected,
            },
        }
    }

    /// Receives a control message.
    fn recv_msg(&mut self, buf: &mut Vec<u8>) -> Result<Message, TransferError> {
        match self.recv(buf)? {
            Kind::Control => self.decode(buf),
            other => Err(self.out_of_order(other, "a control message")),
        }
    }
}

impl<S: FdRead + Write> Duplex for Channel<S> {
    fn recv(&mut self, buf: &mut Vec<u8>) -> Result<Kind, TransferError> {
        Channel::recv(self, buf)
    }

    fn send_msg(&mut self, msg: &Message) -> Result<(), TransferError> {
        Channel::send_msg(self, msg)?;
        self.flush()
    }

    fn take_fds(&mut self) -> Vec<File> {
        Channel::take_fds(self)
    }

    fn peer(&self) -> Peer {
        Channel::peer(self)
    }

    fn set_phase(&mut self, phase: &'static str) {
        Channel::set_phase(self, phase);
    }

    fn phase(&self) -> String {
        Channel::phase(self).to_owned()
    }
}
