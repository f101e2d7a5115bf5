//! TLS for NBD_OPT_STARTTLS, with OpenSSL: X.509 certificates
//! (`--tls-certificates DIR`, the nbdkit/qemu layout) or pre-shared keys
//! (`--tls-psk FILE`, psktool's `identity:hexkey` lines).
//!
//! OpenSSL rather than rustls because rustls has no TLS-PSK, and one TLS
//! stack serves both modes. TLS 1.2 or later; renegotiation is refused.
//!
//! After the handshake ([`TlsServer::accept`]) a relay thread ([`relay`])
//! owns the TLS stream and moves bytes between it and a Unix socket pair;
//! the NBD session runs on the pair's other end as on any socket.
//!
//! | `--tls-certificates DIR` | meaning |
//! |---|---|
//! | `server-cert.pem` | the server's certificate (chain) |
//! | `server-key.pem` | its private key |
//! | `ca-cert.pem` (optional) | if present, clients must show a certificate it signed |

pub mod relay;

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use openssl::error::ErrorStack;
use openssl::ssl::{
    Ssl, SslContext, SslContextBuilder, SslFiletype, SslMethod, SslMode, SslOptions, SslStream,
    SslVerifyMode, SslVersion,
};
use openssl::x509::X509Name;
use thiserror::Error;

/// The files of a `--tls-certificates` directory.
pub const SERVER_CERT: &str = "server-cert.pem";
pub const SERVER_KEY: &str = "server-key.pem";
pub const CA_CERT: &str = "ca-cert.pem";

/// How long a client may take over its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest pre-shared key (bytes), identity and PSK file.
const MAX_PSK_LEN: usize = 256;
const MAX_IDENTITY_LEN: usize = 1024;
const MAX_PSK_FILE: u64 = 1 << 20;

#[derive(Debug, Error)]
pub enum TlsError {
    #[error("TLS is not set up on this server")]
    NotConfigured,
    #[error("--tls-certificates {dir}: no {file} there (the directory holds server-cert.pem, server-key.pem and, to require client certificates, ca-cert.pem)")]
    MissingFile { dir: PathBuf, file: &'static str },
    #[error("--tls-certificates {dir}: cannot load {file}")]
    Certificates {
        dir: PathBuf,
        file: &'static str,
        #[source]
        source: ErrorStack,
    },
    #[error("--tls-psk {path}: cannot read it")]
    PskFile {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("--tls-psk {path}, line {line}: {why} (expected IDENTITY:HEXKEY, as psktool writes)")]
    PskLine {
        path: PathBuf,
        line: usize,
        why: &'static str,
    },
    #[error("--tls-psk {0}: no keys in it")]
    PskEmpty(PathBuf),
    #[error("setting up TLS")]
    Context(#[source] ErrorStack),
    #[error("TLS handshake with the client failed: {0}")]
    Handshake(String),
    #[error("i/o on the TLS connection")]
    Io(#[from] io::Error),
}

/// Pre-shared keys by identity.
#[derive(Clone, Default)]
pub struct PskKeys {
    keys: HashMap<Vec<u8>, Vec<u8>>,
}

impl std::fmt::Debug for PskKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys themselves.
        write!(f, "PskKeys({} identities)", self.keys.len())
    }
}

/// Why a PSK line is refused (the caller adds the file and line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PskLineError {
    pub line: usize,
    pub why: &'static str,
}

impl PskKeys {
    /// Parses psktool's format: one `identity:hexkey` per line; empty lines
    /// and lines starting with `#` are skipped.
    pub fn parse(text: &str) -> Result<PskKeys, PskLineError> {
        let mut keys = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let bad = |why| PskLineError { line: i + 1, why };
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            let (identity, hex) = line.rsplit_once(':').ok_or(bad("no ':'"))?;
            if identity.is_empty() {
                return Err(bad("empty identity"));
            }
            if identity.len() > MAX_IDENTITY_LEN {
                return Err(bad("identity longer than 1024 bytes"));
            }
            let key =
                decode_hex(hex.trim()).ok_or(bad("the key is not an even number of hex digits"))?;
            if key.is_empty() || key.len() > MAX_PSK_LEN {
                return Err(bad("the key must be 1 to 256 bytes"));
            }
            if keys.insert(identity.as_bytes().to_vec(), key).is_some() {
                return Err(bad("this identity appears twice"));
            }
        }
        Ok(PskKeys { keys })
    }

    /// Reads a `--tls-psk` file.
    pub fn load(path: &Path) -> Result<PskKeys, TlsError> {
        let io_err = |source| TlsError::PskFile {
            path: path.to_owned(),
            source,
        };
        let f = std::fs::File::open(path).map_err(io_err)?;
        let mut text = String::new();
        f.take(MAX_PSK_FILE)
            .read_to_string(&mut text)
            .map_err(io_err)?;
        let keys = PskKeys::parse(&text).map_err(|e| TlsError::PskLine {
            path: path.to_owned(),
            line: e.line,
            why: e.why,
        })?;
        if keys.keys.is_empty() {
            return Err(TlsError::PskEmpty(path.to_owned()));
        }
        Ok(keys)
    }

    /// The key of `identity`, if known.
    pub fn get(&self, identity: &[u8]) -> Option<&[u8]> {
        self.keys.get(identity).map(Vec::as_slice)
    }
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|d| u8::from_str_radix(d, 16).ok()))
        .collect()
}

/// A TLS server context: certificates or pre-shared keys.
pub struct TlsServer {
    context: SslContext,
}

fn builder() -> Result<SslContextBuilder, TlsError> {
    let mut b = SslContextBuilder::new(SslMethod::tls_server()).map_err(TlsError::Context)?;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(TlsError::Context)?;
    b.set_options(SslOptions::NO_RENEGOTIATION | SslOptions::CIPHER_SERVER_PREFERENCE);
    // The relay retries writes from a buffer that may have moved, and takes
    // partial writes.
    b.set_mode(SslMode::ENABLE_PARTIAL_WRITE | SslMode::ACCEPT_MOVING_WRITE_BUFFER);
    Ok(b)
}

impl TlsServer {
    /// X.509: `DIR/server-cert.pem`, `DIR/server-key.pem`, and with
    /// `DIR/ca-cert.pem` client certificates required and checked against it.
    pub fn with_certificates(dir: &Path) -> Result<TlsServer, TlsError> {
        let file = |name: &'static str| {
            let p = dir.join(name);
            p.is_file().then_some(p)
        };
        let missing = |file| TlsError::MissingFile {
            dir: dir.to_owned(),
            file,
        };
        let loading = |file: &'static str| {
            move |source| TlsError::Certificates {
                dir: dir.to_owned(),
                file,
                source,
            }
        };
        let cert = file(SERVER_CERT).ok_or_else(|| missing(SERVER_CERT))?;
        let key = file(SERVER_KEY).ok_or_else(|| missing(SERVER_KEY))?;
        let mut b = builder()?;
        b.set_certificate_chain_file(&cert)
            .map_err(loading(SERVER_CERT))?;
        b.set_private_key_file(&key, SslFiletype::PEM)
            .map_err(loading(SERVER_KEY))?;
        b.check_private_key().map_err(loading(SERVER_KEY))?;
        if let Some(ca) = file(CA_CERT) {
            b.set_ca_file(&ca).map_err(loading(CA_CERT))?;
            b.set_client_ca_list(X509Name::load_client_ca_file(&ca).map_err(loading(CA_CERT))?);
            b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
        }
        Ok(TlsServer { context: b.build() })
    }

    /// TLS-PSK with the keys of a `--tls-psk` file.
    pub fn with_psk_file(path: &Path) -> Result<TlsServer, TlsError> {
        TlsServer::with_psk(PskKeys::load(path)?)
    }

    /// TLS-PSK: a client names its identity and proves it holds the key.
    pub fn with_psk(keys: PskKeys) -> Result<TlsServer, TlsError> {
        let mut b = builder()?;
        let keys = Arc::new(keys);
        b.set_psk_server_callback(move |_ssl, identity, out| {
            let key = identity.and_then(|id| keys.get(id));
            match key {
                Some(k) if k.len() <= out.len() => {
                    out[..k.len()].copy_from_slice(k);
                    Ok(k.len())
                }
                _ => {
                    tracing::warn!(
                        identity = %String::from_utf8_lossy(identity.unwrap_or_default()),
                        "TLS-PSK: unknown identity"
                    );
                    // Zero: no key, the handshake fails.
                    Ok(0)
                }
            }
        });
        Ok(TlsServer { context: b.build() })
    }

    /// Runs the server's side of the handshake on `stream` (within
    /// [`HANDSHAKE_TIMEOUT`]) and starts its relay; returns the plain end.
    pub fn accept<S>(&self, stream: S) -> Result<UnixStream, TlsError>
    where
        S: Read + Write + AsRawFd + Send + 'static,
    {
        let fd = stream.as_raw_fd();
        relay::set_timeouts(fd, Some(HANDSHAKE_TIMEOUT))?;
        let tls = self.handshake(stream)?;
        relay::set_timeouts(fd, None)?;
        tracing::debug!(
            version = tls.ssl().version_str(),
            cipher = tls.ssl().current_cipher().map(|c| c.name()).unwrap_or("?"),
            "TLS established"
        );
        Ok(relay::spawn(tls)?)
    }

    fn handshake<S: Read + Write>(&self, stream: S) -> Result<SslStream<S>, TlsError> {
        let ssl = Ssl::new(&self.context).map_err(TlsError::Context)?;
        let mut tls = SslStream::new(ssl, stream).map_err(TlsError::Context)?;
        match tls.accept() {
            Ok(()) => Ok(tls),
            Err(e) => Err(TlsError::Handshake(e.to_string())),
        }
    }

    /// The handshake on a client's bytes given at once (the fuzzer's view):
    /// what the server answers is discarded.
    pub fn handshake_on_bytes(&self, input: &[u8]) -> Result<(), TlsError> {
        struct Duplex<'a>(io::Cursor<&'a [u8]>);
        impl Read for Duplex<'_> {
            fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
                self.0.read(b)
            }
        }
        impl Write for Duplex<'_> {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        self.handshake(Duplex(io::Cursor::new(input))).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_files_parse_as_psktool_writes_them() {
        let k = PskKeys::parse("alice:0a0B\n\n# comment\nbob:ff\r\n").unwrap();
        assert_eq!(k.get(b"alice"), Some(&[0x0a, 0x0b][..]));
        assert_eq!(k.get(b"bob"), Some(&[0xff][..]));
        assert_eq!(k.get(b"carol"), None);
        for (text, line) in [
            ("alice", 1),
            (":00", 1),
            ("a:0", 1),
            ("a:zz", 1),
            ("a:", 1),
            ("a:00\na:01", 2),
        ] {
            assert_eq!(PskKeys::parse(text).unwrap_err().line, line, "{text}");
        }
        assert!(PskKeys::parse(&format!("a:{}", "00".repeat(257))).is_err());
        assert!(format!("{:?}", k).contains("2 identities"));
    }

    #[test]
    fn missing_certificates_are_named() {
        let dir = std::env::temp_dir().join(format!("knbd-tls-none-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = TlsServer::with_certificates(&dir).err().unwrap();
        assert!(e.to_string().contains("server-cert.pem"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn garbage_is_no_handshake() {
        let s = TlsServer::with_psk(PskKeys::parse("a:00").unwrap()).unwrap();
        assert!(s.handshake_on_bytes(b"").is_err());
        assert!(s
            .handshake_on_bytes(&[0x16, 3, 1, 0, 5, 1, 0, 0, 1, 0])
            .is_err());
    }
}
