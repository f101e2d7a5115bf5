//! Where the serial console's output goes: nowhere, the process's standard
//! output, a file, or the client of a Unix socket (with a backlog for a
//! client that connects later).

use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Where the serial console's output goes.
pub enum SerialOutput {
    /// Discarded.
    Null,
    /// The process's standard output.
    Stdout,
    /// A file (appended).
    File(std::fs::File),
    /// The clients of a Unix socket (see [`SerialSocket`]).
    Socket(SerialSocket),
}

impl Write for SerialOutput {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            SerialOutput::Null => Ok(buf.len()),
            SerialOutput::Stdout => {
                let mut out = io::stdout().lock();
                out.write_all(buf)?;
                if buf.contains(&b'\n') {
                    out.flush()?;
                }
                Ok(buf.len())
            }
            SerialOutput::File(f) => f.write(buf),
            SerialOutput::Socket(s) => {
                s.send(buf);
                Ok(buf.len())
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            SerialOutput::Stdout => io::stdout().flush(),
            SerialOutput::File(f) => f.flush(),
            _ => Ok(()),
        }
    }
}

/// A listening Unix socket for the console: output goes to the connected client
/// (the last 64 KiB are kept for a client that connects later).
#[derive(Clone)]
pub struct SerialSocket {
    inner: Arc<Mutex<SocketState>>,
}

#[derive(Default)]
struct SocketState {
    client: Option<UnixStream>,
    backlog: Vec<u8>,
}

const SOCKET_BACKLOG: usize = 64 << 10;

impl SerialSocket {
    /// Binds `path` (replacing a stale socket) and accepts clients in the background.
    pub fn bind(path: &Path) -> io::Result<Self> {
        let listener = crate::unix_socket::bind_listening(path)?;
        let sock = SerialSocket {
            inner: Arc::new(Mutex::new(SocketState::default())),
        };
        let inner = sock.inner.clone();
        std::thread::Builder::new()
            .name("serial-accept".into())
            .spawn(move || {
                for mut stream in listener.incoming().flatten() {
                    let mut st = inner.lock().unwrap_or_else(|p| p.into_inner());
                    let backlog = std::mem::take(&mut st.backlog);
                    if stream.write_all(&backlog).is_ok() {
                        st.client = Some(stream);
                    }
                }
            })?;
        Ok(sock)
    }

    fn send(&self, buf: &[u8]) {
        let mut st = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = &mut st.client {
            if c.write_all(buf).is_ok() {
                return;
            }
            st.client = None;
        }
        st.backlog.extend_from_slice(buf);
        if st.backlog.len() > SOCKET_BACKLOG {
            let cut = st.backlog.len() - SOCKET_BACKLOG;
            st.backlog.drain(..cut);
        }
    }
}
