//! A real etcd cluster for a test: members started on free localhost ports
//! in a scratch folder (Debian's `etcd-server`), stopped, frozen, thawed
//! and killed one by one, and `etcdctl` (Debian's `etcd-client`) to read
//! it. Optionally with TLS on its client ports and client certificates
//! required (a CA, a server and a client certificate made by `openssl`).

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
    tls: Option<Tls>,
}

/// The PEM files of a cluster with TLS.
#[derive(Debug, Clone)]
pub struct Tls {
    /// The CA of every certificate.
    pub ca: PathBuf,
    /// A client certificate and its key.
    pub cert: PathBuf,
    /// See [`cert`](Self::cert).
    pub key: PathBuf,
}

/// Makes a CA, a server certificate for 127.0.0.1 and a client
/// certificate under `dir`; returns the client's files and the server's.
fn make_certificates(dir: &Path) -> (Tls, PathBuf, PathBuf) {
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .current_dir(dir)
            .args(args)
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    run(&[
        &["req", "-x509"][..],
        &ec,
        &[
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=kemari-test-ca",
        ],
    ]
    .concat());
    for (name, ext) in [
        (
            "server",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        ),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ] {
        std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
        run(&[
            &["req"][..],
            &ec,
            &[
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.csr"),
                "-subj",
                &format!("/CN=kemari-test-{name}"),
            ],
        ]
        .concat());
        run(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
        ]);
    }
    (
        Tls {
            ca: dir.join("ca.pem"),
            cert: dir.join("client.pem"),
            key: dir.join("client.key"),
        },
        dir.join("server.pem"),
        dir.join("server.key"),
    )
}

impl EtcdCluster {
    /// Starts `n` members under `dir` and waits until the cluster answers.
    pub fn start(dir: &Path, n: usize) -> EtcdCluster {
        Self::start_with(dir, n, false)
    }

    /// [`start`](Self::start), with TLS on the client ports and client
    /// certificates required.
    pub fn start_tls(dir: &Path, n: usize) -> EtcdCluster {
        Self::start_with(dir, n, true)
    }

    fn start_with(dir: &Path, n: usize, tls: bool) -> EtcdCluster {
        let dir = dir.join("etcd");
        std::fs::create_dir_all(&dir).unwrap();
        let certs = tls.then(|| make_certificates(&dir));
        let scheme = if tls { "https" } else { "http" };
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
            let mut etcd = Command::new("etcd");
            if let Some((_, cert, key)) = &certs {
                etcd.arg("--cert-file")
                    .arg(cert)
                    .arg("--key-file")
                    .arg(key)
                    .arg("--trusted-ca-file")
                    .arg(dir.join("ca.pem"))
                    .arg("--client-cert-auth");
            }
            let child = etcd
                .args(["--name", &name])
                .arg("--data-dir")
                .arg(dir.join(&name))
                .args([
                    "--listen-client-urls",
                    &format!("{scheme}://127.0.0.1:{client}"),
                    "--advertise-client-urls",
                    &format!("{scheme}://127.0.0.1:{client}"),
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
                    // Elections quick enough for a test, slow enough that
                    // a member starved by a loaded 2-core machine keeps
                    // its leadership.
                    "--heartbeat-interval",
                    "200",
                    "--election-timeout",
                    "2000",
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
        let cluster = EtcdCluster {
            dir,
            members,
            tls: certs.map(|(t, _, _)| t),
        };
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

    /// `--ft-fence` for this cluster: `etcd://ENDPOINTS/PREFIX?ttl=TTL`
    /// (and its TLS files).
    pub fn fence(&self, prefix: &str, ttl_s: u64) -> String {
        let mut f = format!("etcd://{}{prefix}?ttl={ttl_s}", self.endpoints());
        if let Some(t) = &self.tls {
            f += &format!(
                "&cacert={}&cert={}&key={}",
                t.ca.display(),
                t.cert.display(),
                t.key.display()
            );
        }
        f
    }

    /// The TLS files, for a cluster started with [`start_tls`](Self::start_tls).
    pub fn tls(&self) -> Option<&Tls> {
        self.tls.as_ref()
    }

    /// Runs `etcdctl ARGS` against the members still up; its stdout if it
    /// succeeded.
    pub fn ctl(&self, args: &[&str]) -> Option<String> {
        let endpoints: Vec<String> = self
            .members
            .iter()
            .filter(|m| m.process.is_some())
            .map(|m| {
                let scheme = if self.tls.is_some() { "https" } else { "http" };
                format!("{scheme}://127.0.0.1:{}", m.client)
            })
            .collect();
        let mut ctl = Command::new("etcdctl");
        if let Some(t) = &self.tls {
            ctl.arg(format!("--cacert={}", t.ca.display()))
                .arg(format!("--cert={}", t.cert.display()))
                .arg(format!("--key={}", t.key.display()));
        }
        let out = ctl
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
