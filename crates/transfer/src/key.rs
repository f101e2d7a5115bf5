//! The pre-shared key of the TCP hand-overs (live migration, fault
//! tolerance).

use std::path::Path;

use crate::error::TransferError;

/// Shortest key accepted.
pub const MIN_KEY_BYTES: usize = 16;

/// Reads a pre-shared key (at least 16 bytes; surrounding whitespace
/// ignored).
pub fn read_key(path: &Path) -> Result<Vec<u8>, TransferError> {
    let err = |reason: String| TransferError::Key {
        path: path.display().to_string(),
        reason,
    };
    let raw = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    let key: Vec<u8> = raw.trim_ascii().to_vec();
    if key.len() < MIN_KEY_BYTES {
        return Err(err(format!(
            "shorter than {MIN_KEY_BYTES} bytes (make one with `head -c 32 /dev/urandom | base64 > KEY`)"
        )));
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_keys_are_refused() {
        let p = std::env::temp_dir().join(format!("transfer-key-{}", std::process::id()));
        std::fs::write(&p, "short\n").unwrap();
        let e = read_key(&p).unwrap_err();
        assert!(matches!(e, TransferError::Key { .. }), "{e}");
        std::fs::write(&p, "0123456789abcdef0123\n").unwrap();
        assert_eq!(read_key(&p).unwrap(), b"0123456789abcdef0123");
        std::fs::remove_file(p).unwrap();
    }
}
