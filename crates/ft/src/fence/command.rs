//! The STONITH-style fence (`--ft-fence-cmd`): a command the standby runs
//! before it runs the VM, which must make sure the primary is off.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::helper_process::fork_helper;
use super::FenceError;

/// Runs the STONITH-style fence command (`sh -c`), waiting up to `patience`;
/// Ok only if it exited 0.
pub fn run_fence_command(command: &str, peer: &str, patience: Duration) -> Result<(), FenceError> {
    let fail = |outcome: String| FenceError::Command {
        command: command.to_owned(),
        outcome,
    };
    let mut child = std::process::Command::new("sh")
        .args(["-c", command])
        .env("KEMARI_FT_PEER", peer)
        .stdin(std::process::Stdio::null())
        .spawn()
        .map_err(|e| fail(e.to_string()))?;
    let deadline = Instant::now() + patience;
    loop {
        match child.try_wait() {
            Ok(Some(st)) if st.success() => return Ok(()),
            Ok(Some(st)) => return Err(fail(st.to_string())),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(fail(format!(
                    "no answer within {} ms",
                    patience.as_millis()
                )));
            }
            Err(e) => return Err(fail(e.to_string())),
        }
    }
}

/// The fence command, run by a helper process forked at start-up, before
/// the VMM confines itself: its seccomp filters let no thread execute a
/// program, and the command may need privileges the VMM drops. The helper
/// waits on a socket for each request, runs the command
/// ([`run_fence_command`]) and answers; it dies with the VMM
/// (`PR_SET_PDEATHSIG`).
#[derive(Debug, Clone)]
pub struct FenceCommand {
    command: String,
    helper: Arc<Mutex<UnixStream>>,
}

impl FenceCommand {
    /// Forks the helper for `command`. Call it while the process has one
    /// thread (the child runs Rust code after the fork).
    pub fn start(command: &str) -> std::io::Result<FenceCommand> {
        let ours = fork_helper(|theirs| serve_fence_requests(command, theirs))?;
        Ok(FenceCommand {
            command: command.to_owned(),
            helper: Arc::new(Mutex::new(ours)),
        })
    }

    /// Runs the command through the helper, with `KEMARI_FT_PEER=peer`,
    /// waiting up to `patience`; Ok only if it exited 0.
    pub fn run(&self, peer: &str, patience: Duration) -> Result<(), FenceError> {
        let fail = |outcome: String| FenceError::Command {
            command: self.command.clone(),
            outcome,
        };
        let helper = self.helper.lock().unwrap_or_else(|p| p.into_inner());
        let mut answer = String::new();
        let asked = helper
            .set_read_timeout(Some(patience + Duration::from_secs(5)))
            .and_then(|()| {
                (&*helper).write_all(format!("{} {peer}\n", patience.as_millis()).as_bytes())
            })
            .and_then(|()| BufReader::new(&*helper).read_line(&mut answer));
        match asked {
            Ok(_) if answer == "ok\n" => Ok(()),
            Ok(0) => Err(fail("the fence helper process is gone".into())),
            Ok(_) => Err(fail(
                answer.trim_end().trim_start_matches("error ").to_owned(),
            )),
            Err(e) => Err(fail(format!("the fence helper process: {e}"))),
        }
    }
}

/// The helper's loop: one request (`PATIENCE_MS PEER`) per line, one answer
/// (`ok`, or `error OUTCOME`) per request, until the VMM closes its end.
fn serve_fence_requests(command: &str, stream: UnixStream) {
    let mut writer = match stream.try_clone() {
        Ok(w) => w,
        Err(_) => return,
    };
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { return };
        let (ms, peer) = line.split_once(' ').unwrap_or(("0", ""));
        let patience = Duration::from_millis(ms.parse().unwrap_or(0));
        let answer = match run_fence_command(command, peer, patience) {
            Ok(()) => "ok\n".to_owned(),
            Err(FenceError::Command { outcome, .. }) => format!("error {outcome}\n"),
            Err(e) => format!("error {e}\n"),
        };
        if writer.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fence_command_must_succeed_in_time() {
        let t = Duration::from_secs(5);
        run_fence_command("test \"$KEMARI_FT_PEER\" = h:1", "h:1", t).unwrap();
        assert!(matches!(
            run_fence_command("exit 3", "h:1", t),
            Err(FenceError::Command { .. })
        ));
        assert!(run_fence_command("sleep 5", "h:1", Duration::from_millis(100)).is_err());
    }

    #[test]
    fn the_fence_helper_runs_the_command_for_each_request() {
        let t = Duration::from_secs(5);
        let cmd = FenceCommand::start("test \"$KEMARI_FT_PEER\" = h:1").unwrap();
        cmd.run("h:1", t).unwrap();
        match cmd.run("h:2", t) {
            Err(FenceError::Command { outcome, .. }) => {
                assert!(outcome.contains("exit status: 1"), "{outcome}")
            }
            other => panic!("{other:?}"),
        }
        cmd.run("h:1", t).unwrap();
    }
}
