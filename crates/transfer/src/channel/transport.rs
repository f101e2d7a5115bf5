//! The Noise transport ciphers of an encrypted link, applied in place.
//!
//! After the handshake (done by `snow`), each direction has its own
//! AES-256-GCM key and a message counter; a message is encrypted with
//! nonce `0⁴ ‖ counter (big-endian u64)` and no associated data, as the Noise
//! specification defines for `AESGCM` (§5.1, §12.3). `snow`'s transport
//! state applies the same cipher but copies each message between buffers
//! (twice on the way in, with an allocation, when the plaintext buffer is
//! the plaintext's size); here the receiver opens a message where it was
//! read and the sender seals one where it was built. The wire is unchanged:
//! a unit test checks both against `snow`'s transport state.

use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM};

/// AES-GCM's tag.
pub(super) const TAG: usize = 16;

/// The two directions' keys of one end of a link.
pub struct NoiseCiphers {
    send: LessSafeKey,
    receive: LessSafeKey,
}

/// A message failed its tag (or was sealed under another nonce or key).
#[derive(Debug)]
pub(super) struct Unauthentic;

fn key(raw: &[u8; 32]) -> LessSafeKey {
    // A 32-byte key is AES-256's length: never refused.
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, raw).expect("a 32-byte AES-256 key"))
}

fn nonce(counter: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

impl NoiseCiphers {
    /// The ciphers of the end that was the handshake's initiator or not,
    /// from the handshake's split keys (initiator → responder first).
    pub(super) fn new(split: ([u8; 32], [u8; 32]), initiator: bool) -> Self {
        let (i2r, r2i) = (key(&split.0), key(&split.1));
        if initiator {
            NoiseCiphers {
                send: i2r,
                receive: r2i,
            }
        } else {
            NoiseCiphers {
                send: r2i,
                receive: i2r,
            }
        }
    }

    /// Encrypts `plain` in place under message `counter`; returns its tag.
    pub(super) fn seal_in_place(&self, counter: u64, plain: &mut [u8]) -> [u8; TAG] {
        let tag: Tag = self
            .send
            .seal_in_place_separate_tag(nonce(counter), Aad::empty(), plain)
            // ring refuses only inputs over 2^36 bytes; a message is < 64 KiB.
            .expect("sealing a Noise message");
        let mut t = [0u8; TAG];
        t.copy_from_slice(tag.as_ref());
        t
    }

    /// Decrypts message `counter` (ciphertext followed by its tag) in place;
    /// returns the plaintext's length (the message's less the tag).
    pub(super) fn open_in_place(
        &self,
        counter: u64,
        message: &mut [u8],
    ) -> Result<usize, Unauthentic> {
        self.receive
            .open_in_place(nonce(counter), Aad::empty(), message)
            .map(|plain| plain.len())
            .map_err(|_| Unauthentic)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARAMS: &str = "Noise_NNpsk0_25519_AESGCM_SHA256";

    /// A finished NNpsk0 handshake: both ends' `snow` states.
    fn handshake() -> (snow::HandshakeState, snow::HandshakeState) {
        let psk = [9u8; 32];
        let build = || {
            snow::Builder::new(PARAMS.parse().unwrap())
                .psk(0, &psk)
                .unwrap()
        };
        let mut i = build().build_initiator().unwrap();
        let mut r = build().build_responder().unwrap();
        let (mut m, mut p) = ([0u8; 256], [0u8; 256]);
        let n = i.write_message(&[], &mut m).unwrap();
        r.read_message(&m[..n], &mut p).unwrap();
        let n = r.write_message(&[], &mut m).unwrap();
        i.read_message(&m[..n], &mut p).unwrap();
        (i, r)
    }

    #[test]
    fn same_wire_as_snow_both_ways() {
        let (mut i, mut r) = handshake();
        let ours_i = NoiseCiphers::new(i.dangerously_get_raw_split(), true);
        let ours_r = NoiseCiphers::new(r.dangerously_get_raw_split(), false);
        let snow_i = i.into_stateless_transport_mode().unwrap();
        let snow_r = r.into_stateless_transport_mode().unwrap();
        let plain: Vec<u8> = (0..1000u32).map(|x| (x * 7) as u8).collect();
        for counter in [0u64, 1, 5, u64::from(u32::MAX) + 3] {
            // snow seals (initiator), we open (responder) — and back.
            let mut wire = vec![0u8; plain.len() + TAG];
            let n = snow_i.write_message(counter, &plain, &mut wire).unwrap();
            assert_eq!(n, plain.len() + TAG);
            let len = ours_r.open_in_place(counter, &mut wire).unwrap();
            assert_eq!(&wire[..len], &plain[..]);

            let mut ours = plain.clone();
            let tag = ours_r.seal_in_place(counter, &mut ours);
            ours.extend_from_slice(&tag);
            let mut out = vec![0u8; plain.len()];
            let n = snow_i.read_message(counter, &ours, &mut out).unwrap();
            assert_eq!(&out[..n], &plain[..]);

            // And the other direction: we seal as the initiator, snow opens.
            let mut ours = plain.clone();
            let tag = ours_i.seal_in_place(counter, &mut ours);
            ours.extend_from_slice(&tag);
            let n = snow_r.read_message(counter, &ours, &mut out).unwrap();
            assert_eq!(&out[..n], &plain[..]);
        }
    }

    #[test]
    fn refuses_a_flipped_bit_a_wrong_counter_and_its_own_direction() {
        let (mut i, mut r) = handshake();
        let ours_i = NoiseCiphers::new(i.dangerously_get_raw_split(), true);
        let ours_r = NoiseCiphers::new(r.dangerously_get_raw_split(), false);
        let sealed = |counter| {
            let mut m = b"a page of guest memory".to_vec();
            let tag = ours_i.seal_in_place(counter, &mut m);
            m.extend_from_slice(&tag);
            m
        };
        let mut ok = sealed(3);
        assert!(ours_r.open_in_place(3, &mut ok).is_ok());
        let mut flipped = sealed(3);
        flipped[2] ^= 1;
        assert!(ours_r.open_in_place(3, &mut flipped).is_err());
        let mut replayed = sealed(3);
        assert!(ours_r.open_in_place(4, &mut replayed).is_err());
        // A message reflected back to its sender does not open.
        let mut reflected = sealed(3);
        assert!(ours_i.open_in_place(3, &mut reflected).is_err());
        let mut short = vec![0u8; TAG - 1];
        assert!(ours_r.open_in_place(0, &mut short).is_err());
    }
}
