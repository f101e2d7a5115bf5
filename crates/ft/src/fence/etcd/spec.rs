//! `--ft-fence etcd://…`: where the etcd cluster is, under which prefix the
//! VMs' keys live, and how long a lease lasts.
//!
//! ```text
//! etcd://HOST:PORT[,HOST:PORT…][/PREFIX][?ttl=SECONDS][&cacert=PEM[&cert=PEM&key=PEM]]
//! etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379/kemari/vms?ttl=5
//! etcd://10.0.0.1:2379/kemari/vms?cacert=/etc/etcd/ca.pem&cert=/etc/kemari/etcd.pem&key=/etc/kemari/etcd.key
//! ```
//!
//! The key a VM's copies compete for is `PREFIX/ID` (the VM's `--id`).
//! With `cacert` the cluster is reached over TLS, its certificates checked
//! against that CA; `cert` and `key` add a client certificate (etcd's
//! `--client-cert-auth`).

use std::path::PathBuf;
use std::time::Duration;

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "/kemari/vms";
/// The default lease TTL, in seconds.
pub const DEFAULT_TTL_S: u64 = 5;
/// The shortest lease: etcd lengthens shorter ones to about this anyway
/// (its minimum lease TTL, 1.5 election timeouts with its defaults).
pub const MIN_TTL_S: u64 = 2;
/// The longest lease.
pub const MAX_TTL_S: u64 = 3600;

/// A parsed `etcd://` fence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdSpec {
    /// The cluster's client endpoints (`host:port`).
    pub endpoints: Vec<String>,
    /// The prefix of the VMs' keys, without a trailing `/`.
    pub prefix: String,
    /// The lease's time to live.
    pub ttl: Duration,
    /// TLS to the cluster, if asked for.
    pub tls: Option<EtcdTls>,
}

/// The PEM files of a TLS connection to etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// The CA the members' certificates must chain to.
    pub ca: PathBuf,
    /// A client certificate and its key.
    pub identity: Option<(PathBuf, PathBuf)>,
}

impl EtcdSpec {
    /// Parses `etcd://…` (see the module documentation); the error says
    /// what is wrong in the user's terms.
    pub fn parse(text: &str) -> Result<EtcdSpec, String> {
        let rest = text.strip_prefix("etcd://").ok_or_else(|| {
            format!("{text:?} is not an etcd fence (etcd://HOST:PORT[,HOST:PORT…][/PREFIX][?ttl=SECONDS])")
        })?;
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (hosts, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let mut endpoints = Vec::new();
        for host in hosts.split(',') {
            let ok = host
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p != 0));
            if !ok {
                return Err(format!(
                    "etcd endpoint {host:?} in {text:?} is not HOST:PORT"
                ));
            }
            endpoints.push(host.to_owned());
        }
        let prefix = prefix.trim_end_matches('/');
        let prefix = if prefix.is_empty() {
            DEFAULT_PREFIX.to_owned()
        } else {
            prefix.to_owned()
        };
        let mut ttl = DEFAULT_TTL_S;
        let (mut ca, mut cert, mut key) = (None, None, None);
        let file = |name: &str, v: &str| {
            if v.starts_with('/') {
                Ok(Some(PathBuf::from(v)))
            } else {
                Err(format!("{name}={v} in {text:?}: give an absolute path"))
            }
        };
        for pair in query.into_iter().flat_map(|q| q.split('&')) {
            match pair.split_once('=') {
                Some(("cacert", v)) => ca = file("cacert", v)?,
                Some(("cert", v)) => cert = file("cert", v)?,
                Some(("key", v)) => key = file("key", v)?,
                Some(("ttl", v)) => {
                    ttl = v
                        .parse()
                        .ok()
                        .filter(|t| (MIN_TTL_S..=MAX_TTL_S).contains(t))
                        .ok_or_else(|| {
                            format!("ttl={v} in {text:?}: the lease TTL must be {MIN_TTL_S}..={MAX_TTL_S} seconds")
                        })?
                }
                _ => {
                    return Err(format!(
                        "unknown parameter {pair:?} in {text:?} (known: ttl, cacert, cert, key)"
                    ))
                }
            }
        }
        let tls = match (ca, cert, key) {
            (None, None, None) => None,
            (Some(ca), None, None) => Some(EtcdTls { ca, identity: None }),
            (Some(ca), Some(c), Some(k)) => Some(EtcdTls {
                ca,
                identity: Some((c, k)),
            }),
            (None, _, _) => {
                return Err(format!(
                "{text:?}: a client certificate needs cacert= too (the CA of etcd's certificates)"
            ))
            }
            _ => return Err(format!("{text:?}: give cert= and key= together")),
        };
        Ok(EtcdSpec {
            endpoints,
            prefix,
            ttl: Duration::from_secs(ttl),
            tls,
        })
    }

    /// The key of the VM `id`.
    pub fn key(&self, id: &str) -> String {
        format!("{}/{id}", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_prefix_and_ttl() {
        let s = EtcdSpec::parse("etcd://a:2379,10.0.0.2:2379,[::1]:2379/fleet/vms/?ttl=7").unwrap();
        assert_eq!(s.endpoints, ["a:2379", "10.0.0.2:2379", "[::1]:2379"]);
        assert_eq!(s.prefix, "/fleet/vms");
        assert_eq!(s.ttl, Duration::from_secs(7));
        assert_eq!(s.key("web-1"), "/fleet/vms/web-1");
        let d = EtcdSpec::parse("etcd://127.0.0.1:2379").unwrap();
        assert_eq!(d.prefix, DEFAULT_PREFIX);
        assert_eq!(d.ttl, Duration::from_secs(DEFAULT_TTL_S));
        assert_eq!(d.tls, None);
        let t =
            EtcdSpec::parse("etcd://h:1/p?cacert=/ca.pem&cert=/c.pem&key=/k.pem&ttl=4").unwrap();
        assert_eq!(
            t.tls,
            Some(EtcdTls {
                ca: "/ca.pem".into(),
                identity: Some(("/c.pem".into(), "/k.pem".into()))
            })
        );
        assert_eq!(t.ttl, Duration::from_secs(4));
    }

    #[test]
    fn mistakes_are_named() {
        for (bad, says) in [
            ("/var/lib/fence", "not an etcd fence"),
            ("etcd://", "is not HOST:PORT"),
            ("etcd://h:0", "is not HOST:PORT"),
            ("etcd://h:1,/p", "\"\" in"),
            ("etcd://h:1?ttl=1", "2..=3600 seconds"),
            ("etcd://h:1?ttl=x", "ttl=x"),
            ("etcd://h:1?tls=1", "unknown parameter \"tls=1\""),
            ("etcd://h:1?cacert=ca.pem", "absolute path"),
            ("etcd://h:1?cert=/c&key=/k", "needs cacert"),
            ("etcd://h:1?cacert=/a&cert=/c", "together"),
        ] {
            let e = EtcdSpec::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
