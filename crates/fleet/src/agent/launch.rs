//! Starting a standby kemari on this host for a VM the agent claimed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::local::socket_of;

/// What a standby needs besides the VM's id.
#[derive(Debug, Clone)]
pub struct StandbyTemplate {
    /// The kemari binary.
    pub kemari: PathBuf,
    /// The address it listens on (an IP of this host).
    pub address: String,
    /// The migration key file.
    pub key_file: PathBuf,
    /// `--ft-fence`: the agent's etcd (same cluster and prefix).
    pub fence: String,
    /// Extra arguments (`--net tap=tap-{id}`…), `{id}` replaced.
    pub extra: Vec<String>,
    /// Its API socket, console, log and pid file go here.
    pub dir: PathBuf,
}

/// A standby started here.
#[derive(Debug)]
pub struct Launched {
    /// The process.
    pub child: Child,
    /// Its `host:port`.
    pub peer: String,
    /// Its address was published in the claim.
    pub published: bool,
}

/// A free TCP port on `address`.
fn free_port(address: &str) -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind((address, 0))?
        .local_addr()?
        .port())
}

/// The pid file of VM `id`'s standby.
pub fn pid_file(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.pid"))
}

impl StandbyTemplate {
    /// The arguments of VM `id`'s standby listening on `port`.
    pub fn args(&self, id: &str, port: u16) -> Vec<String> {
        let mut args = vec![
            "--ft-standby".to_owned(),
            format!("{}:{port}", self.address),
            "--migration-key-file".to_owned(),
            self.key_file.display().to_string(),
            "--ft-fence".to_owned(),
            self.fence.clone(),
            "--id".to_owned(),
            id.to_owned(),
            "--api-socket".to_owned(),
            socket_of(&self.dir, id).display().to_string(),
            "--serial".to_owned(),
            format!("file:{}", self.dir.join(format!("{id}.console")).display()),
        ];
        args.extend(self.extra.iter().map(|a| a.replace("{id}", id)));
        args
    }

    /// Starts VM `id`'s standby; its output goes to `DIR/ID.log`. It runs
    /// in its own process group: it outlives the agent.
    pub fn start(&self, id: &str) -> std::io::Result<Launched> {
        use std::os::unix::process::CommandExt;
        let port = free_port(&self.address)?;
        let socket = socket_of(&self.dir, id);
        // A socket left by a copy that was killed here.
        let _ = std::fs::remove_file(&socket);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{id}.log")))?;
        let child = Command::new(&self.kemari)
            .args(self.args(id, port))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .spawn()?;
        let _ = std::fs::write(pid_file(&self.dir, id), format!("{}\n", child.id()));
        Ok(Launched {
            child,
            peer: format!("{}:{port}", self.address),
            published: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_standby_gets_the_fence_its_socket_and_the_extra_arguments() {
        let t = StandbyTemplate {
            kemari: "/usr/bin/kemari".into(),
            address: "10.0.0.2".into(),
            key_file: "/etc/kemari/key".into(),
            fence: "etcd://e:2379/kemari/vms".into(),
            extra: vec!["--net".into(), "tap=tap-{id}".into()],
            dir: "/run/kemari".into(),
        };
        let a = t.args("web-1", 7100);
        let s: Vec<&str> = a.iter().map(String::as_str).collect();
        assert_eq!(
            s,
            [
                "--ft-standby",
                "10.0.0.2:7100",
                "--migration-key-file",
                "/etc/kemari/key",
                "--ft-fence",
                "etcd://e:2379/kemari/vms",
                "--id",
                "web-1",
                "--api-socket",
                "/run/kemari/web-1.sock",
                "--serial",
                "file:/run/kemari/web-1.console",
                "--net",
                "tap=tap-web-1",
            ]
        );
    }
}
