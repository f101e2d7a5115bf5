//! A real etcd cluster for a test: members started on free localhost ports
//! in a scratch folder (Debian's `etcd-server`), stopped, frozen, thawed
//! and killed one by one, and `etcdctl` (Debian's `etcd-client`) to read
//! it.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::net::free_port;
use crate::procs::{wait_for, KillOnDrop};

struct Member {
    name: String,
    client: u16,
    process: Option<KillOnDrop>,
}

/// A running etcd cluster; its members are killed when it is dropped.
pub struct EtcdCluster {
    dir: PathBuf,
    members: Vec<Member>,
}

impl EtcdCluster {
    /// Starts `n` members under `dir` and waits until the cluster answers.
    pub fn start(dir: &Path, n: usize) -> EtcdCluster {
        let dir = dir.join("etcd");
        std::fs::create_dir_all(&dir).unwrap();
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect();
        let token = format!("kemari-test-{}-{}", std::process::id(), ports[0].0);
        let mut members = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let name = format!("m{i}");
            let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
            let child = Command::new("etcd")
                .args(["--name", &name])
                .arg("--data-dir")
                .arg(dir.join(&name))
                .args([
                    "--listen-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                    "--advertise-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                    "--listen-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-advertise-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-cluster",
                    &initial.join(","),
                    "--initial-cluster-state",
                    "new",
                    "--initial-cluster-token",
                    &token,
                    // Quick elections on a busy 2-core machine, not too
                    // quick: a loaded member must not lose its leadership.
                    "--heartbeat-interval",
                    "100",
                    "--election-timeout",
                    "1000",
                ])
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("start etcd (Debian package etcd-server)");
            members.push(Member {
                name,
                client: *client,
                process: Some(KillOnDrop(child)),
            });
        }
        let cluster = EtcdCluster { dir, members };
        wait_for(
            "the etcd cluster to answer",
            Duration::from_secs(60),
            || cluster.ctl(&["put", "/kemari-test/ready", "1"]).is_some(),
        );
        cluster
    }

    /// The client endpoints, `127.0.0.1:P,…`.
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `--ft-fence` for this cluster: `etcd://ENDPOINTS/PREFIX?ttl=TTL`.
    pub fn fence(&self, prefix: &str, ttl_s: u64) -> String {
        format!("etcd://{}{prefix}?ttl={ttl_s}", self.endpoints())
    }

    /// Runs `etcdctl ARGS` against the members still up; its stdout if it
    /// succeeded.
    pub fn ctl(&self, args: &[&str]) -> Option<String> {
        let endpoints: Vec<String> = self
            .members
            .iter()
            .filter(|m| m.process.is_some())
            .map(|m| format!("http://127.0.0.1:{}", m.client))
            .collect();
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", endpoints.join(",")))
            .args(["--dial-timeout=1s", "--command-timeout=2s"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The value of `key` (None: absent, or etcd did not answer).
    pub fn get(&self, key: &str) -> Option<String> {
        let out = self.ctl(&["get", key, "--print-value-only"])?;
        let v = out.trim();
        (!v.is_empty()).then(|| v.to_owned())
    }

    /// Kills member `i` (SIGKILL) and leaves it down.
    pub fn kill(&mut self, i: usize) {
        if let Some(p) = self.members[i].process.take() {
            p.crash();
        }
    }

    /// Freezes every member (SIGSTOP): the cluster stops answering, its
    /// connections stay open — a partition as the clients see it.
    pub fn freeze(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Thaws every member (SIGCONT).
    pub fn thaw(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, sig: i32) {
        for m in &self.members {
            if let Some(p) = &m.process {
                // SAFETY: kill takes no memory; the pid is our child's.
                unsafe { libc::kill(p.0.id() as i32, sig) };
            }
        }
    }

    /// Whether member `i`'s client port takes connections.
    pub fn member_up(&self, i: usize) -> bool {
        TcpStream::connect(("127.0.0.1", self.members[i].client)).is_ok()
    }

    /// Member `i`'s log.
    pub fn log(&self, i: usize) -> PathBuf {
        self.dir.join(format!("{}.log", self.members[i].name))
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        // SIGKILL ends a frozen member too.
        for m in &mut self.members {
            m.process = None;
        }
    }
}
