//! `--ft-fence etcd://…`: where the etcd cluster is, under which prefix the
//! VMs' keys live, and how long a lease lasts.
//!
//! ```text
//! etcd://HOST:PORT[,HOST:PORT…][/PREFIX][?ttl=SECONDS]
//! etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379/kemari/vms?ttl=5
//! ```
//!
//! The key a VM's copies compete for is `PREFIX/ID` (the VM's `--id`).

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
        for pair in query.into_iter().flat_map(|q| q.split('&')) {
            match pair.split_once('=') {
                Some(("ttl", v)) => {
                    ttl = v
                        .parse()
                        .ok()
                        .filter(|t| (MIN_TTL_S..=MAX_TTL_S).contains(t))
                        .ok_or_else(|| {
                            format!("ttl={v} in {text:?}: the lease TTL must be {MIN_TTL_S}..={MAX_TTL_S} seconds")
                        })?
                }
                _ => return Err(format!("unknown parameter {pair:?} in {text:?} (known: ttl)")),
            }
        }
        Ok(EtcdSpec {
            endpoints,
            prefix,
            ttl: Duration::from_secs(ttl),
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
        ] {
            let e = EtcdSpec::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
