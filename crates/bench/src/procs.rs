//! Child VMM processes and the scratch files of one measurement, all cleaned
//! up on drop — also when a measurement fails half-way.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::console::{Console, Line};

/// A VMM child process (kemari or QEMU) whose console and log are read by
/// threads of their own. Killed on drop.
pub struct Vmm {
    /// What it is, for messages ("source kemari", "destination QEMU").
    pub name: String,
    child: Child,
    /// Its stdout: the guest's serial console.
    pub console: Console,
    /// Its stderr: the VMM's log.
    pub log: Console,
}

impl Vmm {
    /// Starts `cmd` with stdin closed and stdout/stderr read by threads.
    pub fn spawn(name: impl Into<String>, mut cmd: Command) -> std::io::Result<Vmm> {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let console = child.stdout.take().map(Console::start);
        let log = child.stderr.take().map(Console::start);
        match (console, log) {
            (Some(console), Some(log)) => Ok(Vmm {
                name: name.into(),
                child,
                console,
                log,
            }),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                Err(std::io::Error::other("child has no stdout/stderr pipe"))
            }
        }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `timeout` for the process to exit; its exit status (as
    /// text) if it did.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => {
                    // Let the reader threads take the last lines.
                    self.console.wait_eof(Duration::from_secs(2));
                    return Some(st.to_string());
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Ok(None) => return None,
                Err(e) => return Some(format!("wait failed: {e}")),
            }
        }
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// The last lines of its log (stderr) and console, for error messages.
    pub fn tail(&self) -> String {
        let pick = |lines: Vec<Line>| {
            let n = lines.len().saturating_sub(5);
            lines[n..]
                .iter()
                .map(|l| l.text.clone())
                .collect::<Vec<_>>()
                .join(" | ")
        };
        format!(
            "{}: log [{}] console [{}]",
            self.name,
            pick(self.log.lines()),
            pick(self.console.lines())
        )
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        if !self.exited() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// The scratch directory and /dev/shm files of one measurement, removed on
/// drop. Declare it before the [`Vmm`]s that use it, so they die first.
pub struct Scratch {
    /// The directory (sockets, snapshots, state files).
    pub dir: PathBuf,
    shm: Vec<PathBuf>,
}

impl Scratch {
    /// Creates `parent/kemari-bench-<pid>-<seq>`.
    pub fn create(parent: &Path, seq: usize) -> std::io::Result<Scratch> {
        let dir = parent.join(format!("kemari-bench-{}-{seq}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(Scratch {
            dir,
            shm: Vec::new(),
        })
    }

    /// A path inside the scratch directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// A fresh /dev/shm file name, removed with the scratch.
    pub fn shm_file(&mut self, tag: &str) -> PathBuf {
        let p = PathBuf::from(format!(
            "/dev/shm/kemari-bench-{}-{}-{tag}",
            std::process::id(),
            self.shm.len()
        ));
        let _ = std::fs::remove_file(&p);
        self.shm.push(p.clone());
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for p in &self.shm {
            let _ = std::fs::remove_file(p);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Waits until something listens on TCP port `port` of 127.0.0.1 (read from
/// /proc/net/tcp: connecting to probe would be taken for the real client).
pub fn wait_listening(port: u16, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(table) = std::fs::read_to_string("/proc/net/tcp") {
            if listening(&table, port) {
                return true;
            }
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Whether a /proc/net/tcp table has a socket listening on 127.0.0.1:`port`.
fn listening(table: &str, port: u16) -> bool {
    let local = format!("0100007F:{port:04X}");
    table.lines().skip(1).any(|l| {
        let mut f = l.split_whitespace().skip(1);
        let (addr, st) = (f.next(), f.nth(1));
        addr == Some(local.as_str()) && st == Some("0A")
    })
}

/// Waits until `path` exists.
pub fn wait_path(path: &Path, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while !path.exists() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// Writes a pre-shared key file as kemari wants it: readable by its owner
/// only (0600).
pub fn write_key(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?
        .write_all(text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_listening_sockets() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue\n   \
            0: 0100007F:7530 00000000:0000 0A 00000000:00000000\n   \
            1: 0100007F:7531 0100007F:9C40 01 00000000:00000000\n";
        assert!(listening(table, 30000));
        assert!(!listening(table, 30001), "established, not listening");
        assert!(!listening(table, 30002));
    }
}
