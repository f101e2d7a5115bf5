//! The pre-shared key of the TCP hand-overs (live migration, fault
//! tolerance).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::error::TransferError;

/// Shortest key accepted.
pub const MIN_KEY_BYTES: usize = 16;

/// Reads a pre-shared key (at least 16 bytes; surrounding whitespace
/// ignored) from a file only its owner may read or write (as ssh does with
/// a private key: a key others can read is no secret).
pub fn read_key(path: &Path) -> Result<Vec<u8>, TransferError> {
    let err = |reason: String| TransferError::Key {
        path: path.display().to_string(),
        reason,
    };
    let mode = std::fs::metadata(path)
        .map_err(|e| err(e.to_string()))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(err(format!(
            "group or others may read or write it (mode {:04o}): `chmod 600 {}`",
            mode & 0o7777,
            path.display()
        )));
    }
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

    fn write_private(p: &Path, text: &str) {
        std::fs::write(p, text).unwrap();
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600)).unwrap();
    }

    #[test]
    fn a_key_others_may_read_is_refused_with_what_to_do() {
        let p = std::env::temp_dir().join(format!("transfer-key-mode-{}", std::process::id()));
        write_private(&p, "0123456789abcdef0123\n");
        assert!(read_key(&p).is_ok());
        for mode in [0o644, 0o640, 0o604, 0o660] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = read_key(&p).unwrap_err().to_string();
            assert!(e.contains(&format!("mode {mode:04o}")), "{e}");
            assert!(e.contains("chmod 600"), "{e}");
        }
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn short_keys_are_refused() {
        let p = std::env::temp_dir().join(format!("transfer-key-{}", std::process::id()));
        write_private(&p, "short\n");
        let e = read_key(&p).unwrap_err();
        assert!(matches!(e, TransferError::Key { .. }), "{e}");
        write_private(&p, "0123456789abcdef0123\n");
        assert_eq!(read_key(&p).unwrap(), b"0123456789abcdef0123");
        std::fs::remove_file(p).unwrap();
    }
}
