//! Which free host should protect a VM next. Every agent computes the same
//! order from the same registry, so the choice is deterministic; the
//! claim (a create-if-absent in etcd, [`crate::store`]) makes it unique.
//!
//! Rules, in order:
//! 1. never the VM's primary host, and only hosts holding the primary's
//!    migration key (same key id) with a free standby slot and at least
//!    the guest's memory free;
//! 2. the host that just lost the VM (its last failover's `from`) comes
//!    last: whatever killed the VM there may strike again;
//! 3. more free slots first, then the name (free memory is shown, not
//!    ranked on: it moves all the time, and agents would disagree).

use crate::record::{HostRecord, VmRecord};

/// The hosts that may protect `vm`, best first.
pub fn candidates<'h>(hosts: &'h [HostRecord], vm: &VmRecord) -> Vec<&'h HostRecord> {
    let Some(primary) = hosts.iter().find(|h| h.name == vm.primary) else {
        // A primary whose agent is not registered: no key id to match.
        return Vec::new();
    };
    let lost_on = vm.last_failover.as_ref().map(|f| f.from.as_str());
    let mut eligible: Vec<&HostRecord> = hosts
        .iter()
        .filter(|h| {
            h.name != vm.primary
                && h.key_id == primary.key_id
                && h.free_slots() > 0
                && vm.memory_bytes.is_none_or(|m| h.free_memory_bytes >= m)
        })
        .collect();
    eligible.sort_by(|a, b| {
        (Some(a.name.as_str()) == lost_on)
            .cmp(&(Some(b.name.as_str()) == lost_on))
            .then(b.free_slots().cmp(&a.free_slots()))
            .then(a.name.cmp(&b.name))
    });
    eligible
}

/// Where `host` stands in [`candidates`] for `vm` (0: it should claim
/// first), if it may protect it at all.
pub fn position(hosts: &[HostRecord], vm: &VmRecord, host: &str) -> Option<usize> {
    candidates(hosts, vm).iter().position(|h| h.name == host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Failover;

    fn host(name: &str, slots: u32, used: u32, key: &str) -> HostRecord {
        HostRecord {
            name: name.into(),
            address: "127.0.0.1".into(),
            http: None,
            slots,
            standbys: used,
            free_memory_bytes: 1 << 30,
            key_id: key.into(),
            since_unix: 0,
        }
    }

    fn vm(primary: &str, lost_on: Option<&str>) -> VmRecord {
        VmRecord {
            id: "a".into(),
            primary: primary.into(),
            standby: None,
            state: "failed_over".into(),
            epoch: 0,
            syncs_per_s: 0.0,
            memory_bytes: None,
            since_unix: 0,
            failovers: 0,
            last_failover: lost_on.map(|f| Failover {
                at_unix: 0,
                from: f.into(),
                to: primary.into(),
                failover_ms: None,
            }),
            updated_unix: 0,
        }
    }

    fn names(hosts: &[HostRecord], vm: &VmRecord) -> Vec<String> {
        candidates(hosts, vm)
            .iter()
            .map(|h| h.name.clone())
            .collect()
    }

    #[test]
    fn never_the_primary_nor_a_full_host_nor_another_key() {
        let hosts = [
            host("h0", 2, 0, "k"),
            host("h1", 2, 2, "k"),
            host("h2", 2, 0, "other"),
            host("h3", 2, 1, "k"),
        ];
        assert_eq!(names(&hosts, &vm("h0", None)), ["h3"]);
        assert_eq!(position(&hosts, &vm("h0", None), "h3"), Some(0));
        assert_eq!(position(&hosts, &vm("h0", None), "h0"), None);
        // An unregistered primary: nobody (its key is unknown).
        assert!(names(&hosts, &vm("gone", None)).is_empty());
        // A guest larger than a host's free memory does not go there.
        let mut big = vm("h0", None);
        big.memory_bytes = Some(2 << 30);
        assert!(names(&hosts, &big).is_empty());
        big.memory_bytes = Some(1 << 30);
        assert_eq!(names(&hosts, &big), ["h3"]);
    }

    #[test]
    fn the_host_that_lost_the_vm_comes_last_then_free_slots_then_name() {
        let hosts = [
            host("h0", 4, 0, "k"),
            host("h1", 4, 0, "k"),
            host("h2", 4, 0, "k"),
        ];
        assert_eq!(names(&hosts, &vm("h1", None)), ["h0", "h2"]);
        assert_eq!(names(&hosts, &vm("h1", Some("h0"))), ["h2", "h0"]);
        assert_eq!(names(&hosts, &vm("h2", Some("h1"))), ["h0", "h1"]);
        let hosts = [
            host("h0", 4, 3, "k"),
            host("h1", 4, 0, "k"),
            host("h2", 4, 1, "k"),
        ];
        assert_eq!(names(&hosts, &vm("h1", None)), ["h2", "h0"]);
    }
}
