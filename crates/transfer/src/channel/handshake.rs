//! The handshake: who speaks, which version, how the link is protected, and
//! proof that both ends hold the same pre-shared key.
//!
//! ```text
//! initiator                                          acceptor
//!   Hello{magic, version, nonce_i, protection} ───▶
//!   ◀───────────────── Hello{magic, version, nonce_a, protection}  (always)
//! encrypted (the default between hosts): Noise_NNpsk0_25519_AESGCM_SHA256,
//!   prologue = both Hellos, psk = BLAKE3-derive(psk file)
//!   [u16 len] Noise → e ─────────────────────────▶ decrypts with the psk (else: wrong key)
//!   ◀───────────── verdict u8 (0 = accepted) [u16 len] Noise ← e, ee
//!   every later frame encrypted and authenticated (AES-256-GCM, counter nonces)
//! plaintext (--plaintext-link, a trusted dedicated link):
//!   key = BLAKE3-derive("kemari hand-over v6 session key", psk ‖ nonce_i ‖ nonce_a)
//!   proof_i = BLAKE3-keyed(key, "proof" ‖ 1) ─────▶ checked
//!   ◀───────────── verdict u8 ‖ proof_a = BLAKE3-keyed(key, "proof" ‖ 2)
//!   every later frame carries a BLAKE3 keyed tag
//! local (a Unix socket between two processes of one user): nothing more;
//!   the initiator sends its first frames right after its Hello and reads
//!   the acceptor's Hello before the first frame it receives
//! ```
//!
//! Each end names what went wrong in the operator's terms: another version,
//! another protection setting, a key the other end refused.

use std::fs::File;
use std::io::{Read, Write};

use crate::error::{Peer, TransferError};
use crate::message::VERSION;

/// Handshake magic.
pub const MAGIC: &[u8; 10] = b"KEMARI-MIG";
pub(super) const HELLO_LEN: usize = 10 + 4 + 32 + 1;
const KEY_CONTEXT: &str = "kemari hand-over v6 session key";
const NOISE_PSK_CONTEXT: &str = "kemari hand-over v6 noise psk";
const NOISE_PARAMS: &str = "Noise_NNpsk0_25519_AESGCM_SHA256";
/// Longest handshake message accepted.
const MAX_HANDSHAKE: usize = 1024;

/// How the ends know each other, and how the link is protected.
#[derive(Debug, Clone, Copy)]
pub enum Auth<'a> {
    /// A pre-shared key (≥ 16 bytes) and an encrypted link: TCP links
    /// between hosts, the default.
    Psk(&'a [u8]),
    /// A pre-shared key and an authenticated but not encrypted link: the
    /// documented opt-out for a trusted, dedicated link (`--plaintext-link`).
    PskPlaintext(&'a [u8]),
    /// Two processes on one host over a Unix socket: no key, no tags.
    Local,
}

impl<'a> Auth<'a> {
    /// The pre-shared key `key`, on an encrypted link unless `plaintext`.
    pub fn psk(key: &'a [u8], plaintext: bool) -> Self {
        if plaintext {
            Auth::PskPlaintext(key)
        } else {
            Auth::Psk(key)
        }
    }

    fn protection_byte(&self) -> u8 {
        match self {
            Auth::Local => 0,
            Auth::Psk(_) => 1,
            Auth::PskPlaintext(_) => 2,
        }
    }
}

fn describe(protection: u8) -> &'static str {
    match protection {
        0 => "a local, unprotected link",
        1 => "an encrypted link",
        2 => "an authenticated plaintext link (--plaintext-link)",
        _ => "an unknown link protection",
    }
}

/// Which end of the channel this is (part of each tag, so a frame cannot
/// be reflected back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The end that connects and offers the VM.
    Initiator = 1,
    /// The end that accepts it.
    Acceptor = 2,
}

impl Side {
    pub(super) fn other(self) -> Side {
        match self {
            Side::Initiator => Side::Acceptor,
            Side::Acceptor => Side::Initiator,
        }
    }
}

/// How the frames of a channel are protected after the handshake.
#[derive(Clone)]
pub enum Protection {
    /// Not at all (a local channel).
    None,
    /// BLAKE3 keyed tags with the session key.
    Tagged([u8; 32]),
    /// Noise transport encryption (AES-256-GCM).
    Encrypted(std::sync::Arc<super::transport::NoiseCiphers>),
}

fn hello(nonce: &[u8; 32], protection: u8) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[..10].copy_from_slice(MAGIC);
    h[10..14].copy_from_slice(&VERSION.to_le_bytes());
    h[14..46].copy_from_slice(nonce);
    h[46] = protection;
    h
}

/// A peer's `Hello`: its nonce, version and protection.
pub(super) struct PeerHello {
    nonce: [u8; 32],
    pub(super) version: u32,
    protection: u8,
}

pub(super) fn parse_hello(h: &[u8; HELLO_LEN], peer: Peer) -> Result<PeerHello, TransferError> {
    if &h[..10] != MAGIC {
        return Err(TransferError::NotKemari { peer });
    }
    let mut nonce = [0u8; 32];
    nonce.copy_from_slice(&h[14..46]);
    Ok(PeerHello {
        nonce,
        version: u32::from_le_bytes([h[10], h[11], h[12], h[13]]),
        protection: h[46],
    })
}

/// The acceptor's hello of a local channel, read with the first frame:
/// Err unless it is kemari's, of this version, local.
pub(super) fn check_local_hello(h: &[u8; HELLO_LEN], peer: Peer) -> Result<(), TransferError> {
    agree(&parse_hello(h, peer)?, Auth::Local.protection_byte(), peer)
}

/// Err unless the peer speaks this version and protects the link alike.
fn agree(theirs: &PeerHello, ours: u8, peer: Peer) -> Result<(), TransferError> {
    if theirs.version != VERSION {
        return Err(TransferError::Version {
            peer,
            theirs: theirs.version,
            ours: VERSION,
        });
    }
    if theirs.protection != ours {
        return Err(TransferError::Mismatch(format!(
            "the {peer} expects {}, this end {}: give both ends the same --plaintext-link setting",
            describe(theirs.protection),
            describe(ours)
        )));
    }
    Ok(())
}

fn random_nonce() -> Result<[u8; 32], TransferError> {
    let mut n = [0u8; 32];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut n))
        .map_err(TransferError::file("/dev/urandom"))?;
    Ok(n)
}

/// An I/O error in the handshake: a peer that hangs up there is most likely
/// refusing our key or not kemari at all.
fn handshake_io(peer: Peer, e: std::io::Error) -> TransferError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => TransferError::ClosedInHandshake { peer },
        _ => TransferError::io(peer, "in the handshake", None, e),
    }
}

fn session_key(psk: &[u8], nonce_i: &[u8; 32], nonce_a: &[u8; 32]) -> [u8; 32] {
    let mut material = Vec::with_capacity(psk.len() + 64);
    material.extend_from_slice(psk);
    material.extend_from_slice(nonce_i);
    material.extend_from_slice(nonce_a);
    blake3::derive_key(KEY_CONTEXT, &material)
}

fn proof(key: &[u8; 32], side: Side) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(b"proof");
    h.update(&[side as u8]);
    *h.finalize().as_bytes()
}

fn noise(
    psk: &[u8],
    hello_i: &[u8; HELLO_LEN],
    hello_a: &[u8; HELLO_LEN],
    side: Side,
) -> Result<snow::HandshakeState, TransferError> {
    let failed = |e: snow::Error| TransferError::Memory(format!("the Noise handshake: {e}"));
    let key = blake3::derive_key(NOISE_PSK_CONTEXT, psk);
    let mut prologue = Vec::with_capacity(2 * HELLO_LEN);
    prologue.extend_from_slice(hello_i);
    prologue.extend_from_slice(hello_a);
    let params = NOISE_PARAMS.parse().map_err(failed)?;
    let builder = snow::Builder::new(params)
        .psk(0, &key)
        .map_err(failed)?
        .prologue(&prologue)
        .map_err(failed)?;
    match side {
        Side::Initiator => builder.build_initiator(),
        Side::Acceptor => builder.build_responder(),
    }
    .map_err(failed)
}

/// The transport ciphers of a finished handshake.
fn transport(mut hs: snow::HandshakeState, initiator: bool) -> Protection {
    let ciphers = super::transport::NoiseCiphers::new(hs.dangerously_get_raw_split(), initiator);
    Protection::Encrypted(std::sync::Arc::new(ciphers))
}

fn write_noise(stream: &mut impl Write, msg: &[u8]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(2 + msg.len());
    out.extend_from_slice(&(msg.len() as u16).to_le_bytes());
    out.extend_from_slice(msg);
    stream.write_all(&out)
}

fn read_noise(stream: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 2];
    stream.read_exact(&mut len)?;
    let len = usize::from(u16::from_le_bytes(len));
    if len > MAX_HANDSHAKE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "a handshake message over the limit",
        ));
    }
    let mut msg = vec![0u8; len];
    stream.read_exact(&mut msg)?;
    Ok(msg)
}

/// The initiator's handshake; how the link is then protected.
pub(super) fn initiate<S: Read + Write>(
    stream: &mut S,
    auth: Auth<'_>,
    peer: Peer,
) -> Result<Protection, TransferError> {
    let closed = |e: std::io::Error| handshake_io(peer, e);
    if let Auth::Local = auth {
        // No key, no nonce; the acceptor's hello is read with its first
        // frame (Channel::recv): no round trip before the offer.
        stream
            .write_all(&hello(&[0; 32], auth.protection_byte()))
            .map_err(closed)?;
        return Ok(Protection::None);
    }
    let nonce = random_nonce()?;
    let ours = hello(&nonce, auth.protection_byte());
    stream.write_all(&ours).map_err(closed)?;
    let mut theirs = [0u8; HELLO_LEN];
    stream.read_exact(&mut theirs).map_err(closed)?;
    let peer_hello = parse_hello(&theirs, peer)?;
    agree(&peer_hello, auth.protection_byte(), peer)?;
    match auth {
        Auth::Local => Ok(Protection::None),
        Auth::PskPlaintext(psk) => {
            let key = session_key(psk, &nonce, &peer_hello.nonce);
            stream
                .write_all(&proof(&key, Side::Initiator))
                .map_err(closed)?;
            let mut answer = [0u8; 1 + 32];
            stream.read_exact(&mut answer).map_err(closed)?;
            if answer[0] != 0 {
                return Err(TransferError::KeyRefused { peer });
            }
            let expected = blake3::Hash::from(proof(&key, Side::Acceptor));
            if expected != blake3::Hash::from(<[u8; 32]>::try_from(&answer[1..]).unwrap_or([0; 32]))
            {
                return Err(TransferError::KeyMismatch { peer });
            }
            Ok(Protection::Tagged(key))
        }
        Auth::Psk(psk) => {
            let mut hs = noise(psk, &ours, &theirs, Side::Initiator)?;
            let mut msg = [0u8; MAX_HANDSHAKE];
            let n = hs
                .write_message(&[], &mut msg)
                .map_err(|e| TransferError::Memory(format!("the Noise handshake: {e}")))?;
            write_noise(stream, &msg[..n]).map_err(closed)?;
            let mut verdict = [0u8; 1];
            stream.read_exact(&mut verdict).map_err(closed)?;
            if verdict[0] != 0 {
                return Err(TransferError::KeyRefused { peer });
            }
            let reply = read_noise(stream).map_err(closed)?;
            hs.read_message(&reply, &mut msg)
                .map_err(|_| TransferError::KeyMismatch { peer })?;
            Ok(transport(hs, true))
        }
    }
}

/// The acceptor's handshake; how the link is then protected.
pub(super) fn accept<S: Read + Write>(
    stream: &mut S,
    auth: Auth<'_>,
    peer: Peer,
) -> Result<Protection, TransferError> {
    let closed = |e: std::io::Error| handshake_io(peer, e);
    let mut theirs = [0u8; HELLO_LEN];
    stream.read_exact(&mut theirs).map_err(closed)?;
    let peer_hello = parse_hello(&theirs, peer)?;
    // Our hello even to another version or protection: the other end then
    // names the mismatch too, instead of seeing a closed connection.
    let nonce = match auth {
        Auth::Local => [0; 32],
        _ => random_nonce()?,
    };
    let ours = hello(&nonce, auth.protection_byte());
    stream.write_all(&ours).map_err(closed)?;
    agree(&peer_hello, auth.protection_byte(), peer)?;
    match auth {
        Auth::Local => Ok(Protection::None),
        Auth::PskPlaintext(psk) => {
            let key = session_key(psk, &peer_hello.nonce, &nonce);
            let mut their_proof = [0u8; 32];
            stream.read_exact(&mut their_proof).map_err(closed)?;
            let ok =
                blake3::Hash::from(proof(&key, Side::Initiator)) == blake3::Hash::from(their_proof);
            let mut answer = [0u8; 1 + 32];
            if ok {
                answer[1..].copy_from_slice(&proof(&key, Side::Acceptor));
            } else {
                answer[0] = 1;
            }
            stream.write_all(&answer).map_err(closed)?;
            if !ok {
                return Err(TransferError::KeyMismatch { peer });
            }
            Ok(Protection::Tagged(key))
        }
        Auth::Psk(psk) => {
            let mut hs = noise(psk, &theirs, &ours, Side::Acceptor)?;
            let first = read_noise(stream).map_err(closed)?;
            let mut msg = [0u8; MAX_HANDSHAKE];
            if hs.read_message(&first, &mut msg).is_err() {
                stream.write_all(&[1]).map_err(closed)?;
                return Err(TransferError::KeyMismatch { peer });
            }
            let n = hs
                .write_message(&[], &mut msg)
                .map_err(|e| TransferError::Memory(format!("the Noise handshake: {e}")))?;
            stream.write_all(&[0]).map_err(closed)?;
            write_noise(stream, &msg[..n]).map_err(closed)?;
            Ok(transport(hs, false))
        }
    }
}

#[cfg(test)]
pub(super) fn hello_for_test(version: u32, protection: u8) -> [u8; HELLO_LEN] {
    let mut h = hello(&[7; 32], protection);
    h[10..14].copy_from_slice(&version.to_le_bytes());
    h
}
