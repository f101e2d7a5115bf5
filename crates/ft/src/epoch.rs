//! An epoch's state on the link: the `persist::format` container packed as
//! an LZ4 block with the previous epoch's state as dictionary, so that what
//! did not change between syncs costs next to nothing. Unpacking is bounded
//! (fuzzed: `crates/ft/fuzz`).

/// Largest state an epoch may carry once unpacked.
pub const MAX_STATE: usize =
    vmm::persist::format::MAX_PAYLOAD as usize + vmm::persist::format::HEADER_LEN;

/// Packs an epoch's state container for the link: LZ4 with the previous
/// epoch's state as dictionary, so what did not change costs next to nothing
/// (`[raw length u32 LE][LZ4 block]`).
pub fn pack_state(raw: &[u8], previous: &[u8]) -> Vec<u8> {
    lz4_flex::block::compress_prepend_size_with_dict(raw, previous)
}

/// Unpacks [`pack_state`]'s output with the same previous state; refuses
/// oversized or malformed input without allocating for it.
pub fn unpack_state(packed: &[u8], previous: &[u8]) -> Result<Vec<u8>, String> {
    let len = packed
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or("state shorter than its length")?;
    if len > MAX_STATE {
        return Err(format!("state of {len} bytes over the limit"));
    }
    let mut out = vec![0u8; len];
    let n = lz4_flex::block::decompress_into_with_dict(&packed[4..], &mut out, previous)
        .map_err(|e| format!("state does not unpack: {e}"))?;
    if n != len {
        return Err(format!("state unpacks to {n} bytes, {len} announced"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_deltas_round_trip_and_stay_small() {
        let a: Vec<u8> = (0..20_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect();
        let mut b = a.clone();
        b[1000] ^= 0xff;
        b[50_000] ^= 0x11;
        let first = pack_state(&a, &[]);
        assert_eq!(unpack_state(&first, &[]).unwrap(), a);
        let delta = pack_state(&b, &a);
        assert!(delta.len() < b.len() / 20, "{} bytes", delta.len());
        assert_eq!(unpack_state(&delta, &a).unwrap(), b);
        // The wrong dictionary does not silently give the right bytes.
        assert_ne!(unpack_state(&delta, &[]).ok(), Some(b.clone()));
    }

    #[test]
    fn hostile_packed_state_is_refused() {
        assert!(unpack_state(&[], &[]).is_err());
        assert!(unpack_state(&[0xff, 0xff, 0xff, 0x7f, 0], &[]).is_err());
        assert!(unpack_state(&[10, 0, 0, 0, 0xf0, 1, 2], &[]).is_err());
    }
}
