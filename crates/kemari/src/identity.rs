//! A VM's id and name (`--id`, `--name`): labels a supervisor knows the VM
//! by, in `GET /vm` and in every event. The id is given once, at first
//! boot (16 random hex digits unless `--id` says), and kept in the
//! machine's configuration wherever the VM goes (snapshot, warm restart,
//! migrations, failover).

use std::hash::{BuildHasher, Hasher};

/// Longest id or name.
pub const MAX_LEN: usize = 64;

/// Checks an id or a name: 1–64 characters of `A-Z a-z 0-9 . _ -`.
pub fn check(value: &str) -> Result<String, String> {
    if value.is_empty() || value.len() > MAX_LEN {
        return Err(format!("must be 1 to {MAX_LEN} characters long"));
    }
    if let Some(c) = value
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "{c:?} is not allowed (use letters, digits, '.', '_' and '-')"
        ));
    }
    Ok(value.to_owned())
}

/// A new id: 16 random hex digits (std's hasher keys come from the
/// kernel's random source).
pub fn random_id() -> String {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names() {
        assert!(check("web-1.prod_eu").is_ok());
        assert!(check(&"a".repeat(64)).is_ok());
        assert!(check("").is_err());
        assert!(check(&"a".repeat(65)).is_err());
        assert!(check("a b").unwrap_err().contains("' '"));
        assert!(check("é").is_err());
        let (a, b) = (random_id(), random_id());
        assert_ne!(a, b);
        assert_eq!(a.len(), 16);
        assert!(check(&a).is_ok() && a.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
