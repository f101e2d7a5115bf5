//! A disk served over NBD (a kemari-nbd target or relocation proxy, or any
//! NBD server), through the nbd-client crate's blocking client — and kept
//! through the server's restart: a request that finds the connection lost
//! reconnects (for up to [`RECONNECT_WINDOW`], the export's size unchanged)
//! and is sent again, so the guest sees a slow request instead of an I/O
//! error. Requests are re-sent whole: a write of the same bytes to the same
//! place twice is the same write, and this backend has one request at a
//! time (the device event loop serves them in turn).
//!
//! What a reconnect cannot know: whether the server kept the writes it had
//! acknowledged and not yet flushed. A server process that restarts keeps
//! them (kemari-nbd, nbdkit and qemu-nbd write into the host's page cache
//! before they answer); a server host that rebooted within the window, or a
//! server with a write-back cache of its own, may not. Such a reconnect is
//! logged at WARN with that said (docs/nbd.md, "The client's checks"), as
//! QEMU's `reconnect-delay` does without a word.
//!
//! The device thread that finds the connection lost may not start threads
//! (its seccomp filter), and a client starts its receiving thread: each
//! backend has a [`Connector`] thread, started with it, that connects for
//! it.

use std::io;
use std::sync::mpsc::{self, Sender};
use std::time::{Duration, Instant};

use nbd_client::client::{Client, ClientError, NbdUrl};

use super::block_backend::{BlockBackend, BlockBackendError, SECTOR_SIZE};

/// How long a lost connection is tried again before the request that found
/// it lost fails. The device event loop waits meanwhile (its requests are
/// served in turn), so this is also the longest stall a server's restart
/// gives the VM's other devices.
pub const RECONNECT_WINDOW: Duration = Duration::from_secs(30);
/// One connection attempt while reconnecting (connect and handshake).
const ATTEMPT: Duration = Duration::from_secs(2);
/// The pause between attempts doubles up to this.
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// A thread that makes connections to one export on request, for a
/// thread that may not start the client's receiving thread itself.
struct Connector {
    asks: Sender<(Duration, Sender<Result<Client, ClientError>>)>,
}

impl Connector {
    /// Starts the thread (it ends with the connector); `None` where this
    /// thread may not start one.
    fn spawn(url: NbdUrl) -> Option<Connector> {
        if !crate::seccomp::this_thread_may_spawn() {
            return None;
        }
        let (asks, waiting) = mpsc::channel::<(Duration, Sender<Result<Client, ClientError>>)>();
        let started = std::thread::Builder::new()
            .name("nbd-connect".into())
            .spawn(move || {
                for (within, answer) in waiting {
                    let _ = answer.send(Client::connect_within(&url, within));
                }
            });
        match started {
            Ok(_) => Some(Connector { asks }),
            Err(e) => {
                tracing::warn!(error = %e, "NBD disk: no reconnecting thread; a lost connection will fail its requests");
                None
            }
        }
    }

    /// A new connection, within `within`.
    fn connect(&self, within: Duration) -> Result<Client, ClientError> {
        let (answer, answered) = mpsc::channel();
        self.asks
            .send((within, answer))
            .map_err(|_| ClientError::Closed)?;
        answered.recv().unwrap_or(Err(ClientError::Closed))
    }
}

/// An NBD export as a disk.
pub struct NbdBackend {
    client: Client,
    /// Reconnects (none: a lost connection fails its requests).
    connector: Option<Connector>,
    url: NbdUrl,
    /// The URL as given (the disk's identity).
    given: String,
    read_only: bool,
    /// Writes acknowledged since the last flush the server took.
    unflushed: bool,
    /// The last reconnect window ran out: later requests try once, at once.
    gave_up: bool,
    /// Connections made again.
    reconnects: u64,
}

fn nbd_io(e: ClientError) -> io::Error {
    io::Error::other(e)
}

impl NbdBackend {
    /// Connects to `url`; `read_only` also refuses writes the export would take.
    pub fn connect(url: &str, read_only: bool) -> Result<Self, BlockBackendError> {
        let fail = |source| BlockBackendError::Nbd {
            url: url.to_owned(),
            source,
        };
        let parsed = nbd_client::client::parse_url(url).map_err(fail)?;
        let client = Client::connect_url(&parsed).map_err(fail)?;
        let read_only = read_only || client.read_only();
        Ok(NbdBackend {
            client,
            connector: Connector::spawn(parsed.clone()),
            url: parsed,
            given: url.to_owned(),
            read_only,
            unflushed: false,
            gave_up: false,
            reconnects: 0,
        })
    }

    /// Runs `op`; if the connection was found lost, reconnects and runs it
    /// again.
    fn call<T>(&mut self, mut op: impl FnMut(&Client) -> Result<T, ClientError>) -> io::Result<T> {
        let lost = match op(&self.client) {
            Ok(v) => return Ok(v),
            // A socket error (sending), or the receiver found it closed.
            Err(e @ (ClientError::Io(_) | ClientError::Closed)) => e,
            Err(e) if self.client.is_closed() => e,
            // The server answered with an error: the connection is fine.
            Err(e) => return Err(nbd_io(e)),
        };
        self.reconnect(&lost)?;
        op(&self.client).map_err(nbd_io)
    }

    /// A new connection to the same export, tried for [`RECONNECT_WINDOW`]
    /// (once, if the last window ran out).
    fn reconnect(&mut self, lost: &ClientError) -> io::Result<()> {
        let Some(connector) = &self.connector else {
            return Err(io::Error::other(lost.to_string()));
        };
        let window = if self.gave_up {
            Duration::ZERO
        } else {
            RECONNECT_WINDOW
        };
        tracing::warn!(
            disk = %self.url,
            error = %lost,
            window_s = window.as_secs(),
            "NBD disk: the connection was lost; reconnecting"
        );
        let started = Instant::now();
        let mut pause = Duration::from_millis(50);
        loop {
            let tried = connector.connect(ATTEMPT);
            match tried {
                Ok(c) if c.size() != self.client.size() => {
                    self.gave_up = true;
                    let why = format!(
                        "the NBD export {} came back with {} bytes, not {}: not used",
                        self.url,
                        c.size(),
                        self.client.size()
                    );
                    tracing::error!(disk = %self.url, "{why}");
                    return Err(io::Error::other(why));
                }
                Ok(c) => {
                    self.client = c;
                    self.gave_up = false;
                    self.reconnects += 1;
                    let after_ms = started.elapsed().as_millis() as u64;
                    if self.unflushed {
                        tracing::warn!(
                            disk = %self.url,
                            after_ms,
                            "NBD disk: reconnected; writes acknowledged since the last flush are on the disk only if the server kept them through its restart"
                        );
                    } else {
                        tracing::warn!(disk = %self.url, after_ms, "NBD disk: reconnected");
                    }
                    return Ok(());
                }
                Err(e) if started.elapsed() + pause >= window => {
                    self.gave_up = true;
                    let why = format!(
                        "the connection to the NBD disk {} was lost and did not come back within {} s: {e}",
                        self.url,
                        window.as_secs()
                    );
                    tracing::error!(disk = %self.url, "{why}");
                    return Err(io::Error::other(why));
                }
                Err(_) => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(MAX_PAUSE);
                }
            }
        }
    }

    /// Runs a request that changes the disk.
    fn change<T>(&mut self, op: impl Fn(&Client) -> Result<T, ClientError>) -> io::Result<T> {
        let v = self.call(op)?;
        self.unflushed = true;
        Ok(v)
    }
}

impl BlockBackend for NbdBackend {
    fn size(&self) -> u64 {
        self.client.size() & !(SECTOR_SIZE - 1)
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&mut self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        // A read that lost its connection part-way is read again whole.
        self.call(|c| c.read_at(off, buf))
    }

    fn write_at(&mut self, off: u64, buf: &[u8]) -> io::Result<()> {
        if self.read_only {
            return Err(io::Error::from(io::ErrorKind::PermissionDenied));
        }
        self.change(|c| c.write_at(off, buf))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.call(|c| c.flush())?;
        self.unflushed = false;
        Ok(())
    }

    fn supports_discard(&self) -> bool {
        !self.read_only
    }

    fn discard(&mut self, off: u64, len: u64) -> io::Result<()> {
        self.change(|c| c.trim(off, len))
    }

    fn supports_write_zeroes(&self) -> bool {
        !self.read_only
    }

    fn write_zeroes(&mut self, off: u64, len: u64, _unmap: bool) -> io::Result<()> {
        self.change(|c| c.write_zeroes(off, len))
    }

    fn id(&self) -> String {
        self.given.clone()
    }

    fn reconnects(&self) -> u64 {
        self.reconnects
    }
}
