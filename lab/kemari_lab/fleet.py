"""A fleet of three virtual hosts under etcd (issue #27, docs/fleet.md).

    with fleet_lab(lab) as fl:          # etcd (3 members), agents, the guest on vh0
        s = fl.wait_protected(fl.lab.hosts[0], timeout=600)   # no ft start by hand
        ...
        fl.lab.hosts[0].power_fail()

What it sets up, on top of :func:`kemari_lab.roaming.roaming_guest` (the
shared NBD disk, the same migration key everywhere, the client's
byte-checked echo connection):

- :class:`kemari_lab.etcd.LabEtcd`: three etcd members in the lab
  namespace (10.77.0.3–5), reached by the virtual hosts over the lab bridge;
- the guest under kemari on vh0 with ``--ft-fence etcd://… --id roam``
  and its API socket ``/tmp/roam.sock``;
- on every virtual host the guest's TAP ``g0`` in ``br0`` and a
  ``kemari-agent`` (``--vm-dir /tmp``: the agent finds the VM by its socket,
  and starts standbys with ``--net tap=g0``, their console in
  ``/tmp/roam.console`` and their log in ``/tmp/roam.log``), log in
  ``/tmp/kemari-agent.log``, fleet page on port 7180;
- the guest's disk writer (``GET /cgi-bin/writer``: numbered records, each
  followed by ``sync``), checked with ``GET /cgi-bin/records``: every
  record the guest synced is on the disk, none is malformed.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kemari_lab import images, paths
from kemari_lab.errors import LabError, step
from kemari_lab.etcd import PREFIX, LabEtcd
from kemari_lab.fault_tolerance import ft_status, log_status, wait_ft_state
from kemari_lab.guests import vmm_log
from kemari_lab.lab import Lab
from kemari_lab.migration import KEY_PATH
from kemari_lab.roaming import TOKEN_FILE, RoamingGuest, roaming_guest
from kemari_lab.vhost import VirtualHost

VM = "roam"
VM_DIR = "/tmp"
AGENT_LOG = "/tmp/kemari-agent.log"
HTTP_PORT = 7180
# As the fault-tolerance scenarios: TCG virtual hosts need a patient sync link.
FT_TIMEOUT_MS = 3000
# A protected guest's disk request waits for a sync; on three loaded TCG
# virtual hosts a sync took 1.7 s (median, 0.5 syncs/s): a CGI that writes,
# syncs and reads back needs minutes, not the 30 s of an unprotected one.
PROTECTED_IO_S = 240
RECORDS_RE = re.compile(r"KLAB-RECORDS-NOW lines=(\d+) synced=(\d+) bad=(\d+)")


@dataclass
class FleetLab:
    lab: Lab
    etcd: LabEtcd
    rg: RoamingGuest

    def host_of(self, ip: str) -> VirtualHost:
        for h in self.lab.hosts:
            if h.ip == ip:
                return h
        raise LabError(f"no virtual host has the address {ip}")

    def start_agent(self, host: VirtualHost) -> None:
        """kemari-agent on `host`, in the background."""
        standby = f"--net tap={self.rg.guest.spec.tap} --log-level info --log-json"
        cmd = (
            f"kemari-agent --etcd '{self.etcd.fence}' --host-name {host.name} --address {host.ip}"
            f" --vm-dir {VM_DIR} --key-file {KEY_PATH} --standby-args '{standby}'"
            f" --ft-timeout-ms {FT_TIMEOUT_MS} --http {host.ip}:{HTTP_PORT} --log-level info,fleet=debug"
        )
        host.run(f"( {cmd} >> {AGENT_LOG} 2>&1; echo KLAB-AGENT-EXIT=$? >> {AGENT_LOG} ) >/dev/null 2>&1 &")

    def wait_registered(self, host: VirtualHost, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.etcd.get(f"{PREFIX}/_fleet/hosts/{host.name}") is None:
            if time.monotonic() > deadline:
                log = host.run(f"tail -20 {AGENT_LOG}", check=False).output
                raise LabError(f"{host.name}: its agent did not register in etcd after {timeout:.0f}s:\n{log}")
            time.sleep(0.5)

    def wait_protected(self, host: VirtualHost, timeout: float) -> tuple[dict[str, Any], VirtualHost]:
        """Waits until the guest's kemari on `host` is protected (by the agents:
        nobody runs ft start here); returns its status and the standby's host."""
        st = wait_ft_state(self.rg.guest, host, {"protected"}, timeout=timeout, poll=0.5)
        peer = str(st.get("peer", ""))
        return st, self.host_of(peer.rsplit(":", 1)[0])

    def wait_failed_over(self, host: VirtualHost, timeout: float = 120) -> dict[str, Any]:
        """Waits until the standby on `host` runs the VM (its state moves on
        at once to syncing and protected as the agents re-protect it)."""
        self.rg.guest.host = host
        st = wait_ft_state(self.rg.guest, host, {"failed_over", "syncing", "protected"}, timeout=timeout)
        # failed_over: role none until the agents' ft start makes it a primary.
        if st.get("failovers") != 1 or st.get("role") not in ("none", "primary"):
            raise LabError(f"{host.name}: expected the VM running after its failover: {st}")
        return st

    def start_writer(self) -> None:
        if "writer" not in self.lab.client_http_get(self.rg.guest.spec.ip, "/cgi-bin/writer"):
            raise LabError(f"{self.rg.host.name}: the guest's disk writer did not start")

    def check_records(self, label: str) -> int:
        """Stops the writer, checks that every synced record is on the disk
        (and none malformed), starts it again; returns the records."""
        body = self.lab.client_http_get(self.rg.guest.spec.ip, "/cgi-bin/records", timeout=PROTECTED_IO_S)
        m = RECORDS_RE.search(body)
        if m is None:
            raise LabError(f"{label}: no records report from the guest: {body!r}")
        lines, synced, bad = (int(g) for g in m.groups())
        images.log(f"records {label}: {m.group(0)}")
        if lines < synced or bad != 0 or synced == 0:
            raise LabError(f"{label}: the disk holds {lines} records ({bad} malformed); the guest had synced {synced}")
        self.start_writer()
        return lines

    def fence_holder(self) -> dict[str, Any] | None:
        """The fence key's value: which copy may run the VM."""
        return self.etcd.get(f"{PREFIX}/{VM}")

    def fleet_table(self, json_out: bool = False) -> str:
        """`kemarictl fleet [--json]` from the lab namespace (this machine's build)."""
        ctl = paths.RELEASE_DIR / "kemarictl"
        extra = ["--json"] if json_out else []
        proc = subprocess.run(
            self.lab.network.in_lab([str(ctl), "fleet", "--etcd", self.etcd.fence, *extra]),
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
        out = proc.stdout.strip() or proc.stderr.strip()
        images.log("kemarictl fleet:\n" + out)
        return out

    def vm_row(self) -> dict[str, Any]:
        """The VM's row of `kemarictl fleet --json`."""
        rows = json.loads(self.fleet_table(json_out=True)).get("vms", [])
        return next((r for r in rows if r.get("vm") == VM), {})

    def check_record(self, primary: VirtualHost, failovers: int, last_from: VirtualHost) -> None:
        """The registry's record: where the VM runs, its failovers, the last one."""
        row = self.vm_row()
        last = row.get("last_failover") or {}
        if (row.get("primary"), row.get("failovers"), last.get("from"), last.get("to")) != (
            primary.name,
            failovers,
            last_from.name,
            primary.name,
        ):
            raise LabError(
                f"the fleet record should say {primary.name}, {failovers} failover(s), last from {last_from.name}: {row}"
            )

    def vmm_running(self, host: VirtualHost) -> list[str]:
        """Pids of kemari VMMs on `host`: not those that ended and wait for
        their agent to reap them, nor a VMM's own helper (the etcd fence's
        client runs in a kemari forked at start-up, same name)."""
        cmd = (
            "all=\" $(pidof kemari) \"; for p in $all; do"
            " grep -qs '^State:.*Z' /proc/$p/status && continue;"
            " pp=$(awk '/^PPid:/{print $2}' /proc/$p/status 2>/dev/null);"
            ' case "$all" in *" $pp "*) continue;; esac; echo $p; done'
        )
        return host.run(cmd, check=False).output.split()

    def finish(self) -> dict[str, float]:
        """Closes the connection (raises on any failed echo), powers the guest
        off, waits for its kemari to end (exit 0, as the agent saw it) and
        checks the last token the guest wrote is in the shared image."""
        rg = self.rg
        host = rg.host
        final = rg.conn.close()
        measures = {
            "client_echoes": float(final["exchanges"]),
            "client_mb_each_way": final["bytes"] / 1e6,
            "client_max_gap_s": float(final["max_gap_s"]),
        }
        t0 = time.monotonic()
        self.lab.client_http_get(rg.guest.spec.ip, "/cgi-bin/poweroff")
        deadline = time.monotonic() + 120
        while self.vmm_running(host):
            if time.monotonic() > deadline:
                raise LabError(f"{host.name}: kemari still runs 120 s after the guest's poweroff")
            time.sleep(0.5)
        measures["poweroff_s"] = time.monotonic() - t0
        time.sleep(1.5)  # the agent's next round reaps it
        ended = host.run(f"grep 'started here as a standby ended' {AGENT_LOG}", check=False).output
        if "exit status: 0" not in ended:
            raise LabError(f"{host.name}: the agent did not see kemari end with status 0: {ended!r}")
        rg.disk.check_serving()
        rg.disk.stop()
        if rg.last_token is not None:
            on_disk = rg.disk.read_file(TOKEN_FILE).strip()
            if on_disk != rg.last_token:
                raise LabError(f"shared disk: {TOKEN_FILE} holds {on_disk!r}, the guest last wrote {rg.last_token!r}")
        return measures

    def save_logs(self) -> None:
        """Each live host's agent log and the VM's kemari log into the run directory."""
        for h in self.lab.hosts:
            if not h.alive():
                continue
            for f in (AGENT_LOG, f"{VM_DIR}/{VM}.log", f"{VM_DIR}/{VM}.console"):
                res = h.run(f"cat {f}", check=False, timeout=60)
                if res.ok:
                    (self.lab.run_dir / f"{h.name}-{f.rsplit('/', 1)[1]}").write_text(res.output)


def log_time(host: VirtualHost, path: str, message_prefix: str) -> str | None:
    """The timestamp of the first kemari JSON log line in `path` on `host`
    whose message starts with `message_prefix` (the host's wall clock)."""
    text = host.run(f"cat {path}", check=False).output
    for e in vmm_log(text):
        if str(e.get("fields", {}).get("message", "")).startswith(message_prefix):
            return str(e.get("timestamp"))
    return None


@contextmanager
def fleet_lab(lab: Lab, memory_mb: int = 256) -> Iterator[FleetLab]:
    """etcd, the guest on vh0 under the etcd fence, an agent on every host."""
    if len(lab.hosts) < 3:
        raise LabError("the fleet scenarios need three virtual hosts")
    with step("starting a three-member etcd in the lab namespace"):
        etcd = LabEtcd(lab).start()
    try:
        vmm_args = f"--ft-fence '{etcd.fence}' --id {VM}"
        with roaming_guest(lab, home=0, name=VM, memory_mb=memory_mb, vmm_args=vmm_args) as rg:
            fl = FleetLab(lab, etcd, rg)
            try:
                with step("starting the agents"):
                    holder = fl.fence_holder()
                    if holder is None or holder.get("how") != "start":
                        raise LabError(f"the VM runs but etcd's fence key says {holder}")
                    for i, h in enumerate(lab.hosts):
                        if i != 0:
                            rg.prepare(i)
                        fl.start_agent(h)
                    for h in lab.hosts:
                        fl.wait_registered(h)
                yield fl
            finally:
                try:
                    fl.save_logs()
                except Exception as e:  # noqa: BLE001 - best effort, the first error matters
                    images.log(f"could not save the fleet logs: {e}")
    finally:
        etcd.stop()


def status_line(label: str, st: dict[str, Any]) -> None:
    log_status(label, {k: v for k, v in st.items() if k != "seen_at"})


def _power_failure(fl: FleetLab, dead: VirtualHost, new: VirtualHost, label: str, times: dict[str, float]) -> float:
    """`dead` (the primary's host) loses power; waits for `new` to run the
    VM; checks the client stream, the records, the fence key and the record.
    Returns the time.monotonic() of the power failure."""
    rg = fl.rg
    before = rg.conn.check()
    failovers = int(fl.vm_row().get("failovers") or 0)
    killed = dead.power_fail()
    images.log(f"{dead.name} powered off (SIGKILL to its QEMU)")
    over = fl.wait_failed_over(new)
    times[f"{label}_failover_seen_s"] = over["seen_at"] - killed
    times[f"{label}_kemari_failover_ms"] = float(over.get("failover_ms") or -1)
    status_line(f"{new.name} after the failover ({label})", over)
    holder = fl.fence_holder()
    if holder is None or holder.get("how") != "failover" or holder.get("host") != new.name:
        raise LabError(f"the fence key after the failover to {new.name}: {holder}")
    after = rg.conn.expect_progress(20, timeout=120)
    times[f"{label}_client_gap_s"] = float(rg.conn.max_gap_in(after, before["elapsed_s"], after["elapsed_s"]))
    times[f"{label}_records"] = float(fl.check_records(f"after {label}"))
    rg.check_disk(label, timeout=PROTECTED_IO_S)
    fl.check_record(new, failovers + 1, dead)
    return killed


def _partition(fl: FleetLab, p: VirtualHost, s: VirtualHost, times: dict[str, float]) -> float:
    """Cuts `p` (the primary's host) off the lab bridge: its copy must lose
    its etcd key, stop and exit 1 before `s`'s standby takes the key and
    runs the VM. Returns the time.monotonic() of the cut."""
    rg = fl.rg
    ns = fl.lab.network.ns
    before = rg.conn.check()
    failovers = int(fl.vm_row().get("failovers") or 0)
    cut_wall = time.time()
    cut = time.monotonic()
    subprocess.run(["ip", "-n", ns, "link", "set", p.tap, "down"], check=True, capture_output=True)
    images.log(f"{p.name}: its TAP {p.tap} is down (no standby, no etcd, no client)")
    lost_seen = exit_seen = over_seen = None
    over: dict[str, Any] = {}
    deadline = cut + 180
    # The old copy must end during the cut: a disk request in flight to the
    # NBD server it can no longer reach blocks its device loop, and once its
    # key is lost it ends without waiting for it (kemari's
    # FENCE_LOST_STOP_BOUND; its status, 1, is read by its agent after the heal).
    while lost_seen is None or over_seen is None or exit_seen is None:
        if time.monotonic() > deadline:
            raise LabError(
                f"after the cut: old primary lost its key {lost_seen}, exited {exit_seen}; "
                f"standby took over {over_seen} ({over})"
            )
        con = p.run(f"cat {VM_DIR}/{VM}.console {VM_DIR}/{VM}.log 2>/dev/null; true").output
        now = time.monotonic()
        if lost_seen is None and "lost the etcd key" in con:
            lost_seen = now
        if exit_seen is None and not fl.vmm_running(p):
            exit_seen = time.monotonic()
        if over_seen is None:
            try:
                over = ft_status(rg.guest, s)
            except LabError as e:
                over = {"error": str(e)}
            # failed_over (role none), then syncing/protected (primary).
            if over.get("failovers") == 1 and over.get("state") in ("failed_over", "syncing", "protected"):
                over_seen = time.monotonic()
        time.sleep(0.2)
    rg.guest.host = s
    status_line(f"{s.name} after the failover (partition)", over)
    times.update(
        partition_old_lost_key_seen_s=lost_seen - cut,
        partition_old_exit_seen_s=exit_seen - cut,
        partition_new_primary_seen_s=over_seen - cut,
        partition_kemari_failover_ms=float(over.get("failover_ms") or -1),
    )
    old_log = f"{VM_DIR}/{VM}.log" if p.run(f"test -s {VM_DIR}/{VM}.log", check=False).ok else rg.guest.console
    lost_at = log_time(p, old_log, "etcd fence: lost the etcd key")
    taken_at = log_time(s, f"{VM_DIR}/{VM}.log", "etcd fence: key taken")
    images.log(
        f"cut at {time.strftime('%H:%M:%S', time.gmtime(cut_wall))}.{int(cut_wall % 1 * 1000):03d}Z;"
        f" {p.name} logged 'lost the etcd key' at {lost_at}; {s.name} took the key at {taken_at}"
    )
    if lost_at is None or taken_at is None or not lost_at < taken_at:
        raise LabError(f"the old primary lost its key at {lost_at}, the new one took it at {taken_at}")
    holder = fl.fence_holder()
    if holder is None or holder.get("host") != s.name or holder.get("how") != "failover":
        raise LabError(f"the fence key after the partition: {holder}")
    after = rg.conn.expect_progress(20, timeout=120)
    times["partition_client_gap_s"] = float(rg.conn.max_gap_in(after, before["elapsed_s"], after["elapsed_s"]))
    times["partition_records"] = float(fl.check_records("after the partition"))
    fl.check_record(s, failovers + 1, p)
    return cut


def fleet(lab: Lab, vmm: str) -> dict[str, float]:
    """Three virtual hosts, a three-member etcd, an agent on each: the guest
    on vh0 is protected with no command; (a) its host loses power: the
    standby takes over and the agents re-protect it on the third host;
    (c) that new primary's host is cut off the lab bridge: its copy stops
    once its lease is gone, the third host's standby takes over only then;
    healed, the cut host holds no copy and protects the VM; (d)+(b) one
    etcd member is killed and the primary's host loses power: the VM runs
    on, on the re-protected standby. The client's echo stream stays
    byte-exact and every synced record is on the disk throughout."""
    if vmm != "kemari":
        raise LabError(f"fleet is a kemari scenario (--vmm kemari), not {vmm}")
    times: dict[str, float] = {}
    ns = lab.network.ns
    with fleet_lab(lab) as fl:
        rg = fl.rg
        h0 = lab.hosts[0]
        with step("automatic protection"):
            t = time.monotonic()
            st, h1 = fl.wait_protected(h0, timeout=600)
            times["protected_after_agents_s"] = time.monotonic() - t
            times["initial_sync_ms"] = float(st.get("initial_sync_ms") or -1)
            status_line(f"primary {h0.name}", st)
            try:
                rg.check_disk("protected", timeout=PROTECTED_IO_S)
            except LabError as e:
                raise LabError(f"{e}\nprimary: {ft_status(rg.guest)}\nstandby: {ft_status(rg.guest, h1)}") from None
            fl.start_writer()
            rg.conn.expect_progress(20, timeout=120)
            fl.check_records("protected")
        h2 = next(h for h in lab.hosts if h not in (h0, h1))
        with step(f"(a) power failure of {h0.name}: {h1.name} takes over"):
            killed = _power_failure(fl, h0, h1, "power1", times)
        with step(f"(a) re-protection of {h1.name}'s VM on {h2.name} by the agents"):
            st, standby = fl.wait_protected(h1, timeout=600)
            times["power1_reprotected_s"] = st["seen_at"] - killed
            if standby is not h2:
                raise LabError(f"the agents chose {standby.name}, expected the third host {h2.name}")
            fl.fleet_table()
        with step(f"(c) partition: {h1.name} cut off; {h2.name} takes over after {h1.name} stops"):
            cut = _partition(fl, h1, h2, times)
        with step(f"(c) healing {h1.name}: no copy there; it protects {h2.name}'s VM"):
            subprocess.run(["ip", "-n", ns, "link", "set", h1.tap, "up"], check=True, capture_output=True)
            healed = time.monotonic()
            times["partition_cut_s"] = healed - cut
            # Its agent, back in touch with etcd, reaps the copy that stood down.
            m = h1.wait_file_match(
                AGENT_LOG,
                re.compile(r"started here as a standby ended[^\n]*status=([^\n]*)"),
                120,
                "the agent to reap the copy that stood down",
            )
            images.log(f"{h1.name}: its agent saw the cut-off copy end: {m.group(1)}")
            if "exit status: 1" not in m.group(1):
                raise LabError(f"{h1.name}: the cut-off copy did not exit 1: {m.group(0)}")
            st, standby = fl.wait_protected(h2, timeout=600)
            times["heal_to_reprotected_s"] = st["seen_at"] - healed
            if standby is not h1:
                raise LabError(f"the agents chose {standby.name}, expected the healed {h1.name}")
            roles = fl.etcd.get(f"{PREFIX}/_fleet/hosts/{h1.name}")
            if roles is None:
                raise LabError(f"{h1.name}: its agent is not registered after the heal")
            fl.fleet_table()
        with step(f"(d)+(b) one etcd member killed; {h2.name} loses power: {h1.name} runs the VM"):
            victim = fl.etcd.leader()
            times["etcd_killed_member_was_leader"] = float(victim is not None)
            victim = 0 if victim is None else victim
            fl.etcd.kill(victim)
            images.log(f"etcd member m{victim} killed ({'the leader' if times['etcd_killed_member_was_leader'] else 'leader unknown'})")
            time.sleep(3)
            _power_failure(fl, h2, h1, "power2", times)
            if len(fl.vmm_running(h1)) != 1:
                raise LabError(f"{h1.name}: expected one kemari, found {fl.vmm_running(h1)}")
        with step(f"the VM alone on {h1.name}"):
            table = fl.fleet_table()
            if h1.name not in table:
                raise LabError(f"kemarictl fleet does not show {h1.name}:\n{table}")
            info = rg.guest.info()
            if info.get("state") != "running":
                raise LabError(f"{h1.name}: the guest does not run: {info}")
        with step(f"closing the connection, powering off on {h1.name}"):
            times.update(fl.finish())
    return times
