//! The config file's role and process keys: a VMM's role (`restore`,
//! `incoming`, `incoming_local`, `ft_standby` with `migration_key_file`,
//! `ft_fence`, `ft_fence_cmd`, `plaintext_link`), `start_paused`,
//! `on_reboot`, `on_crash`, `seccomp` and logging (`log_level`,
//! `log_json`) — named as the flags, a flag given wins. They are merged
//! into [`Args`] once, before anything starts, so the rest of the VMM sees
//! one set of settings whichever way they came.
//!
//! A file for a role defines no machine (the VM comes from the snapshot,
//! the source or the primary), and names one role at most; its `serial`
//! applies as `--serial` does.

use clap::parser::ValueSource;
use clap::{ArgMatches, ValueEnum};

use super::{read_config_file, Args, CliError, FileConfig, Given};

/// The machine keys a role's file must not hold.
const MACHINE_KEYS: [&str; 7] = [
    "kernel",
    "initramfs",
    "cmdline",
    "memory",
    "vcpus",
    "disks",
    "pmem",
];

impl Args {
    /// Fills what the flags left unset from `--config`'s role and process
    /// keys (`matches` says which flags were given), and checks that the
    /// result names one role and, for a role, no machine.
    pub fn merge_config_roles(mut self, matches: &ArgMatches) -> Result<Self, CliError> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let file = read_config_file(&path)?;
        let given = |key: &'static str| Given::File { key, path: &path };
        let unset = |id: &str| {
            !matches!(
                matches.value_source(id),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            )
        };
        fill(&mut self.restore, &file.restore);
        fill(&mut self.incoming, &file.incoming);
        fill(&mut self.incoming_local, &file.incoming_local);
        fill(&mut self.ft_standby, &file.ft_standby);
        fill(&mut self.ft_fence_cmd, &file.ft_fence_cmd);
        fill(&mut self.ft_peer, &file.ft_peer);
        fill(&mut self.ft_periodic_ms, &file.ft_periodic_ms);
        fill(&mut self.ft_heartbeat_ms, &file.ft_heartbeat_ms);
        fill(&mut self.ft_timeout_ms, &file.ft_timeout_ms);
        fill(&mut self.migration_key_file, &file.migration_key_file);
        if let (None, Some(text)) = (&self.ft_fence, &file.ft_fence) {
            self.ft_fence = Some(
                ft::fence::FenceSpec::parse(text)
                    .map_err(|e| given("ft_fence").error(&format!("{text:?}"), e))?,
            );
        }
        self.await_state |= file.await_state == Some(true);
        self.plaintext_link |= file.plaintext_link == Some(true);
        self.start_paused |= file.start_paused == Some(true);
        self.log_json |= file.log_json == Some(true);
        if let (true, Some(text)) = (unset("on_reboot"), &file.on_reboot) {
            self.on_reboot = choice(text, given("on_reboot"))?;
        }
        if let (true, Some(text)) = (unset("on_crash"), &file.on_crash) {
            self.on_crash = choice(text, given("on_crash"))?;
        }
        if let (true, Some(text)) = (unset("seccomp"), &file.seccomp) {
            self.seccomp = choice(text, given("seccomp"))?;
        }
        if let (true, Some(text)) = (unset("log_level"), &file.log_level) {
            self.log_level = kemari_logging::check_filter(text)
                .map_err(|e| given("log_level").error(&format!("{text:?}"), e))?;
        }
        self.check_one_role(&file)?;
        self.check_ft_at_start()?;
        // A role's VM keeps its console setting from the file, as from
        // `--serial` (a boot reads it with the machine's keys).
        if self.restore.is_some()
            || self.incoming.is_some()
            || self.incoming_local.is_some()
            || self.ft_standby.is_some()
        {
            fill(&mut self.serial, &file.serial);
        }
        Ok(self)
    }

    /// The role and process settings in effect (flags and file merged),
    /// under the config file's keys: what `GET /vm/config` shows as
    /// `process`, and what a role's file would hold.
    pub fn process_settings(&self) -> serde_json::Value {
        let name = |v: Option<clap::builder::PossibleValue>| v.map(|p| p.get_name().to_owned());
        let role = if self.restore.is_some() {
            "restore"
        } else if self.incoming.is_some() {
            "incoming"
        } else if self.incoming_local.is_some() {
            "incoming_local"
        } else if self.ft_standby.is_some() {
            "ft_standby"
        } else {
            "machine"
        };
        serde_json::json!({
            "role": role,
            "config": self.config,
            "restore": self.restore,
            "await_state": self.await_state,
            "incoming": self.incoming,
            "incoming_local": self.incoming_local,
            "ft_standby": self.ft_standby,
            "ft_fence": self.ft_fence.as_ref().map(|f| format!("{f:?}")),
            "ft_fence_cmd": self.ft_fence_cmd,
            "ft_peer": self.ft_peer,
            "ft_periodic_ms": self.ft_periodic_ms,
            "ft_heartbeat_ms": self.ft_heartbeat_ms,
            "ft_timeout_ms": self.ft_timeout_ms,
            "migration_key_file": self.migration_key_file,
            "plaintext_link": self.plaintext_link,
            "start_paused": self.start_paused,
            "on_reboot": name(self.on_reboot.to_possible_value()),
            "on_crash": name(self.on_crash.to_possible_value()),
            "seccomp": name(self.seccomp.to_possible_value()),
            "log_level": self.log_level,
            "log_json": self.log_json,
        })
    }

    /// `ft_peer` for a VM that runs here from its start, with a key; the
    /// other `ft_*_ms` keys only with it.
    fn check_ft_at_start(&self) -> Result<(), CliError> {
        let setting = |input: &str, reason: &str| CliError::Setting {
            input: input.into(),
            reason: reason.into(),
        };
        match &self.ft_peer {
            None if self.ft_periodic_ms.is_some()
                || self.ft_heartbeat_ms.is_some()
                || self.ft_timeout_ms.is_some() =>
            {
                Err(setting(
                    "--ft-periodic-ms/--ft-heartbeat-ms/--ft-timeout-ms",
                    "only with --ft-peer (protection from the start); for `kemarictl ft start` give them there",
                ))
            }
            Some(peer) if self.ft_standby.is_some() || self.restore.is_some() || self.incoming.is_some() || self.incoming_local.is_some() => {
                Err(setting(
                    &format!("--ft-peer {peer}"),
                    "only for a VM that boots here (a standby, a restore or a migration's destination is protected with `kemarictl ft start`)",
                ))
            }
            Some(peer) if self.migration_key_file.is_none() => Err(setting(
                &format!("--ft-peer {peer}"),
                "needs --migration-key-file (the standby's key)",
            )),
            _ => Ok(()),
        }
    }

    /// The fault-tolerance start `--ft-peer` asks for, if any.
    pub fn ft_at_start(&self) -> Option<kemari_api::FtStartRequest> {
        let peer = self.ft_peer.clone()?;
        let key_file = self.migration_key_file.clone()?;
        Some(kemari_api::FtStartRequest {
            peer,
            key_file: std::path::absolute(&key_file).unwrap_or(key_file),
            periodic_ms: self.ft_periodic_ms,
            heartbeat_ms: self.ft_heartbeat_ms,
            timeout_ms: self.ft_timeout_ms,
            keep_writable_pages: None,
            epochs_in_flight: None,
            plaintext: self.plaintext_link,
        })
    }

    /// One role at most; a role's file defines no machine.
    fn check_one_role(&self, file: &FileConfig) -> Result<(), CliError> {
        let roles: Vec<&str> = [
            ("restore", self.restore.is_some()),
            ("incoming", self.incoming.is_some()),
            ("incoming_local", self.incoming_local.is_some()),
            ("ft_standby", self.ft_standby.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect();
        if roles.len() > 1 {
            return Err(CliError::Roles(roles.join(", ")));
        }
        let Some(role) = roles.first() else {
            return Ok(());
        };
        let machine = [
            file.kernel.is_some(),
            file.initramfs.is_some(),
            file.cmdline.is_some(),
            file.memory.is_some(),
            file.vcpus.is_some(),
            !file.disks.is_empty(),
            !file.pmem.is_empty(),
        ];
        let keys: Vec<&str> = MACHINE_KEYS
            .iter()
            .zip(machine)
            .filter_map(|(k, set)| set.then_some(*k))
            .collect();
        if !keys.is_empty() {
            return Err(CliError::MachineInRoleFile {
                role: (*role).to_owned(),
                keys: keys.join(", "),
            });
        }
        Ok(())
    }
}

/// `slot` from the file if no flag set it.
fn fill<T: Clone>(slot: &mut Option<T>, file: &Option<T>) {
    if slot.is_none() {
        slot.clone_from(file);
    }
}

/// One of a flag's values, as the file wrote it.
fn choice<T: ValueEnum>(text: &str, given: Given<'_>) -> Result<T, CliError> {
    T::from_str(text, false).map_err(|_| {
        let allowed: Vec<String> = T::value_variants()
            .iter()
            .filter_map(|v| v.to_possible_value().map(|p| p.get_name().to_owned()))
            .collect();
        given.error(
            &format!("{text:?}"),
            format!("use one of {}", allowed.join(", ")),
        )
    })
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches};

    use super::*;
    use crate::cli::{OnCrash, OnReboot};

    fn args(file: &str, flags: &[&str]) -> Result<Args, CliError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vm.toml");
        std::fs::write(&path, file).unwrap();
        let mut argv = vec![
            "kemari".to_owned(),
            "--config".into(),
            path.display().to_string(),
        ];
        argv.extend(flags.iter().map(|s| s.to_string()));
        let matches = Args::command().try_get_matches_from(argv).unwrap();
        Args::from_arg_matches(&matches)
            .unwrap()
            .merge_config_roles(&matches)
    }

    #[test]
    fn a_standby_file_sets_the_role_its_keys_and_the_process() {
        let a = args(
            "ft_standby = \"0.0.0.0:7000\"\nmigration_key_file = \"/etc/kemari/key\"\n\
             ft_fence = \"/run/kemari/db.lock\"\nplaintext_link = true\n\
             log_level = \"info\"\nlog_json = true\non_crash = \"restart\"\non_reboot = \"exit\"\n",
            &[],
        )
        .unwrap();
        assert_eq!(a.ft_standby.as_deref(), Some("0.0.0.0:7000"));
        assert_eq!(
            a.migration_key_file.unwrap().to_str(),
            Some("/etc/kemari/key")
        );
        assert!(a.ft_fence.is_some() && a.plaintext_link && a.log_json);
        assert_eq!(a.log_level, "info");
        assert_eq!(
            (a.on_crash, a.on_reboot),
            (OnCrash::Restart, OnReboot::Exit)
        );
    }

    #[test]
    fn the_settings_in_effect_name_the_role() {
        let a = args(
            "incoming_local = \"/run/in.sock\"\non_crash = \"restart\"\n",
            &[],
        )
        .unwrap();
        let v = a.process_settings();
        assert_eq!(v["role"], "incoming_local");
        assert_eq!(v["incoming_local"], "/run/in.sock");
        assert_eq!(v["on_crash"], "restart");
        assert_eq!(v["on_reboot"], "restart");
    }

    #[test]
    fn flags_win_over_the_file() {
        let a = args(
            "incoming = \"0.0.0.0:7000\"\nlog_level = \"info\"\non_crash = \"restart\"\n",
            &[
                "--incoming",
                "127.0.0.1:7001",
                "--log-level",
                "debug",
                "--on-crash",
                "stop",
            ],
        )
        .unwrap();
        assert_eq!(a.incoming.as_deref(), Some("127.0.0.1:7001"));
        assert_eq!(a.log_level, "debug");
        assert_eq!(a.on_crash, OnCrash::Stop);
    }

    #[test]
    fn two_roles_or_a_machine_in_a_role_file_are_refused() {
        let e = args("incoming = \"h:1\"\nft_standby = \"h:2\"\n", &[]).unwrap_err();
        assert!(e.to_string().contains("incoming, ft_standby"), "{e}");
        let e = args(
            "incoming_local = \"/run/in.sock\"\nkernel = \"/k\"\nmemory = \"1G\"\n",
            &[],
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("incoming_local") && text.contains("kernel, memory"),
            "{text}"
        );
    }

    #[test]
    fn a_bad_value_names_the_key_and_the_choices() {
        let e = args("on_crash = \"reboot\"\n", &["--kernel", "/k"]).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("on_crash = \"reboot\" in"), "{text}");
        assert!(text.contains("stop, restart"), "{text}");
    }
}
