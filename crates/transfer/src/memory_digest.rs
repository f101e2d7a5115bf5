//! A debugging aid for lost pages (`KEMARI_DEBUG_MEMORY_DIGEST=1` on both
//! ends): each end of a live migration logs a digest of every 2 MiB of
//! guest memory at the moment both must hold the same bytes — the source
//! paused with its last pages sent, the destination with every page
//! received and before the VM runs there. Chunks whose digests differ hold a
//! page lost in transit or never marked dirty. Reading the memory lengthens
//! the pause: for diagnosis only, off by default.

use std::fs::File;
use std::os::unix::fs::FileExt;

/// The environment variable that turns the digests on.
pub const ENV: &str = "KEMARI_DEBUG_MEMORY_DIGEST";
/// Bytes per digest.
pub const CHUNK: usize = 2 << 20;

/// Whether [`ENV`] asks for digests.
pub fn enabled() -> bool {
    std::env::var_os(ENV).is_some_and(|v| v == "1")
}

/// The first 4 bytes of each chunk's BLAKE3 hash, as hex, comma-separated.
pub fn digests(file: &File, size: u64) -> std::io::Result<String> {
    let mut buf = vec![0u8; CHUNK];
    let mut out = String::with_capacity((size as usize / CHUNK + 1) * 9);
    let mut at = 0u64;
    while at < size {
        let n = (size - at).min(CHUNK as u64) as usize;
        file.read_exact_at(&mut buf[..n], at)?;
        let h = blake3::hash(&buf[..n]);
        if !out.is_empty() {
            out.push(',');
        }
        for b in &h.as_bytes()[..4] {
            out.push_str(&format!("{b:02x}"));
        }
        at += n as u64;
    }
    Ok(out)
}

/// Logs `side`'s digests (at WARN: asked for, and rare) if [`enabled`].
pub fn log_if_enabled(side: &str, file: &File, size: u64) {
    if !enabled() {
        return;
    }
    let started = std::time::Instant::now();
    match digests(file, size) {
        Ok(d) => tracing::warn!(
            side,
            chunk_bytes = CHUNK,
            took_ms = started.elapsed().as_millis() as u64,
            digests = d,
            "memory digest"
        ),
        Err(e) => tracing::warn!(side, error = %e, "memory digest: cannot read guest memory"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn one_digest_per_chunk_and_a_changed_byte_changes_only_its_own() {
        let mut f = tempfile_in_tmp();
        let size = (CHUNK * 2 + 4096) as u64;
        f.set_len(size).unwrap();
        let before = digests(&f, size).unwrap();
        assert_eq!(before.split(',').count(), 3);
        f.write_all_at(&[1], CHUNK as u64 + 7).unwrap();
        f.flush().unwrap();
        let after = digests(&f, size).unwrap();
        let changed: Vec<usize> = before
            .split(',')
            .zip(after.split(','))
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(changed, vec![1]);
    }

    fn tempfile_in_tmp() -> File {
        let path = std::env::temp_dir().join(format!("kemari-digest-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let _ = std::fs::remove_file(&path);
        f
    }
}
