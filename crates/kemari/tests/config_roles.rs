//! Every role from a config file alone (`kemari --config FILE`, no other
//! flag), with real kemari processes and the test guest, handing one VM
//! along: a machine file boots it; an `incoming_local` file takes it by
//! zero-copy migration; an `incoming` file by live migration; an
//! `ft_standby` file (key file, fence, logging) protects it; a `restore`
//! file resumes its snapshot. Each file also sets the API socket, the
//! serial console, the name and, for one, `log_level` and `on_crash`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use kemari_testkit::scenario::*;
use kemari_testkit::*;
use serde_json::Value;

const PATIENCE: Duration = Duration::from_secs(30);

/// A kemari started with `--config FILE` only; its stderr goes to `log`.
struct FromFile {
    child: KillOnDrop,
    api: PathBuf,
    console: PathBuf,
}

/// Writes `keys` (TOML lines) plus the API socket and console of `name`
/// into DIR/name.toml and starts kemari with it alone.
fn start(dir: &Path, name: &str, keys: &str) -> FromFile {
    let api = dir.join(format!("{name}.sock"));
    let console = dir.join(format!("{name}.console"));
    let file = dir.join(format!("{name}.toml"));
    std::fs::write(
        &file,
        format!(
            "{keys}\napi_socket = \"{}\"\nserial = \"file:{}\"\n",
            api.display(),
            console.display()
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    let child = kemari()
        .arg("--config")
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn kemari");
    let vmm = FromFile {
        child: KillOnDrop(child),
        api,
        console,
    };
    wait_for("the API socket", PATIENCE, || {
        vmm.api.exists() && ctl(&vmm.api, &["info"]).status.success()
    });
    vmm
}

fn info(api: &Path) -> Value {
    let out = ctl(api, &["info"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn ctl_json(api: &Path, args: &[&str]) -> Value {
    let out = ctl(api, args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn succeeded(out: std::process::Output) {
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn running(vmm: &FromFile, name: &str) {
    wait_for("the VM to run", PATIENCE, || {
        info(&vmm.api)["state"] == "running"
    });
    let v = info(&vmm.api);
    assert_eq!(v["name"], name, "{v}");
    let before = counters(&vmm.console).len();
    wait_for("the guest to count on", PATIENCE, || {
        counters(&vmm.console).len() > before
    });
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn every_role_starts_from_a_config_file_alone() {
    let _one = one_at_a_time();
    let dir = scratch("config-roles");
    let key = test_key(&dir);

    // The machine.
    let booted = start(
        &dir,
        "booted",
        &format!(
            "kernel = \"{}\"\nmemory = \"64M\"\ncmdline = \"counter=50\"\nname = \"roles\"\n\
             on_crash = \"restart\"\n",
            guest_elf().display()
        ),
    );
    running(&booted, "roles");
    // `kemarictl config`: the machine and, as `process`, the settings in
    // effect, from the file.
    let config = ctl_json(&booted.api, &["config"]);
    assert_eq!(config["memory_bytes"], 64u64 << 20, "{config}");
    assert_eq!(config["process"]["role"], "machine", "{config}");
    assert_eq!(config["process"]["on_crash"], "restart", "{config}");

    // Zero-copy migration into a VMM whose file says `incoming_local`.
    let sock = dir.join("incoming.sock");
    let local = start(
        &dir,
        "local",
        &format!("incoming_local = \"{}\"\n", sock.display()),
    );
    assert_eq!(info(&local.api)["state"], "starting");
    wait_for("the incoming socket", PATIENCE, || sock.exists());
    succeeded(ctl(&booted.api, &["migrate-local", sock.to_str().unwrap()]));
    running(&local, "roles");

    // Live migration into one whose file says `incoming`.
    let port = free_port();
    let live = start(
        &dir,
        "live",
        &format!(
            "incoming = \"127.0.0.1:{port}\"\nmigration_key_file = \"{}\"\n",
            key.display()
        ),
    );
    wait_listening(port);
    succeeded(ctl(
        &local.api,
        &[
            "migrate",
            "--to",
            &format!("127.0.0.1:{port}"),
            "--key-file",
            key.to_str().unwrap(),
        ],
    ));
    running(&live, "roles");

    // A standby from its file: key, fence, logging.
    let port = free_port();
    let standby = start(
        &dir,
        "standby",
        &format!(
            "ft_standby = \"127.0.0.1:{port}\"\nmigration_key_file = \"{}\"\n\
             ft_fence = \"{}\"\nname = \"roles\"\nlog_level = \"info\"\n",
            key.display(),
            dir.join("fence.lock").display()
        ),
    );
    let v = info(&standby.api);
    assert_eq!(
        (v["role"].as_str(), v["name"].as_str()),
        (Some("standby"), Some("roles")),
        "{v}"
    );
    let config = ctl_json(&standby.api, &["config"]);
    assert_eq!(config["process"]["role"], "ft_standby", "{config}");
    assert_eq!(config["process"]["log_level"], "info", "{config}");
    assert_eq!(
        config["process"]["migration_key_file"],
        key.display().to_string(),
        "{config}"
    );
    wait_listening(port);
    succeeded(ctl(
        &live.api,
        &[
            "ft",
            "start",
            "--peer",
            &format!("127.0.0.1:{port}"),
            "--key-file",
            key.to_str().unwrap(),
        ],
    ));
    let ft = ctl(&live.api, &["ft", "status"]);
    let ft: Value = serde_json::from_slice(&ft.stdout).unwrap();
    assert_eq!(ft["state"], "protected", "{ft}");
    succeeded(ctl(&live.api, &["ft", "stop"]));
    let mut sb = standby.child;
    let _ = wait_exit(&mut sb.0, "the standby");
    // `log_level = "info"` from the file: info lines in its log.
    let log = log_without_escapes(&dir.join("standby.log"), "INFO");
    assert!(log.contains("INFO"), "{log}");

    // A snapshot, resumed by a VMM whose file says `restore`.
    let snap = dir.join("snap");
    succeeded(ctl(
        &live.api,
        &["snapshot", snap.to_str().unwrap(), "--exit"],
    ));
    let mut l = live.child;
    assert!(wait_exit(&mut l.0, "the live destination").success());
    let restored = start(
        &dir,
        "restored",
        &format!("restore = \"{}\"\n", snap.display()),
    );
    running(&restored, "roles");
    succeeded(ctl(&restored.api, &["shutdown"]));
    let mut r = restored.child;
    assert!(wait_exit(&mut r.0, "the restored VMM").success());
    for (vmm, what) in [(booted, "the booted VMM"), (local, "the local destination")] {
        let mut c = vmm.child;
        assert!(wait_exit(&mut c.0, what).success());
    }
}

/// A primary protected from its start by its file alone (`ft_peer`,
/// `migration_key_file`, `ft_heartbeat_ms`, `ft_timeout_ms`): no
/// `kemarictl ft start`; and `ft_peer` on a standby's file is refused.
#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_primary_is_protected_from_its_start_by_its_file() {
    let _one = one_at_a_time();
    let dir = scratch("config-ft-peer");
    let key = test_key(&dir);
    let port = free_port();
    let standby = start(
        &dir,
        "standby",
        &format!(
            "ft_standby = \"127.0.0.1:{port}\"\nmigration_key_file = \"{}\"\n",
            key.display()
        ),
    );
    wait_listening(port);
    let primary = start(
        &dir,
        "primary",
        &format!(
            "kernel = \"{}\"\nmemory = \"64M\"\ncmdline = \"counter=50\"\nname = \"at-start\"\n\
             ft_peer = \"127.0.0.1:{port}\"\nmigration_key_file = \"{}\"\n\
             ft_heartbeat_ms = 50\nft_timeout_ms = 2000\n",
            guest_elf().display(),
            key.display()
        ),
    );
    wait_for("protected without `ft start`", PATIENCE, || {
        let out = ctl(&primary.api, &["ft", "status"]);
        serde_json::from_slice::<Value>(&out.stdout).is_ok_and(|v| v["state"] == "protected")
    });
    let config = ctl_json(&primary.api, &["config"]);
    assert_eq!(
        config["process"]["ft_peer"],
        format!("127.0.0.1:{port}"),
        "{config}"
    );
    assert_eq!(config["process"]["ft_timeout_ms"], 2000, "{config}");
    succeeded(ctl(&primary.api, &["shutdown"]));
    for (vmm, what) in [(primary, "the primary"), (standby, "the standby")] {
        let mut c = vmm.child;
        assert!(wait_exit(&mut c.0, what).success());
    }

    // A standby's file may not also name a peer to protect it with.
    let file = dir.join("both.toml");
    std::fs::write(
        &file,
        format!(
            "ft_standby = \"127.0.0.1:{}\"\nft_peer = \"127.0.0.1:{port}\"\nmigration_key_file = \"{}\"\n",
            free_port(),
            key.display()
        ),
    )
    .unwrap();
    let out = run_with_timeout(kemari().arg("--config").arg(&file), PATIENCE);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--ft-peer"), "{err}");
}
